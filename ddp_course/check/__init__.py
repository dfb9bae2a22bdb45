"""The exercises' grading harness: ``python -m ddp_course check NN PATH``.

Script graders live in their lesson's folder, ``ddp_course/course/lNN_<topic>/grader.py`` (each with
``grade(path, **kwargs) -> Verdict``); ``run_exercise`` runs a script and collects the ``RESULT
{json}`` lines it prints (``results(output)`` reads them). A notebook's own checks live in its lesson
folder too (e.g. ``ddp_course.course.l01_minigpt.grader.attention``).

A grader runs the learner's code for real (scripts with torchrun) and compares it against the
course's own reference; it says what is wrong, not only that something is.
"""

import sys
from pathlib import Path

from ddp_course.check.harness_check import answer_functions, check_harness, harness_differences
from ddp_course.check.progress import inline_exercises as notebook_exercises
from ddp_course.check.progress import listing
from ddp_course.check.records import (
    RECORD_KEEP,
    graded_and_recorded,
    grader_options,
    record_path,
    recorded,
    sha256_file,
)
from ddp_course.check.reference import (
    SAME,
    Reference,
    exercise_reference,
    is_stub,
    looks_like,
    replace_function_body,
    unfinished,
)
from ddp_course.check.registry import RECORDS, Exercise, exercises, graders, resolve, shortest_key
from ddp_course.check.verdicts import (
    MARGIN,
    NOT_COMPLETE,
    STUB,
    GradedRun,
    Nearest,
    Verdict,
    crash_report,
    graded_job,
    graded_records,
    hang_report,
    judged,
    last_lines,
    nearest,
    not_complete,
    results,
    run_exercise,
    stopped_verdict,
    stub_left,
    syntax_verdict,
)

__all__ = [
    "answer_functions",
    "check_harness",
    "crash_report",
    "Exercise",
    "exercise_reference",
    "exercises",
    "graded_job",
    "graded_records",
    "GradedRun",
    "judged",
    "grader_options",
    "graders",
    "hang_report",
    "harness_differences",
    "is_stub",
    "last_lines",
    "listing",
    "looks_like",
    "MARGIN",
    "Nearest",
    "nearest",
    "not_complete",
    "NOT_COMPLETE",
    "notebook_exercises",
    "RECORD_KEEP",
    "record_path",
    "recorded",
    "RECORDS",
    "stopped_verdict",
    "Reference",
    "replace_function_body",
    "resolve",
    "results",
    "run_exercise",
    "SAME",
    "sha256_file",
    "STUB",
    "stub_left",
    "syntax_verdict",
    "unfinished",
    "Verdict",
    "grade",
    "main",
]


def grade(number: str, path: str | Path, **kwargs) -> Verdict:
    """Run the grader of exercise ``number`` (a lesson's number or an exercise's name, see ``resolve``)
    on a script.

    Before any job starts: a script that still holds a TODO's stub gets its verdict at once, and so
    does a script whose part outside the TODOs differs from the shipped exercise (``check_harness``;
    the grader's ``EDITABLE``, if it has one, names the constants the learner may change). The
    grader's verdict is noted in ``runs/check/<exercise>.json`` (see the end of this module).
    """
    import importlib

    exercise = resolve(number, path)
    path_ = Path(path)
    bad = syntax_verdict(path_) if path_.is_file() else None
    if bad is not None:
        return bad
    other = looks_like(path_, exercise) if path_.is_file() else None
    if other is not None:
        return Verdict(False, f"{path_.name} looks like the file of exercise {other.name} ({other.script}), not of "
                              f"{exercise.name} ({exercise.script}): it defines that exercise's functions. Grade it with "
                              f"`python -m ddp_course check {shortest_key(other)} {path}`, or grade your copy of "
                              f"exercises/{exercise.script} (your workspace's) with `{exercise.command}`.")
    left = unfinished(path_.read_text(encoding="utf-8")) if path_.is_file() else []
    if left:
        what = left[0] if len(left) == 1 else ", ".join(left[:-1]) + " and " + left[-1]
        return not_complete(what, path, plural=len(left) > 1)
    grader = importlib.import_module(exercise.module)
    harness = (check_harness(exercise.name, path, tuple(getattr(grader, "EDITABLE", ()))) if path_.is_file()
               else Verdict(True, ""))
    if not harness.ok:
        return harness
    delegated = _delegated(exercise, path_, tuple(getattr(grader, "DELEGATES", ())))
    if delegated is not None:
        return delegated
    return graded_and_recorded(exercise.name, path, grader, kwargs, harness.message)


def _delegated(exercise: Exercise, path: Path, delegates: tuple[str, ...]) -> Verdict | None:
    """The verdict on a script whose answer hands its work to the course's own version of it, or None."""
    from ddp_course.check.delegation import delegation
    from ddp_course.check.registry import parse_source

    shipped = exercise_reference(exercise.name, path) if path.is_file() else None
    if shipped is None:
        return None
    used = delegation(path.read_text(encoding="utf-8"), shipped.source, answer_functions(parse_source(shipped.source)),
                      delegates)
    if used is None:
        return None
    return Verdict(False, f"{used[0]}() hands its work to the course's own version, {used[1]}: that is the code this "
                          f"exercise asks you to write. Write {used[0]}() with PyTorch's own calls (the hints above the "
                          "exercise say which), then re-run the check.")


USAGE = ("usage: python -m ddp_course check NN [PATH]   (PATH: default, your workspace's copy; "
         "python -m ddp_course check, alone, lists the exercises)")


def _script(exercise: Exercise, given: str | None) -> Path:
    """The file to grade: ``given``, else the workspace's copy. Raises ValueError saying where the
    learner's copy is when ``given`` is not a file."""
    from ddp_course.check.workspace import VAR, home, shown

    mine = home() / "exercises" / exercise.script
    if given is not None and Path(given).is_file():
        return Path(given)
    if given is None and mine.is_file():
        return mine
    if mine.is_file():
        raise ValueError(f"{given} is not a file here ({shown(Path.cwd())}/). Your copy is {shown(mine)}: "
                         f"`{exercise.command}` grades it from any folder.")
    if home().is_dir():
        raise ValueError(f"{given or shown(mine)} is not a file. `python -m ddp_course reset {exercise.script}` "
                         f"brings the course's copy back into your workspace, {shown(home())}/.")
    raise ValueError(f"no workspace yet ({shown(home())}/), so no copy of {exercise.script} to grade: `make lab` or "
                     f"`python -m ddp_course update` makes it (${VAR} names another folder), or give a PATH.")


def main(argv: list[str]) -> int:
    """``python -m ddp_course check [NN [PATH]]``: the listing, or one verdict (exit 0 passed, 1 failed);
    ``--help`` prints the usage (exit 0); anything else is bad input (``error:`` on stderr, exit 2)."""
    if not argv:
        print(listing())
        return 0
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if len(argv) > 2 or any(a.startswith("--") for a in argv):
        print(f"error: expected an exercise and, optionally, a path; got {' '.join(argv)!r}. {USAGE}", file=sys.stderr)
        return 2
    try:
        path = _script(resolve(argv[0], argv[1] if len(argv) == 2 else None), argv[1] if len(argv) == 2 else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verdict = grade(argv[0], path)
    print(verdict)
    return 0 if verdict.ok else 1
