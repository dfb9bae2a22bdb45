"""Check, in a test, the job a lesson notebook already ran in this pytest session, instead of a copy.

``make test`` executes the learner's notebooks (``build/learner``) before ``tests/`` and names that
folder in ``DDP_COURSE_NOTEBOOK_RUNS``. Where a test checks a job that a notebook also runs -- the
same module, process count, options and environment -- it reads the notebook's run (its
``launch.json`` record and the files the job wrote) instead of launching the same job again: each
launch starts Python and torch in two or more processes, seconds each on a small CPU.

Only a run finished during this pytest session counts, so a folder left by an earlier session (or
by other code) is never mistaken for this one's. Without the variable, or when the notebook's run
differs in any option, :func:`reuse` returns None and the test launches its own job as usual.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ddp_course.launch import RECORD, Run

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


def reuse(rel: str, module: str, nproc: int, env: dict[str, str] | None = None, **flags: Any) -> Run | None:
    """The notebook's finished run in ``rel`` if it is this exact job from this session, else None."""
    base = folder(rel)
    if base is None or not fresh(base / RECORD):
        return None
    rec = json.loads((base / RECORD).read_text(encoding="utf-8"))
    return Run.load(base) if _same(rec, module, nproc, flags, env or {}) else None
