"""Lesson 08's two 2-rank jobs (its section 4), which the checkpoint tests of two layers read: the core's
(``tests/core/test_checkpoint.py``: the restarted job equals the uninterrupted one, a load into one
process) and the lesson's (``tests/lessons/test_checkpointing.py``: a reload into 4 ranks).

In ``make test`` both read the notebook's runs of the same jobs (``notebook_runs``); alone, a test file
launches them once per module."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import notebook_runs

from ddp_course.launch import run

if TYPE_CHECKING:
    from ddp_course.launch import Run

# Lesson 08's job (its ELASTIC). dropout > 0: the resumed run must also restore every rank's generator,
# or the masks differ.
BASE = {"strategy": "ddp", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "micro_batch_size": 8,
        "lr": 3e-3, "warmup_steps": 10, "max_steps": 60, "log_interval": 1, "eval_interval": 0, "eval_batches": 2,
        "dropout": 0.1, "ckpt_interval": 20, "threads": 1}
CKPT = 40  # the last checkpoint before the failure
FAIL_AT = 45  # after the step-40 checkpoint and the metrics rows of the steps after it: those steps are redone
CRASH = {"resume": True, "fail_at_step": FAIL_AT, "fail_rank": 1}
TRAIN = "ddp_course.train"
# torch 2.13: restarted workers would read the first attempt's gloo addresses from torchrun's shared store
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def crash_and_reference(root: Path) -> dict[str, Run]:
    """``reference``: the uninterrupted 2-rank DDP run (full checkpoints); ``sharded``: the same run
    crashed on rank 1 at step 45 and restarted by torchrun (sharded checkpoints)."""
    restart = {"torchrun_args": ["--max-restarts=1"], "env": RESTART_ENV}
    return {"reference": notebook_runs.reuse("runs/08_uninterrupted", TRAIN, 2, **BASE) or
            run(TRAIN, nproc=2, out_dir=root / "reference", timeout=150, progress=False, echo="none", **BASE),
            "sharded": notebook_runs.reuse("runs/08_elastic", TRAIN, 2, **restart, **CRASH, ckpt_format="sharded", **BASE)
            or run(TRAIN, nproc=2, out_dir=root / "sharded", timeout=200, progress=False, echo="none", **restart,
                   **CRASH, ckpt_format="sharded", **BASE)}
