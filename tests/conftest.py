"""Shared test set-up: the corpus location, a scratch run folder, and a torchrun helper.

Every test that starts processes passes a timeout, so no test can hang the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Development and CI point the corpus at ../shared/data (no network on those machines). A real
# user's DDP_COURSE_DATA, if set, wins.
if "DDP_COURSE_DATA" not in os.environ and (SHARED_DATA / "tinyshakespeare.txt").is_file():
    os.environ["DDP_COURSE_DATA"] = str(SHARED_DATA)

def pytest_sessionstart(session):
    import time

    import notebook_runs

    notebook_runs.SESSION_START = time.time()  # only notebook runs made from now on are reused


TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "micro_batch_size": 4,
        "eval_batches": 2, "log_interval": 5, "eval_interval": 0}


def torchrun(module: str, nproc: int, args: list[str], timeout: float = 180, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=N -m module args`` and return its output.

    On failure (or timeout) the assertion message carries the whole output of every rank.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


@pytest.fixture
def tiny() -> dict:
    """Overrides for a model small enough that a run takes a second or two on a CPU."""
    return dict(TINY)


@pytest.fixture
def one_thread():
    """Run the test's torch ops on one thread (restored afterwards).

    The tiny models gain nothing from a second thread, and OpenMP threads that spin while another
    process holds the other core make such tests many times slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
