"""The whole suite as ``make test`` runs it: two pytest sessions side by side.

    python tools/run_tests.py [pytest options...]

Most of the suite's time goes to starting Python and torch in the processes of torchrun jobs, and to
waiting for them: one session at a time leaves a core idle much of the time. Two sessions, each
with its own share of the notebooks and tests, keep both busy.

Each session runs its notebooks (the learner's answered copies in ``build/learner``, made by
``tools/make_lessons.py --answered``) before its tests, so a test that checks a job a notebook also
runs reads the notebook's run (``tests/notebook_runs.py``): such a test sits in its notebook's
session. ``FIRST`` lists that session's share; every other notebook and test file goes to the
second, so a new test file always runs. Lines are printed as they come, prefixed with the session's
name; the exit status is 0 only if both sessions pass. Ctrl-C stops both, and everything they
started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEARNER = ROOT / "build" / "learner"
COMMON = ["--nbval-lax", "--nbval-current-env", "--nbval-sanitize-with", "tests/nbval_sanitize.cfg",
          "--nbval-cell-timeout=600", "-p", "no:cacheprovider"]
# The first session: these notebooks, then the tests that read their runs, then enough of the rest
# to give the two sessions about the same work.
FIRST = {
    "notebooks": ["00_setup", "01_minigpt", "02_collectives", "03_data_parallel", "04_ddp", "11_debugging_lab"],
    "tests": ["test_debug_lab", "test_ddp_lesson", "test_exercise_01", "test_collectives", "test_launch",
              "test_learner_path", "test_lessons_tools", "test_config", "test_data", "test_model",
              "test_notebook_outputs", "test_clean_exit", "test_distributed"],
}


def sessions() -> dict[str, list[str]]:
    """{name: pytest paths}, notebooks first in each."""
    notebooks = sorted(p.stem for p in LEARNER.glob("*.ipynb"))
    tests = sorted(p.stem for p in (ROOT / "tests").glob("test_*.py"))
    if not notebooks:
        raise SystemExit(f"no notebooks in {LEARNER.relative_to(ROOT)}: run "
                         "`python tools/make_lessons.py --answered build/learner` first (make test does).")
    missing = [n for n in FIRST["notebooks"] if n not in notebooks] + [t for t in FIRST["tests"] if t not in tests]
    if missing:
        raise SystemExit(f"tools/run_tests.py: FIRST names {', '.join(missing)}, which do not exist: update it.")

    def paths(nbs: list[str], ts: list[str]) -> list[str]:
        return [f"build/learner/{n}.ipynb" for n in nbs] + [f"tests/{t}.py" for t in ts]

    return {"A": paths(FIRST["notebooks"], FIRST["tests"]),
            "B": paths([n for n in notebooks if n not in FIRST["notebooks"]],
                       [t for t in tests if t not in FIRST["tests"]])}


def _pump(name: str, proc: subprocess.Popen, lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def main(argv: list[str]) -> int:
    env = {**os.environ, "DDP_COURSE_NOTEBOOK_RUNS": str(LEARNER)}
    lock = threading.Lock()
    procs: dict[str, subprocess.Popen] = {}
    pumps = []
    for name, paths in sessions().items():
        cmd = [sys.executable, "-m", "pytest", *paths, *COMMON, f"--basetemp=build/pytest-{name}", *argv]
        print(f"[{name}] {' '.join(['pytest', *paths])}", flush=True)
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
        pumps.append(threading.Thread(target=_pump, args=(name, procs[name], lock), daemon=True))
        pumps[-1].start()
    try:
        codes = {name: p.wait() for name, p in procs.items()}
    except KeyboardInterrupt:
        for p in procs.values():  # pytest stops at Ctrl-C, and the launcher stops its jobs
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        print("Interrupted: both test sessions stopped.", file=sys.stderr)
        return 130
    for t in pumps:
        t.join(timeout=10)
    for name, code in codes.items():
        print(f"[{name}] pytest exited with {code}" + ("" if code == 0 else "  <-- FAILED"), flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
