"""The exercise registry: which exercise scripts exist (each lesson folder's ``grader*.py``
declares its script), what a name on the command line stands for, and the exercises inside the
notebooks."""

from __future__ import annotations

import ast
import dataclasses
import functools
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository beside the package (lessons/, solutions/)
RECORDS = Path("runs") / "check"  # the verdicts' records (check.records) and failing runs' tracebacks, per folder


# CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state (ast2obj_mod,
# python/cpython#106905): when a thread starts ast.parse while another thread is still building its tree
# (its construction paused by a garbage collection that let the other run), the first one fails with
# "SystemError: AST constructor recursion depth mismatch". The graders' checks run in threads when several
# attempts are graded at once (the test suite does), so every parse in check/ goes through this lock.
# tests/exercises/test_grader_harness.py::test_two_threads_parsing_at_once_do_not_break_each_other fails
# without it.
_PARSING = threading.Lock()


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, one thread at a time (see the note above)."""
    with _PARSING:
        return ast.parse(source, filename=filename)


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded exercise script: its grader module and where a learner finds the script."""

    name: str  # the script's stem, e.g. "09_zero1": `check 09_zero1 PATH` names it
    lesson: str  # "09"
    script: str  # "09_zero1.py", in lessons/exercises/ (answered in solutions/exercises/)
    module: str  # "ddp_course.course.l09_fsdp.grader_zero1"

    @property
    def command(self) -> str:
        """The command that grades the learner's copy in their workspace, from any folder."""
        return f"python -m ddp_course check {shortest_key(self)}"


def _declared_script(path: Path) -> str | None:
    """The ``EXERCISE = "NN_<name>.py"`` a grader module declares, read from its source (not imported)."""
    import ast

    for node in parse_source(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["EXERCISE"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return None


@functools.cache
def exercises() -> dict[str, Exercise]:
    """Every graded exercise script, by name, in lesson order: each ``grader.py`` or ``grader_<x>.py``
    of a lesson folder ``ddp_course/course/lNN_<topic>/`` that declares its script (``EXERCISE``)."""
    import importlib.util

    from ddp_course.course import lesson_folders

    found = {}
    for lesson, pkg in lesson_folders().items():
        folder = Path(importlib.util.find_spec(pkg).origin).parent
        for path in sorted(folder.glob("grader*.py")):
            script = _declared_script(path)
            if script is None:
                raise RuntimeError(f"{path.name} in {pkg} declares no EXERCISE = \"{lesson}_<name>.py\"")
            found[Path(script).stem] = Exercise(Path(script).stem, lesson, script, f"{pkg}.{path.stem}")
    return found


def graders() -> dict[str, str]:
    """{exercise name: grader module}, e.g. {"09_zero1": "ddp_course.course.l09_fsdp.grader_zero1"}."""
    return {name: ex.module for name, ex in exercises().items()}


def resolve(name: str, path: str | Path | None = None) -> Exercise:
    """The exercise ``name`` stands for: an exercise's name ("09_zero1") or a lesson's number ("09").

    A lesson with several exercises is told apart by the graded file's name (``PATH`` of ``check 09
    PATH``). A name that fits no exercise, or one that stays ambiguous, raises ValueError saying which
    names there are.
    """
    known = exercises()
    if name in known:
        return known[name]
    ours = [ex for ex in known.values() if ex.lesson == name]
    by_file = [ex for ex in ours if path is not None and Path(path).name == ex.script]
    if len(ours) == 1 or len(by_file) == 1:
        return (by_file or ours)[0]
    if ours:
        raise ValueError(f"lesson {name} has {len(ours)} exercises; name the one to grade: "
                         + " or ".join(f"check {ex.name} PATH" for ex in ours))
    raise ValueError(f"no exercise {name!r}; the graded exercises are {', '.join(known)} "
                     "(`python -m ddp_course check` lists them with their commands)")


def shortest_key(exercise: Exercise) -> str:
    """The shortest name ``check`` takes for an exercise: its lesson's number when it is the lesson's only one."""
    alone = sum(ex.lesson == exercise.lesson for ex in exercises().values()) == 1
    return exercise.lesson if alone else exercise.name
