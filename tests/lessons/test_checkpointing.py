"""Lesson 08 (checkpointing): its labs. ``ckpt_reshard`` loads the checkpoints 2 ranks saved into 4 ranks
(the same weights, each rank's generator, the same global batch continued), and ``ckpt_kill`` is killed
in the middle of a save, which leaves the previous checkpoint whole, in both formats.

The 2-rank checkpoints are those of lesson 08's runs (section 4): in ``make test`` the notebook's runs
are read (``notebook_runs``) instead of being launched again. What the core guarantees of the same runs
(the restarted job equals the uninterrupted one; a load into one process) is in
``tests/core/test_checkpoint.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import notebook_runs
import pytest
import torch
from checkpoint_runs import CKPT, crash_and_reference
from harness import start_python_module

from ddp_course import checkpoint
from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.launch import run
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import build_optimizer

RESHARD = "ddp_course.course.l08_checkpointing.ckpt_reshard"
KILL = "ddp_course.course.l08_checkpointing.ckpt_kill"
ONE = DistInfo()  # one process, no process group


def _fresh(shape: dict, seed: int = 1):
    torch.manual_seed(seed)
    model = MiniGPT(GPTConfig(**shape))
    return model, build_optimizer(model, TrainConfig(), torch.device("cpu"))


def _load_one_process(path: Path):
    shape = checkpoint.load(path)["shape"]
    model, opt = _fresh(shape)
    checkpoint.resume(path, checkpoint.TrainState(model, opt, checkpoint.DCP, shape), ONE)
    return model, opt


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Lesson 08's uninterrupted 2-rank DDP run (full checkpoints) and the same run crashed on rank 1 and
    restarted by torchrun (sharded checkpoints): ``checkpoint_runs``."""
    return crash_and_reference(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.timeout(400)
def test_two_rank_checkpoints_load_into_four_ranks(runs, tmp_path):
    full = checkpoint.checkpoint_path(runs["reference"].out_dir, CKPT, "full")
    sharded = checkpoint.checkpoint_path(runs["sharded"].out_dir, CKPT, "sharded")
    want = checkpoint.fingerprint(*_load_one_process(full), plan=checkpoint.DCP)
    # lesson 08 reloads the same two checkpoints of its runs into 4 ranks, naming them from its folder
    nb = notebook_runs.folder(".")
    job = nb and notebook_runs.reuse("runs/08_reshard", RESHARD, 4,
                                     ckpts=",".join(os.path.relpath(p, nb.resolve()) for p in (full, sharded)))
    out = job.out_dir if job else tmp_path
    if not job:
        run(RESHARD, nproc=4, out_dir=tmp_path, timeout=200, progress=False, echo="none", ckpts=f"{full},{sharded}")
    for rank in range(4):
        report = json.loads((out / f"reshard_rank{rank}.json").read_text())
        assert report["world_size"] == 4
        for row, fmt in zip(report["checkpoints"], ("full", "sharded")):
            assert row["format"] == fmt and row["saved_world_size"] == 2 and row["step"] == CKPT
            assert row["fingerprint"] == want, (rank, fmt)
            assert row["rng_from_rank"] == (rank if rank < 2 else 0)
            # same global batch (2 x 8) on 4 ranks: micro-batches of 4, continuing at the 41st
            assert row["same_global_batch"] == {"global_batch": 16, "micro_batch_size": 4, "start_batch": CKPT}



# --- SIGKILL in the middle of a save ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, tuple[Path, int, Path]]:
    """The kill lab, once per format, as two plain processes started together: {format: (its folder,
    exit code, the folder it ran in)}. Lesson 08 runs the full format's: make test reads a copy of the
    notebook's folder (the test saves into it)."""
    root = tmp_path_factory.mktemp("kill")
    out = {}
    lesson = notebook_runs.reuse("runs/08_kill", KILL, 1, format="full")
    if lesson is not None:
        shutil.copytree(lesson.out_dir, root / "full")
        out["full"] = (root / "full", lesson.returncode, lesson.out_dir)
    procs = {fmt: start_python_module(KILL, [f"--format={fmt}", f"--out_dir={root / fmt}"])
             for fmt in checkpoint.FORMATS if fmt not in out}
    for fmt, p in procs.items():
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"ckpt_kill --format={fmt} did not finish in 120 s")
        out[fmt] = (root / fmt, p.returncode, root / fmt)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(killed, fmt):
    out_dir, returncode, ran_in = killed[fmt]
    assert returncode == -9  # killed by SIGKILL, as planned
    report = json.loads((out_dir / "ckpt_kill.json").read_text())
    half = out_dir / Path(report["killing"]).relative_to(ran_in)
    assert half.exists()  # the save really was under way: its temporary name is on disk
    assert checkpoint.latest(out_dir) == checkpoint.checkpoint_path(out_dir, 1, fmt)
    assert [p.name for p in checkpoint.list_checkpoints(out_dir)] == [checkpoint.checkpoint_path(out_dir, 1, fmt).name]
    model, opt = _fresh(checkpoint.load(checkpoint.latest(out_dir))["shape"])
    meta = checkpoint.resume(checkpoint.latest(out_dir), checkpoint.TrainState(model, opt, checkpoint.DCP), ONE)
    assert meta["step"] == 1 and checkpoint.fingerprint(model, opt, plan=checkpoint.DCP) == report["fingerprint"]
    # the next save clears the leftover and commits normally
    checkpoint.save(out_dir, checkpoint.TrainState(model, opt, checkpoint.DCP, meta["shape"], 3), ONE, fmt=fmt)
    assert not half.exists() and checkpoint.latest(out_dir).name == checkpoint.checkpoint_path(out_dir, 3, fmt).name
