"""The shipped learner copy of an exercise, and what a learner's file holds: the stubs left
(``unfinished``), the functions it defines, and whether it is another exercise's file (``looks_like``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddp_course.check import rewrite
from ddp_course.check.registry import ROOT, Exercise, exercises, parse_source, resolve
from ddp_course.check.verdicts import STUB

SOLUTIONS = ROOT / "solutions" / "exercises"  # the answered scripts the shipped copies are written from


def replace_function_body(source: str, name: str, body: str) -> str:
    """``source`` with the body of its top-level function ``name`` replaced by ``body``.

    The docstring stays; everything after it down to the function's last line (code, comments, a
    TODO) is replaced. ``body`` is the new lines, indented as the function's body. Works the same
    on a learner's file and on the course's, whatever the function held.
    """
    import ast

    fn = next((n for n in parse_source(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
               and n.name == name), None)
    if fn is None:
        raise ValueError(f"no top-level function {name}() in the source")
    lines = source.splitlines(keepends=True)
    if ast.get_docstring(fn, clean=False) is not None:
        start = fn.body[0].end_lineno  # 0-based index of the first replaced line: the one after the docstring
    else:  # comments right above the first statement (a TODO) belong to the body too
        start = fn.body[0].lineno - 1
        while start > fn.lineno and lines[start - 1].strip().startswith("#"):
            start -= 1
    end = fn.end_lineno  # and the comments indented as the body below its last statement
    while end < len(lines) and lines[end].strip().startswith("#") and \
            len(lines[end]) - len(lines[end].lstrip()) > fn.col_offset:
        end += 1
    body = body if body.endswith("\n") else body + "\n"
    return "".join(lines[:start]) + body + "".join(lines[end:])


def is_stub(node) -> bool:
    """True for an ``ast`` node that is the exercise's stub, ``raise NotImplementedError(STUB)``."""
    import ast

    return (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "NotImplementedError"
            and any(isinstance(a, ast.Constant) and a.value == STUB for a in node.exc.args))


def unfinished(source: str) -> list[str]:
    """Where ``source`` still raises the exercise's stub: ``["name()", ...]`` for each top-level
    function that does, ``["Class.method()", ...]`` for each method of a top-level class that does,
    ``["the script"]`` for a stub anywhere else; [] when none is left (or the file does not parse:
    the grader's run then shows the error)."""
    import ast

    try:
        tree = parse_source(source)
    except SyntaxError:
        return []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    where = []
    for node in tree.body:
        parts = ([(f"{node.name}()", node)] if isinstance(node, functions) else
                 [(f"{node.name}.{fn.name}()", fn) for fn in node.body if isinstance(fn, functions)]
                 if isinstance(node, ast.ClassDef) else [])
        named = [name for name, fn in parts if any(is_stub(n) for n in ast.walk(fn))]
        rest = sum(is_stub(n) for n in ast.walk(node)) > sum(is_stub(n) for _, fn in parts for n in ast.walk(fn))
        where += named + (["the script"] if rest and "the script" not in where else [])
    return where


# --------------------------------------------------------------------------------------------------
# the harness of an exercise script: the part outside its TODOs must be the course's
#
# A grader trusts what the script's harness reports (its RESULT lines, its settings). So before a
# grader runs, ``grade`` compares the learner's file with the shipped exercise (the learner copy
# that ``ddp_course.check.rewrite`` writes from ``solutions/exercises/NN_*.py``), by syntax tree
# (``ddp_course.check.harness_check``): formatting, comments, blank lines and docstrings may differ, nothing else may. Left out of the
# comparison are the answer regions as the shipped copy marks them with the course's stub:
#
# - the body of every function (or method) whose body holds the stub (``unfinished`` names them):
#   the answer may be written any way; the function's name, arguments and decorators stay;
# - a stub outside any function (a top-level TODO): whatever the learner put in its place, between
#   the unchanged statements around it.
#
# Also allowed, because an answer may need them: extra top-level imports, and helper functions
# defined at the top level, as long as they bind names the harness does not use (an import that
# rebinds ``json``, ``dist`` or ``abs`` would change the harness). A grader may name constants of
# the harness that the exercise invites the learner to change (its ``EDITABLE``, e.g. exercise 04's
# settings, which its grader reads from the RESULT lines); those may take another literal value of
# the same kind (an int stays an int, a dict keeps its keys).
#
# The reference is regenerated from ``solutions/exercises/`` beside the package (the learner may be
# editing ``lessons/exercises/`` in place, so that copy cannot be the reference of itself); without
# ``solutions/`` the shipped ``lessons/exercises/`` copy is used, unless it is the very file being
# graded. When neither exists
# (the package installed without the repository) the grader still runs, and its verdict ends with
# a note that the harness was not compared: failing a correct answer for a missing file would
# surprise more than a verdict that says what it could not check.


