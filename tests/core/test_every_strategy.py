"""Every strategy of ``ddp_course/parallel/`` (``available_strategies()``: a new file is covered with no
edit here) trains with the course's own loop, saves a checkpoint in each format, and a job resumed
from it in fresh processes ends where the uninterrupted one ends, to the last bit.

The strategies that need a process group run on 2 ranks, all of them in one spawned job (``fsdp_tp``
as a 1 x 2 mesh: tensor parallelism across both ranks), and the resumed runs in a second job, so that
nothing but the checkpoint carries over; the one-process strategies run in this process. A run is 4
AdamW steps of ``ddp_course.train.run_training`` with checkpoints after steps 2 and 4, dropout on (the
resumed run must restore every rank's generator too); the resumed run starts from step 2's. Each
run ends by sampling 8 characters from its model gathered on rank 0 (a collective for FSDP).

CPU runs are deterministic and the checkpoint holds everything the remaining steps depend on, so
there is no tolerance: the same losses, gradient norms and final weights, ``==``. ZeRO-1's full
checkpoint holds AdamW's state gathered from its shards: it must equal DDP's, entry for entry.

The runs also show that the job holds its plan: ``parallel.strategy_of`` (finding a wrapped model's
strategy) refuses to answer while they train, save and resume, so neither the loop nor ``checkpoint``
looks the strategy up again.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import TINY, free_port, spawn

from ddp_course import checkpoint, config, parallel
from ddp_course.config import TrainConfig, available_strategies
from ddp_course.dist import DeviceError, DistInfo, clean_exit
from ddp_course.metrics import read_jsonl
from ddp_course.train import run_training

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
STEPS, CKPT = 4, 2
RUN = {**TINY, "max_steps": STEPS, "ckpt_interval": CKPT, "log_interval": 1, "eval_interval": 0, "warmup_steps": 1,
       "dropout": 0.1, "lr": 3e-3, "keep_last": STEPS, "sample_tokens": 8}
# the values of its own options a strategy needs to run on 2 ranks: its file's TWO_RANKS
OPTIONS = {name: config.strategy_constant(name, "TWO_RANKS", {}) for name in available_strategies()}
GROUP = [n for n in available_strategies() if parallel.Strategy(n).needs_process_group]
ALONE = [n for n in available_strategies() if not parallel.Strategy(n).needs_process_group]


def _cfg(name: str, fmt: str, out: Path, resume: bool) -> TrainConfig:
    return TrainConfig(**{**RUN, **OPTIONS.get(name, {}), "strategy": name, "ckpt_format": fmt,
                          "out_dir": str(out / ("resumed" if resume else "straight") / name / fmt),
                          "resume": resume})


def _start_from_step(straight: TrainConfig, resumed: TrainConfig) -> None:
    """Put the uninterrupted run's step-CKPT checkpoint in the resumed run's folder, named latest."""
    src, dst = (checkpoint.checkpoint_path(c.out_dir, CKPT, c.ckpt_format) for c in (straight, resumed))
    dst.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    (dst.parent / checkpoint.POINTER).write_text(dst.name, encoding="utf-8")


@contextlib.contextmanager
def _plan_held() -> Iterator[None]:
    """``parallel.strategy_of`` raises inside: whatever asks which strategy wrapped a model fails the run."""
    def refuse(model: torch.nn.Module) -> parallel.Strategy:
        raise AssertionError("run_training looked its strategy up again (parallel.strategy_of): the job holds "
                             "its plan; hand it on instead.")

    held, parallel.strategy_of = parallel.strategy_of, refuse
    try:
        yield
    finally:
        parallel.strategy_of = held


def _train_all(names: list[str], out: Path, resume: bool, info: DistInfo) -> dict[str, str]:
    """Train (or resume) each strategy in each format; returns {strategy: why} for those this machine
    cannot run (a ``DeviceError``: ``dp`` needs two CUDA GPUs)."""
    cannot = {}
    for name in names:
        for fmt in checkpoint.FORMATS:
            cfg = _cfg(name, fmt, out, resume)
            if resume and info.is_main:
                _start_from_step(_cfg(name, fmt, out, False), cfg)
            if info.is_distributed:
                dist.barrier()
            try:
                with _plan_held():
                    run_training(cfg, info)
            except DeviceError as exc:
                cannot[name] = str(exc)
    return cannot


def _group_job(rank: int, port: int, out: str, resume: bool, names: list[str]) -> None:
    torch.set_num_threads(1)
    with clean_exit():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
    try:
        _train_all(names, Path(out), resume, DistInfo(rank=rank, local_rank=rank, world_size=WORLD,
                                                      local_world_size=WORLD, backend="gloo"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The runs' folder, and {strategy: why} for the strategies this machine cannot run."""
    out = tmp_path_factory.mktemp("every_strategy")
    cannot: dict[str, str] = {}
    for resume in (False, True):
        spawn(_group_job, (free_port(), str(out), resume, GROUP), WORLD, deadline_s=240)
        cannot.update(_train_all([n for n in ALONE if n not in cannot], out, resume, DistInfo()))
    return out, cannot


@pytest.fixture
def runs(trained) -> Path:
    return trained[0]


def _rows(out_dir: str) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_jsonl(Path(out_dir) / "metrics.jsonl")
            if "loss" in r]


def _final(out_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(out_dir) / checkpoint.FINAL, weights_only=True)["model"]


def test_the_course_has_strategies_of_both_kinds():
    assert {"ddp", "zero1", "fsdp"} <= set(GROUP) and "single" in ALONE


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
@pytest.mark.parametrize("name", available_strategies())
def test_a_resumed_run_ends_where_the_uninterrupted_one_ends(trained, name, fmt):
    runs, cannot = trained
    if name in cannot:
        pytest.skip(cannot[name].split(". ")[0])  # e.g. "--strategy=dp needs at least 2 CUDA GPUs, ..."
    straight, resumed = (_cfg(name, fmt, runs, r).out_dir for r in (False, True))
    rows = _rows(straight)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)), rows
    assert _rows(resumed) == rows[CKPT:]  # steps 3 and 4, redone in fresh processes
    want, got = _final(straight), _final(resumed)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    samples = [json.loads((Path(d) / "summary.json").read_text())["sample"] for d in (straight, resumed)]  # through the gathered model
    assert len(samples[0]) == RUN["sample_tokens"] and samples[1] == samples[0], samples


def test_a_zero1_checkpoint_holds_the_same_adamw_state_as_ddps(runs):
    """ZeRO-1 gathers every rank's part of AdamW into the full checkpoint, keyed by parameter name: the
    same entries, equal to the last bit, as DDP's own checkpoint of the same step."""
    mine, ddp = (checkpoint.load(checkpoint.checkpoint_path(_cfg(n, "full", runs, False).out_dir, CKPT, "full"))
                 ["optimizer"] for n in ("zero1", "ddp"))
    assert mine["state"].keys() == ddp["state"].keys()
    assert all(torch.equal(mine["state"][k][n], v) for k, st in ddp["state"].items() for n, v in st.items())
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in ddp["param_groups"]]
