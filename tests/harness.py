"""The test harness: the constants tests share, and THE ways a test starts processes.

A test starts a process one of four ways, each with a deadline, so that no test can hang the suite:

- ``torchrun(module, nproc, args)``: a job under ``torchrun --standalone``;
- ``python_module(module, args)``: one ``python -m module`` child, run to its end;
- ``start_python_module(module, args)``: the same child, left running (for tests that start
  several at once or act on a running one);
- ``spawn(fn, args, world)``: ``torch.multiprocessing.spawn`` of a module-level worker, with
  ``free_port()`` for its rendezvous.

Children run in the repository root with the course's environment (``course_env``). On failure or
timeout the test fails with the command and everything it printed, which is usually the only clue.

Tests import this module by name (``from harness import ...``): pytest puts ``tests/`` on
``sys.path`` because ``tests/conftest.py`` lives there. It imports nothing from the package, so a
spawned worker that re-imports a test module pays nothing for it.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"  # the corpus on development and CI machines (no network)

# A model small enough that a run takes a second or two on a CPU (the `tiny` fixture returns a copy).
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "micro_batch_size": 4,
        "eval_batches": 2, "log_interval": 5, "eval_interval": 0}
TINY_MODEL = {k: TINY[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}  # its shape alone

# Set by torchrun in its workers; a child that inherited them would think it is a rank of some job.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
# Set by make for the commands of its recipes (`make test`, `make test-torch VENV=... TORCH_SPEC=...`): a
# test that runs make in a clone of the course would otherwise set that clone up as the outer make was
# asked to (its venv, its torch), not as the test asks.
MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "VENV", "PYTHON", "TORCH_SPEC", "TORCH_PIP_ARGS",
             "SYSTEM_TORCH", "PYTEST_ARGS", "TEST_WORKERS", "WORK", "PORT")
SPAWN_DEADLINE_S = 90.0


def course_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child: no torchrun variables and none of make's, unbuffered
    output (a killed child still shows what it printed), one OpenMP thread (spinning threads of one
    process slow the other ranks on a small machine), then ``env`` on top."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS + MAKE_VARS}
    return {**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}


def _text(stream: str | bytes | None) -> str:
    """A captured stream as text (TimeoutExpired carries bytes even when the run asked for text)."""
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def _fail(cmd: Sequence[str], what: str, stdout: str, stderr: str) -> NoReturn:
    pytest.fail(f"{shlex.join(cmd)} {what}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")


def run_command(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root with ``course_env(env)`` and return its captured output.

    A run past ``timeout`` seconds fails the test; so does a non-zero exit when ``check``.
    """
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=course_env(env),
                              cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        _fail(cmd, f"did not finish in {timeout}s", _text(exc.stdout), _text(exc.stderr))
    if check and proc.returncode != 0:
        _fail(cmd, f"exited {proc.returncode}", proc.stdout, proc.stderr)
    return proc


def torchrun(module: str, nproc: int, args: Sequence[str], timeout: float = 180, env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node=N -m module args`` and return its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    return run_command(cmd, timeout, env, check)


def python_module(module: str, args: Sequence[str] = (), timeout: float = 120, env: dict[str, str] | None = None,
                  check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` as one plain process (no torchrun) and return its output."""
    return run_command([sys.executable, "-m", module, *args], timeout, env, check)


def start_python_module(module: str, args: Sequence[str] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m module args`` like ``python_module`` and return at once.

    Its stderr goes into its stdout (one pipe to read). The caller owns the process: it must wait
    with a timeout (``communicate(timeout=...)``) and kill it on overrun.
    """
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=course_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., None], args: tuple, world: int, deadline_s: float = SPAWN_DEADLINE_S) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs=world)`` with a deadline.

    ``fn(rank, *args)`` must be a module-level function (spawn pickles it by name). A worker that
    raises makes this raise with the worker's traceback; on overrun the workers are killed and the
    test fails.
    """
    import torch.multiprocessing as mp  # here, not at the top: most tests never spawn

    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__} did not finish within {deadline_s:g}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


# --------------------------------------------------------------------------------------------------
# exercise scripts, answered and with one mistake

def make_lessons() -> ModuleType:
    """The rewrite that writes lessons/ from solutions/ (``ddp_course.check.rewrite``; ``tools/make_lessons.py``
    is its command line)."""
    from ddp_course.check import rewrite

    return rewrite


def answered_exercise(name: str) -> str:
    """``solutions/exercises/<name>`` as a learner who completed it has it (the marker lines gone)."""
    path = ROOT / "solutions" / "exercises" / name
    return make_lessons().answer_source(path.read_text(encoding="utf-8"), path.name)


def graded_answer(folder: Path, lesson: str, name: str, **kwargs: Any) -> tuple[Path, Any]:
    """``solutions/exercises/<name>`` answered, written to ``folder/<name>`` and graded as lesson ``lesson``'s
    grading cell grades it: (its path, the verdict), read from that cell's record when it graded the same
    bytes in this session (``notebook_runs.grade``)."""
    import notebook_runs

    path = folder / name
    path.write_text(answered_exercise(name), encoding="utf-8")
    return path, notebook_runs.grade(lesson, path, **kwargs)


def graded_solution(folder: Path, lesson: str, name: str, grader: ModuleType, **kwargs: Any) -> tuple:
    """:func:`graded_answer`, ranks' records in order: (verdict, its RESULT records sorted by rank, the
    grader's references, the path)."""
    path, verdict = graded_answer(folder, lesson, name, **kwargs)
    return verdict, sorted(verdict.records, key=lambda r: r["rank"]), grader.references(path), path


def exercise_attempt(tmp_path: Path, name: str, function: str, body: str) -> Path:
    """The answered exercise ``name`` with ``function``'s body replaced by ``body``: one mistake."""
    from ddp_course.check import replace_function_body

    path = tmp_path / f"{Path(name).stem}_{function}.py"
    path.write_text(replace_function_body(answered_exercise(name), function, body), encoding="utf-8")
    return path


def at_once(fn: Callable[[], object], n: int) -> list[object]:
    """``fn()`` called by ``n`` threads released at the same moment; their results (an exception in
    one is raised here). For what must not depend on another thread working beside it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    start = threading.Barrier(n)

    def call() -> object:
        start.wait()
        return fn()

    with ThreadPoolExecutor(max_workers=n) as pool:
        return [f.result() for f in [pool.submit(call) for _ in range(n)]]


def grade_in_pairs(grade: Callable[[Path], object], attempts: dict[str, Path], alone: int = 0) -> dict[str, object]:
    """``{name: grade(path)}`` for every attempt, two jobs at a time after the first ``alone`` ones.

    A grading job spends much of its time waiting (process start-up, rendezvous, a timeout or a
    sleep it measures against), which a second job can use: on 2 cores, four of exercise 04's
    attempts took 36 s this way instead of 45 s one after the other. ``alone`` grades the first
    attempts by themselves, e.g. one that fills a cache the others then read.
    """
    from concurrent.futures import ThreadPoolExecutor

    names = list(attempts)
    found = {name: grade(attempts[name]) for name in names[:alone]}
    with ThreadPoolExecutor(max_workers=2) as pool:
        found.update(zip(names[alone:], pool.map(lambda name: grade(attempts[name]), names[alone:])))
    return found


def rejected_and_named(verdict: Any, phrases: Sequence[str]) -> None:
    """A grader's verdict on a classic mistake: a failure whose message says every one of ``phrases``."""
    assert not verdict.ok, verdict.message
    missing = [p for p in phrases if p not in verdict.message]
    assert not missing, f"the verdict does not say {missing}:\n{verdict.message}"
