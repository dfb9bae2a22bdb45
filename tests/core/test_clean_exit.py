"""A finished job exits 0: the exit guard in ``ddp_course.dist`` ends every process group in order.

Without it, gloo's worker threads outlive the interpreter (DDP's import of
``torch.distributed.nn.functional`` keeps the default group alive), and a worker that is still
dropping a gradient all-reduce started during backward when finalization begins aborts the process
(SIGABRT, "terminate called without an active exception"). That race is rare per launch, so a
test cannot wait for it; what it needs is checked instead, deterministically: after the guard, no
gloo thread is left at exit. ``python -m ddp_course.bench clean_exit --launches=200`` is the
stress check of the whole thing.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import torch
from harness import TINY, torchrun

from ddp_course.dist import exit_guard_needed, quick_exit_is_quiet

EXIT_LINE = re.compile(r"^\[exit\] rank (\d+): gloo threads left: (\d+), objects frozen: (\d+)$", re.M)
TRAIN_ARGS = ["--strategy=ddp", "--max_steps=3", *(f"--{k}={v}" for k, v in TINY.items())]


def _threads_left(output: str) -> dict[int, int]:
    return {int(r): int(n) for r, n, _ in EXIT_LINE.findall(output)}


def test_ddp_job_ends_with_no_gloo_thread_left(tmp_path):
    proc = torchrun("ddp_course.train", 2, [*TRAIN_ARGS, f"--out_dir={tmp_path}"], timeout=120,
                    env={"DDP_COURSE_EXIT_REPORT": "1"})
    assert _threads_left(proc.stdout) == {0: 0, 1: 0}, proc.stdout[-2000:]
    # ... and then the quick exit: what is still alive is frozen, out of the final collections' way,
    # except where triton is installed (torch._dynamo loads it in every rank): no freeze, no leak report
    frozen = {int(r): int(f) for r, _, f in EXIT_LINE.findall(proc.stdout)}
    triton = importlib.util.find_spec("triton") is not None
    assert set(frozen) == {0, 1} and all((f == 0) if triton else (f > 0) for f in frozen.values()), frozen
    assert "nanobind" not in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_no_quick_exit_where_triton_is_loaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    assert quick_exit_is_quiet()
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert not quick_exit_is_quiet()


def test_without_the_guard_the_workers_outlive_the_interpreter(tmp_path):
    """The reason the guard exists, still true of this PyTorch: remove the guard and this is what is
    left. Before ``dist.EXIT_GUARD_NEEDED_FROM`` PyTorch joined the workers by itself, and this test
    says so instead: the two outcomes tell the versions apart, and a release that changes which one
    it gives fails here."""
    proc = torchrun("ddp_course.train", 2, [*TRAIN_ARGS, f"--out_dir={tmp_path}"], timeout=120,
                    env={"DDP_COURSE_EXIT_REPORT": "1", "DDP_COURSE_NO_EXIT_GUARD": "1"})
    left = _threads_left(proc.stdout)
    assert set(left) == {0, 1}, proc.stdout[-2000:]
    if exit_guard_needed():
        assert all(n > 0 for n in left.values()), (
            f"gloo threads left without the guard: {left}. If PyTorch {torch.__version__} now releases the group "
            "by itself, the workaround in ddp_course/dist.py (clean_exit) may no longer be needed: check the "
            "upstream issue, and move EXIT_GUARD_NEEDED_FROM.")
    else:
        assert all(n == 0 for n in left.values()), (
            f"gloo threads left without the guard on PyTorch {torch.__version__}: {left}. The guard is needed on "
            "this version too: move EXIT_GUARD_NEEDED_FROM in ddp_course/dist.py back to it.")


def test_exit_guard_versions():
    assert not exit_guard_needed("2.10.0+cu128") and exit_guard_needed("2.11.0") and exit_guard_needed("2.13.0+cpu")
