"""Check, in a test, the job a lesson notebook already ran in this pytest session, instead of a copy.

``make test`` executes the learner's notebooks (``build/learner``) before ``tests/`` and names that
folder in ``DDP_COURSE_NOTEBOOK_RUNS``. Where a test checks a job that a notebook also runs -- the
same module, process count, options and environment -- it reads the notebook's run (its
``launch.json`` record and the files the job wrote) instead of launching the same job again: each
launch starts Python and torch in two or more processes, seconds each on a small CPU.

Only a run finished during this pytest session counts, so a folder left by an earlier session (or
by other code) is never mistaken for this one's. Without the variable, or when the notebook's run
differs in any option, :func:`reuse` returns None and the test launches its own job as usual.

The same holds for the notebooks' grading cells: ``ddp_course.check.grade`` notes each verdict in
``runs/check/<exercise>.json`` of the notebook's folder, with the sha256 of the graded file and of the
grader's module. :func:`grade` gives a test that verdict when the notebook graded a file identical
to the test's, in this session, with the same grader and options (a test's shorter ``timeout``
counts as the same when the notebook's grading finished within it); else it grades as usual.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_course import check  # imports no torch: a kernel given kernel_preamble() stays as quick to start

if TYPE_CHECKING:
    from ddp_course.launch import Run

VAR = "DDP_COURSE_NOTEBOOK_RUNS"
SESSION_START = time.time()  # reset by conftest.pytest_sessionstart


def _same(rec: dict[str, Any], module: str, nproc: int, flags: dict[str, Any], env: dict[str, str]) -> bool:
    theirs = {k: v for k, v in rec["overrides"].items() if k != "out_dir"}
    ours = {k: v for k, v in flags.items() if k != "out_dir"}
    return rec["module"] == module and rec["nproc"] == nproc and theirs == ours and rec["env"] == env


def folder(rel: str) -> Path | None:
    """The notebooks' folder ``rel`` (e.g. ``runs/12``) when ``make test`` named one, else None."""
    root = os.environ.get(VAR)
    return Path(root) / rel if root else None


def fresh(path: Path) -> bool:
    """True if ``path`` exists and was last written during this pytest session."""
    return path.exists() and path.stat().st_mtime >= SESSION_START


def reuse(rel: str, module: str, nproc: int, env: dict[str, str] | None = None,
          torchrun_args: list[str] | None = None, **flags: Any) -> Run | None:
    """The notebook's finished run in ``rel`` if it is this exact job from this session, else None.

    ``torchrun_args`` (e.g. ``["--max-restarts=1"]``) must be in the notebook's command too.
    """
    from ddp_course.launch import RECORD, Run

    base = folder(rel)
    if base is None or not fresh(base / RECORD):
        return None
    rec = json.loads((base / RECORD).read_text(encoding="utf-8"))
    if not all(a in rec["command"] for a in torchrun_args or []):
        return None
    return Run.load(base) if _same(rec, module, nproc, flags, env or {}) else None


def _same_options(theirs: dict[str, Any], ours: dict[str, Any], elapsed_s: float) -> bool:
    """The same options; a timeout may be shorter than the notebook's if its grading ended within it."""
    if {k: v for k, v in theirs.items() if k != "timeout"} != {k: v for k, v in ours.items() if k != "timeout"}:
        return False
    mine, nb = ours.get("timeout"), theirs.get("timeout")
    return mine == nb or (mine is not None and nb is not None and elapsed_s < mine <= nb)


def graded(number: str, path: str | Path, **kwargs: Any) -> check.Verdict | None:
    """The verdict a notebook of this session got from ``check.grade(number, <a file identical to
    path>, **kwargs)``, by the same grader, or None."""
    import importlib

    base = folder(".")
    try:
        exercise = check.resolve(number, path)
    except ValueError:
        return None  # check.grade says why
    if base is None or not fresh(check.record_path(exercise.name, base)) or not Path(path).is_file():
        return None
    digest = check.sha256_file(path)
    found = [e for e in check.recorded(exercise.name, base)
             if e["sha256"] == digest and e["started"] >= SESSION_START]
    if not found:
        return None
    grader = importlib.import_module(exercise.module)  # only now: a grader may import torch
    grader_digest = check.sha256_file(grader.__file__)
    options = json.loads(json.dumps(check.grader_options(grader, path, kwargs), default=str))
    for e in found:
        if e["grader_sha256"] == grader_digest and _same_options(e["options"], options, e["elapsed_s"]):
            if "records" in e:
                return check.GradedRun(e["ok"], e["message"], e["records"])
            return check.Verdict(e["ok"], e["message"])
    return None


def grade(number: str, path: str | Path, **kwargs: Any) -> check.Verdict:
    """``check.grade(number, path, **kwargs)``, or the verdict a notebook of this session got for the same."""
    return graded(number, path, **kwargs) or check.grade(number, path, **kwargs)


def kernel_preamble() -> str:
    """Code for the first cell of a kernel a test starts: its ``check.grade`` then does what :func:`grade`
    does, for this pytest session (the kernel is another process, started with this one's environment)."""
    return (f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\nimport notebook_runs\n"
            f"sys.path.pop(0)\nnotebook_runs.SESSION_START = {SESSION_START!r}\n"
            "from ddp_course import check\n_grade = check.grade\n"
            "check.grade = lambda number, path, **kw: notebook_runs.graded(number, path, **kw) or _grade(number, path, **kw)\n")
