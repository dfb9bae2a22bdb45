"""The record of the verdicts: ``runs/check/<exercise>.json``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddp_course.check.verdicts import RECORDS, GradedRun, Verdict

# --------------------------------------------------------------------------------------------------
# the record of the verdicts: runs/check/<exercise>.json
#
# Every verdict a lesson's grader gives through ``grade`` is noted in ``runs/check/<exercise>.json``
# (e.g. ``runs/check/01_global_val_loss.json``) under the working directory (a notebook's own folder
# when a notebook cell grades): which file was graded (its path as shown and the sha256 of its
# bytes), by which grader (its module and the sha256 of its source), with which options, when, how
# long it took, and the verdict. The last ``RECORD_KEEP`` files graded are kept, newest first (the
# same file graded again replaces its entry). With the same course code and torch, grading the same
# bytes again with the same grader and options gives the same verdict (on the CPU the graders' runs
# are deterministic; on a GPU the measured gaps it quotes may differ in their last digits), unless
# the first one hit its timeout: an entry can stand for a grading not yet run. A folder that cannot
# be written leaves no record and changes nothing else.

RECORD_KEEP = 8


def record_path(name: str, base: str | Path = ".") -> Path:
    """Where the verdicts on exercise ``name`` (e.g. "01_global_val_loss") are noted, under folder ``base``."""
    return Path(base) / RECORDS / f"{name}.json"


def sha256_file(path: str | Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def grader_options(grader, path: str | Path, kwargs: dict) -> dict:
    """The options ``grader.grade(path, **kwargs)`` runs with, its defaults filled in (e.g. ``timeout``)."""
    import inspect

    bound = inspect.signature(grader.grade).bind(path, **kwargs)
    bound.apply_defaults()
    return {k: v for i, (k, v) in enumerate(bound.arguments.items()) if i > 0}


def recorded(name: str, base: str | Path = ".") -> list[dict]:
    """The verdicts noted for exercise ``name`` under folder ``base``, newest first ([] if none)."""
    import json

    try:
        return json.loads(record_path(name, base).read_text(encoding="utf-8"))["verdicts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _graded_and_recorded(name: str, path: str | Path, grader, kwargs: dict, note: str) -> Verdict:
    """``grader.grade(path, **kwargs)``, with ``note`` (the harness check's) appended to its message,
    noted in ``runs/check/<name>.json``."""
    import time

    from ddp_course.metrics import write_json
    from ddp_course.paths import show

    started = time.time()
    verdict = grader.grade(path, **kwargs)
    if note:
        verdict = dataclasses.replace(verdict, message=f"{verdict.message} {note}")  # a subclass keeps its records
    try:
        digest = sha256_file(path)
        entry = {"file": show(path), "sha256": digest, "grader": grader.__name__,
                 "grader_sha256": sha256_file(grader.__file__), "options": grader_options(grader, path, kwargs),
                 "started": started, "elapsed_s": round(time.time() - started, 3), "ok": verdict.ok,
                 "message": verdict.message}
        if isinstance(verdict, GradedRun):
            entry["records"] = verdict.records  # what the job measured, for whoever reads this verdict again
        older = [e for e in recorded(name) if e.get("sha256") != digest]
        write_json(record_path(name), {"exercise": name, "verdicts": [entry, *older][:RECORD_KEEP]})
    except (OSError, TypeError, ValueError):
        pass  # no record (a read-only folder, an option that is not JSON): the verdict stands
    return verdict