@dataclasses.dataclass
class Reference:
    """The shipped learner copy of an exercise script: its text and the name to show for it."""

    source: str
    shown: str  # e.g. lessons/exercises/01_global_val_loss.py


def exercise_reference(number: str, graded: str | Path | None = None) -> Reference | None:
    """The shipped learner copy of exercise ``number`` (see ``resolve``), or None when the repository
    is not there.

    Regenerated from ``solutions/exercises/<script>`` with the rewrite that writes ``lessons/``;
    else ``lessons/exercises/<script>`` unless that is the ``graded`` file itself.
    """
    script = resolve(number, graded).script
    src = SOLUTIONS / script
    if src.is_file():
        return Reference(rewrite.transform_source(src.read_text(encoding="utf-8"), f"solutions/exercises/{script}"),
                         f"lessons/exercises/{script}")
    copy = ROOT / "lessons" / "exercises" / script
    if not copy.is_file() or (graded is not None and Path(graded).is_file()
                              and copy.resolve() == Path(graded).resolve()):
        return None
    return Reference(copy.read_text(encoding="utf-8"), f"lessons/exercises/{script}")


def functions_of(body: list, prefix: str = ""):
    """(qualified name, node) of the functions of ``body`` and of its classes' methods."""
    import ast

    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from functions_of(node.body, f"{prefix}{node.name}.")


def _names(source: str) -> set[str]:
    """The functions and classes a script defines (qualified), e.g. {"shard", "MyDDP.forward"}; not
    ``main``, which every exercise script has."""
    import ast

    tree = parse_source(source)
    names = {name for name, _ in functions_of(tree.body)} | {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return names - {"main"}


# A graded file is another exercise's when it lacks some of the names (functions, classes) that the
# graded exercise's shipped script defines, and holds at least SAME of another's, more than of the
# graded one's. A learner's own file keeps all of its exercise's names (the harness check needs them).
# Between two shipped scripts: 06's only function, `accumulate`, is one of 05's (a 05 file graded as 06
# is left to the harness check); 10 has 2 of its 3 in 04 (a 04 file graded as 10 is told it is 04's).
SAME = 0.8


def looks_like(path: Path, exercise: Exercise) -> Exercise | None:
    """The exercise whose shipped script ``path`` resembles, when that is not ``exercise`` (a learner
    grading one exercise's file as another's); None when it fits ``exercise`` or fits none."""
    try:
        mine = _names(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None

    def similarity(ex: Exercise) -> float:
        ref = exercise_reference(ex.name, path)
        if ref is None:
            return 0.0
        theirs = _names(ref.source)
        return len(mine & theirs) / max(1, len(theirs))

    own = similarity(exercise)
    if own == 1.0:  # every name of the graded exercise is there: its file (the harness check does the rest)
        return None
    scores = {ex.name: similarity(ex) for ex in exercises().values() if ex.name != exercise.name}
    best = max(scores, key=scores.get, default=None)
    return exercises()[best] if best is not None and scores[best] >= SAME and scores[best] > own else None


def harness_constants(path: str | Path) -> dict:
    """The constants an exercise script sets at its top level (SHAPE, STEPS, LR, SEED, ...), read from its
    syntax tree, not run: what a grader needs to build its reference the way the script builds its model."""
    import ast

    out = {}
    for node in parse_source(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            names = [e.id for e in target.elts] if isinstance(target, ast.Tuple) else [getattr(target, "id", "")]
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            out.update(zip(names, value) if len(names) > 1 else {names[0]: value}.items())
    return out
