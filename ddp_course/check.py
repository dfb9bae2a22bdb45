"""The exercises' grading harness: ``python -m ddp_course check NN PATH``.

Script graders live in their lesson's folder, ``ddp_course/course/lNN_<topic>/grader.py`` (each with
``grade(path, **kwargs) -> Verdict``); ``run_exercise`` runs a script and collects the ``RESULT
{json}`` lines it prints (``results(output)`` reads them). A notebook's own checks live in its lesson
folder too (e.g. ``ddp_course.course.l01_minigpt.grader.attention``).

A grader runs the learner's code for real (scripts with torchrun) and compares it against the
course's own reference; it says what is wrong, not only that something is.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


@dataclasses.dataclass
class Verdict:
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}: {self.message}"

    def _repr_markdown_(self) -> str:  # shown as a line of text in a notebook
        return f"**{'PASS' if self.ok else 'FAIL'}**: {self.message}"


@dataclasses.dataclass
class GradedRun(Verdict):
    """A verdict that keeps the job's ``RESULT`` records (one per rank; empty when the job gave none),
    so that a notebook can show what the graded run measured without launching it again."""

    records: list[dict] = dataclasses.field(default_factory=list, repr=False)


def graded_records(verdict: Verdict, what: str) -> list[dict]:
    """The records of a graded run (a ``GradedRun``'s), for a notebook cell that shows them; a
    ``ValueError`` that says what to do when there are none. ``what`` names the missing run, e.g.
    "timed run of your loader"."""
    records = getattr(verdict, "records", None)
    if not records:
        raise ValueError(f"there is no {what} yet: the grading verdict is \"{verdict}\". "
                         "Complete the exercise, re-run the grading cell, then this one.")
    return records


# A grader names a mistake when what the job measured is this many times nearer to the grader's own
# simulation of that mistake than to any other explanation it has (the right answer included), not
# when it falls within a fixed tolerance of it. The closest pair of explanations in the course is
# 1.0e-4 apart (relative: exercise 11's forward mistakes); rounding between ranks and one process
# stays below 1e-6 (8e-7 measured), a margin of 100x or more. A number that lies between two
# explanations is never forced into one of them.
MARGIN = 20.0


@dataclasses.dataclass(frozen=True)
class Nearest:
    """The explanation that some measured numbers are nearest to, and the runner-up.

    Distances are the largest relative difference over the numbers compared.
    """

    name: str
    distance: float
    runner_up: str
    runner_up_distance: float

    def clear(self, margin: float = MARGIN) -> bool:
        """True if ``name`` is at least ``margin`` times nearer than any other explanation."""
        return self.distance < float("inf") and self.distance * margin <= self.runner_up_distance

    def shown(self, labels: dict[str, str] | None = None) -> str:
        """The margin in words, for a verdict: how far from this explanation, and from the next one."""
        label = (labels or {}).get(self.runner_up, self.runner_up)
        return (f"the measured numbers are {self.distance:.1e} (relative) from the grader's simulation of this "
                f"mistake, {self.runner_up_distance:.1e} from the next nearest explanation ({label})")


def nearest(measured: Sequence[float | None], candidates: dict[str, Sequence[float]]) -> Nearest:
    """Which of ``candidates`` (name -> the numbers that explanation predicts, in the order of
    ``measured``) is nearest to ``measured``. A missing measurement (None) is infinitely far."""
    def distance(predicted: Sequence[float]) -> float:
        if len(predicted) != len(measured) or any(m is None for m in measured):
            return float("inf")
        return max((abs(m - p) / max(abs(p), 1e-30) for m, p in zip(measured, predicted)), default=0.0)

    (d1, first), (d2, second) = sorted((distance(v), k) for k, v in candidates.items())[:2]
    return Nearest(first, d1, second, d2)


NOT_COMPLETE = "exercise not complete"
STUB = "exercise: complete this part"  # the message of the stub every TODO of lessons/ raises


def not_complete(what: str, where: str | Path | None = None, plural: bool = False) -> Verdict:
    """The verdict on an exercise whose TODO is still there, saying what to do next.

    ``where`` is the exercise script's path; ``None`` means an exercise in the notebook (the cell
    above the check).
    """
    todo = ("fill in the TODO in the exercise cell above and run that cell" if where is None else
            f"fill in the TODO in {where} and save the file")
    return Verdict(False, f"{NOT_COMPLETE}: {what} still raise{'' if plural else 's'} NotImplementedError. {todo[0].upper()}{todo[1:]}, "
                          "then re-run this cell.")


def replace_function_body(source: str, name: str, body: str) -> str:
    """``source`` with the body of its top-level function ``name`` replaced by ``body``.

    The docstring stays; everything after it down to the function's last line (code, comments, a
    TODO) is replaced. ``body`` is the new lines, indented as the function's body. Works the same
    on a learner's file and on the course's, whatever the function held.
    """
    import ast

    fn = next((n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
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


def results(output: str) -> list[dict]:
    """The ``RESULT {json}`` lines an exercise script printed (one per rank)."""
    import json

    decoder = json.JSONDecoder()
    found = []
    for line in output.splitlines():
        # Usually one per line; tolerate two ranks' lines glued together ("RESULT {..}RESULT {..}").
        start = line.find("RESULT {")
        while start >= 0:
            try:
                obj, end = decoder.raw_decode(line, start + len("RESULT "))
            except json.JSONDecodeError:
                break
            found.append(obj)
            start = line.find("RESULT {", end)
    return found


def last_lines(output: str, n: int = 15) -> str:
    """`` Last lines:`` and the last ``n`` lines of a job's output, without torchrun's own report of
    the failure: what a failing verdict shows when no rank left an exception to show instead."""
    from ddp_course.postmortem import without_launcher

    return " Last lines:\n" + "\n".join(without_launcher(output).splitlines()[-n:])


def crash_report(job, path: str | Path | None, tail: Callable[[str], str] = last_lines) -> str:
    """Why a job (a ``launch.Run``) failed, for a verdict: each failing rank's exception with its frames
    in ``path`` (the learner's file), as Python shows a traceback; else the end of its output."""
    described = job.failure(path, keep=RECORDS)
    if not described:
        return tail(job.output)
    return f"\n{described}" + (f"\nFix it in {Path(path).name} and run the check again." if path else "")


def hang_report(job, path: str | Path | None, tail: Callable[[str], str] = last_lines) -> str:
    """Where each rank of a job stopped at its timeout was waiting (its line in ``path``, and the
    collective); else the end of its output."""
    where = job.hang(path)
    return f" Where each rank was waiting:\n{where}" if where else tail(job.output)


def syntax_verdict(path: str | Path) -> Verdict | None:
    """A failing verdict for a script Python cannot compile, before any process starts; else None."""
    from ddp_course.postmortem import syntax_error

    found = syntax_error(Path(path))
    if found is None:
        return None
    return Verdict(False, f"{Path(path).name} has a syntax error, so no process could start it:\n{found}\n"
                          "Fix that line (an unclosed bracket often shows on the line after it), then run the "
                          "check again.")


def stub_left(job) -> bool:
    """True when a rank stopped at an exercise stub (``raise NotImplementedError(STUB)``): a TODO left,
    not an error (a NotImplementedError of torch's own is an error like any other)."""
    from ddp_course.postmortem import errors

    states = errors(job.postmortem)
    if states:
        return any(STUB in s.error for s in states)
    return STUB in job.output


def run_exercise(path: str | Path, nproc: int, what: str, timeout: float, *,
                 hint: Callable[[str], str] = lambda output: "", tail: Callable[[str], str] = last_lines,
                 **run_kwargs) -> list[dict] | Verdict:
    """Run exercise script ``path`` on ``nproc`` processes: its ``RESULT`` lines, one per rank.

    Or, when there are not that many, the failing verdict that says why: a syntax error (before any
    process starts), a TODO left (``what`` names it), a job stopped at ``timeout`` (where each rank
    was waiting), or a rank that failed (its exception, in the frames of ``path``). ``hint(output)``
    may add a likely cause; ``tail(output)`` shows the end of the output when no rank left more. The
    graders share this first step.
    """
    from ddp_course.launch import LaunchTimeout, run

    bad = syntax_verdict(path)
    if bad is not None:
        return bad
    try:
        r = run(str(path), nproc=nproc, echo="none", progress=False, timeout=timeout, check=False, **run_kwargs)
    except LaunchTimeout as exc:
        return Verdict(False, f"the script did not finish within {timeout:.0f}s and was stopped."
                              f"{hint(exc.run.output)}{hang_report(exc.run, path, tail)}")
    if stub_left(r):
        return not_complete(what, path)
    found = results(r.output)
    if len(found) != nproc:
        if r.returncode != 0:
            return Verdict(False, f"with {nproc} processes the script failed (exit code {r.returncode}):"
                                  f"{crash_report(r, path, tail)}{hint(r.output)}")
        return Verdict(False, f"with {nproc} processes the script ended without a result from every rank "
                              f"({len(found)} RESULT line(s)).{hint(r.output)}{tail(r.output)}")
    return found


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded exercise script: its grader module and where a learner finds the script."""

    name: str  # the script's stem, e.g. "09_zero1": `check 09_zero1 PATH` names it
    lesson: str  # "09"
    script: str  # "09_zero1.py", in lessons/exercises/ (answered in solutions/exercises/)
    module: str  # "ddp_course.course.l09_fsdp.grader_zero1"

    @property
    def command(self) -> str:
        """The command that grades the learner's copy, as the lesson notebook and README give it."""
        return f"python -m ddp_course check {self.lesson} lessons/exercises/{self.script}"


def _declared_script(path: Path) -> str | None:
    """The ``EXERCISE = "NN_<name>.py"`` a grader module declares, read from its source (not imported)."""
    import ast

    for node in ast.parse(path.read_text(encoding="utf-8")).body:
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
        tree = ast.parse(source)
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
# grader runs, ``grade`` compares the learner's file with the shipped exercise, the learner copy
# that ``tools/make_lessons.py`` writes from ``solutions/exercises/NN_*.py``, by syntax tree:
# formatting, comments, blank lines and docstrings may differ, nothing else may. Left out of the
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
# ``solutions/`` (or when ``tools/make_lessons.py`` cannot be loaded) the shipped
# ``lessons/exercises/`` copy is used, unless it is the very file being graded. When neither exists
# (the package installed without the repository) the grader still runs, and its verdict ends with
# a note that the harness was not compared: failing a correct answer for a missing file would
# surprise more than a verdict that says what it could not check.


@dataclasses.dataclass
class Reference:
    """The shipped learner copy of an exercise script: its text and the name to show for it."""

    source: str
    shown: str  # e.g. lessons/exercises/01_global_val_loss.py


@functools.cache
def _make_lessons():
    """``tools/make_lessons.py`` of the repository beside the package, loaded by path once (or None)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "make_lessons.py"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location("_ddp_course_make_lessons", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 -- e.g. nbformat missing: fall back to the lessons/ copy
        return None
    return module


def exercise_reference(number: str, graded: str | Path | None = None) -> Reference | None:
    """The shipped learner copy of exercise ``number`` (see ``resolve``), or None when the repository
    is not there.

    Regenerated from ``solutions/exercises/<script>`` with ``tools/make_lessons.py``'s own rewrite;
    else ``lessons/exercises/<script>`` unless that is the ``graded`` file itself.
    """
    script = resolve(number, graded).script
    root = Path(__file__).resolve().parents[1]
    src = root / "solutions" / "exercises" / script
    tool = _make_lessons() if src.is_file() else None
    if tool is not None:
        return Reference(tool.transform_source(src.read_text(encoding="utf-8"), str(src.relative_to(root))),
                         f"lessons/exercises/{script}")
    copy = root / "lessons" / "exercises" / script
    if not copy.is_file() or (graded is not None and Path(graded).is_file()
                              and copy.resolve() == Path(graded).resolve()):
        return None
    return Reference(copy.read_text(encoding="utf-8"), f"lessons/exercises/{script}")


def _names(source: str) -> set[str]:
    """The functions and classes a script defines (qualified), e.g. {"shard", "MyDDP.forward"}; not
    ``main``, which every exercise script has."""
    import ast

    tree = ast.parse(source)
    names = {name for name, _ in _defs(tree.body)} | {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return names - {"main"}


# A graded file is another exercise's when it lacks some of the names (functions, classes) that the
# graded exercise's shipped script defines, and holds at least SAME of another's, more than of the
# graded one's. A learner's own file keeps all of its exercise's names (the harness check needs them).
# Between two shipped scripts: 06's only function, `accumulate`, is one of 05's (a 05 file graded as 06
# is left to the harness check); 10 has 2 of its 3 in 04 (a 04 file graded as 10 is told it is 04's).
SAME = 0.8


def _key(exercise: Exercise) -> str:
    """The shortest name ``check`` takes for an exercise: its lesson's number when it is the lesson's only one."""
    alone = sum(ex.lesson == exercise.lesson for ex in exercises().values()) == 1
    return exercise.lesson if alone else exercise.name


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


def _defs(body: list, prefix: str = ""):
    """(qualified name, node) of the functions of ``body`` and of its classes' methods."""
    import ast

    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _defs(node.body, f"{prefix}{node.name}.")


def answer_functions(tree) -> list[str]:
    """Qualified names of the functions whose body holds the stub, in the file's order."""
    import ast

    return [name for name, fn in _defs(tree.body) if any(is_stub(n) for n in ast.walk(fn))]


def _is_region(node) -> bool:
    """A top-level statement of the shipped copy that is (or holds) a stub outside every answer function."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False  # holding a stub makes it an answer function
    if isinstance(node, ast.ClassDef):
        return any(_is_region(child) for child in node.body)
    return any(is_stub(n) for n in ast.walk(node))


def _normalized(node, answers: set[str], editable: set[str]):
    """A copy of top-level statement ``node`` as compared: no docstrings, the answer functions'
    bodies empty, the editable constants' values replaced by a placeholder."""
    import ast
    import copy

    defs = (ast.FunctionDef, ast.AsyncFunctionDef)

    def strip(n, qual: str) -> None:  # qual: n's qualified name as _defs gives it ("" if it has none)
        if isinstance(n, (*defs, ast.ClassDef)):
            first = n.body[0] if n.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                n.body = n.body[1:]
            if isinstance(n, defs) and qual in answers:
                n.body = []
                return
        for child in ast.iter_child_nodes(n):
            inner = f"{qual}.{child.name}" if isinstance(n, ast.ClassDef) and isinstance(child, (*defs, ast.ClassDef)) else ""
            strip(child, inner)

    node = copy.deepcopy(node)
    strip(node, node.name if isinstance(node, (*defs, ast.ClassDef)) else "")
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in editable:
        node.value = ast.Constant(value="<editable>")
    return node


def _statements(tree) -> list:
    """The top-level statements of a module, its docstring left out."""
    import ast

    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _label(node) -> str:
    """How a message names a top-level statement: ``main()``, ``STEPS``, ``import json``..."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{node.name}()"
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    names = [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
    if names:
        return ", ".join(names)
    if isinstance(node, ast.Import):
        return "import " + ", ".join(a.name for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return f"from {'.' * node.level}{node.module or ''} import " + ", ".join(a.name for a in node.names)
    if isinstance(node, ast.If) and "__name__" in ast.dump(node.test):
        return 'the `if __name__ == "__main__":` block'
    return f"the {type(node).__name__.lower()} statement"


def _diverge(a, b, sa=None, sb=None):
    """Where ``a`` and ``b`` first differ: the innermost nodes with a line number, one of each tree
    (None for a statement one side lacks), or None when they are the same."""
    import ast

    if type(a) is not type(b):
        return (a if hasattr(a, "lineno") else sa), (b if hasattr(b, "lineno") else sb)
    if isinstance(a, ast.AST):
        if hasattr(a, "lineno"):
            sa, sb = a, b
        for field in a._fields:
            found = _diverge(getattr(a, field, None), getattr(b, field, None), sa, sb)
            if found:
                return found
        return None
    if isinstance(a, list):
        for x, y in zip(a, b):
            found = _diverge(x, y, sa, sb)
            if found:
                return found
        if len(a) == len(b):
            return None
        k = min(len(a), len(b))
        x, y = (a[k] if k < len(a) else None), (b[k] if k < len(b) else None)
        statements = isinstance(x if x is not None else y, ast.stmt)  # a statement only one side has
        return (x if hasattr(x, "lineno") else None if statements else sa,
                y if hasattr(y, "lineno") else None if statements else sb)
    return None if a == b else (sa, sb)


def _bound_names(node) -> set[str]:
    """The names a top-level import, def or class binds."""
    import ast

    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name for a in node.names}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return set()


def _extra_refused(node, reference: list) -> str | None:
    """Why a top-level statement the shipped copy does not have may not be added (None: it may).

    Allowed: an import of names the harness does not use (or an import the shipped copy already
    makes, or ``import a.b`` where the copy imports ``a`` itself), a helper function of a new name
    without decorators, a string (a note).
    """
    import ast

    protected = {n.id for r in reference for n in ast.walk(r) if isinstance(n, ast.Name)}
    protected |= {name for r in reference for name in _bound_names(r)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if any(ast.dump(node) == ast.dump(r) for r in reference):
            return None  # the same import twice binds the same module
        imported = {(r.module, r.level, a.name, a.asname) for r in reference if isinstance(r, ast.ImportFrom)
                    for a in r.names}
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return "a `*` import may rebind any name the harness uses"
        plain = {a.name.split(".")[0] for r in reference if isinstance(r, ast.Import) for a in r.names if not a.asname}
        clash = []
        for alias in node.names:
            bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)
            same = (isinstance(node, ast.Import) and not alias.asname and bound in plain  # import torch.nn
                    or isinstance(node, ast.ImportFrom) and (node.module, node.level, alias.name, alias.asname) in imported)
            if bound in protected and not same:
                clash.append(bound)
        return None if not clash else f"it rebinds {', '.join(clash)}, which the harness uses"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.name in protected:
            return f"it redefines {node.name}, which the harness uses"
        return "a helper may not have decorators" if node.decorator_list else None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return None
    return "only imports and helper functions may be added outside the TODO"


def _same_kind(old, new) -> bool:
    if type(old) is not type(new):
        return False
    if isinstance(old, dict):
        return old.keys() == new.keys() and all(_same_kind(old[k], new[k]) for k in old)
    if isinstance(old, (list, tuple)):
        return len(old) == len(new) and all(_same_kind(x, y) for x, y in zip(old, new))
    return True


def harness_differences(source: str, reference: str, editable: tuple[str, ...] = ()) -> list[str]:
    """What differs between ``source`` and the shipped copy ``reference`` outside the answer regions,
    one sentence each (line numbers are ``source``'s), in the order of the file; [] when nothing does.

    ``editable``: names of top-level constants that may take another literal value of the same kind.
    """
    import ast
    import difflib

    tree, ref = ast.parse(source), ast.parse(reference)
    answers, editable_ = set(answer_functions(ref)), set(editable)
    mine, theirs = _statements(tree), _statements(ref)
    norm = {id(s): _normalized(s, answers, editable_) for s in (*mine, *theirs)}
    keys_theirs = [f"<region {i}>" if _is_region(s) else ast.dump(norm[id(s)]) for i, s in enumerate(theirs)]
    keys_mine = [ast.dump(norm[id(s)]) for s in mine]
    lines, ref_lines = source.splitlines(), reference.splitlines()

    def quote(text_lines: list[str], node) -> str:
        """The line of ``node``, cut to about 90 characters around the node itself."""
        line = text_lines[node.lineno - 1] if 0 < node.lineno <= len(text_lines) else ""
        start = len(line) - len(line.lstrip())
        if len(line) - start > 90:
            start = max(start, min(node.col_offset - 30, len(line) - 90))
        text = line[start:start + 90].rstrip()
        return f"`{'...' if start > len(line) - len(line.lstrip()) else ''}{text}{'...' if start + 90 < len(line.rstrip()) else ''}`"

    lost, added, free = [], [], set()  # statements of the shipped copy not found; statements of the learner's
    ops = difflib.SequenceMatcher(None, keys_theirs, keys_mine, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        lost += [s for s in theirs[i1:i2] if not _is_region(s)]
        added += mine[j1:j2]
        if any(_is_region(s) for s in theirs[i1:i2]):  # the learner's answer to a top-level TODO
            free |= {id(s) for s in mine[j1:j2]}
    found: list[tuple[int, str]] = []
    for r in lost:
        same = next((m for m in added if _label(m) == _label(r) and type(m) is type(r)), None)
        if same is None:
            found.append((0, f"{_label(r)} (line {r.lineno} of the course's copy, {quote(ref_lines, r)}) is missing"))
            continue
        added.remove(same)
        sa, sb = _diverge(norm[id(r)], norm[id(same)]) or (r, same)
        if sb is None:
            text = f"{_label(r)}: the course's line {sa.lineno}, {quote(ref_lines, sa)}, is missing from your file"
        elif sa is None:
            text = f"{_label(r)}: line {sb.lineno} of your file, {quote(lines, sb)}, is not in the course's copy"
        else:
            text = (f"{_label(r)} differs at line {sb.lineno} of your file ({quote(lines, sb)}; the course's line "
                    f"{sa.lineno} is {quote(ref_lines, sa)})")
        found.append(((sb or same).lineno, text))
    for m in added:
        why = None if id(m) in free else _extra_refused(m, theirs)
        if why:
            found.append((m.lineno, f"line {m.lineno} of your file, {quote(lines, m)}, is not in the course's copy ({why})"))
    for r in theirs:  # the editable constants: another literal of the same kind
        if not (isinstance(r, ast.Assign) and len(r.targets) == 1 and getattr(r.targets[0], "id", None) in editable_):
            continue
        for m in mine:
            if isinstance(m, ast.Assign) and [getattr(t, "id", None) for t in m.targets] == [r.targets[0].id]:
                try:
                    ok = _same_kind(ast.literal_eval(r.value), ast.literal_eval(m.value))
                except ValueError:
                    ok = False
                if not ok:
                    found.append((m.lineno, f"{r.targets[0].id} at line {m.lineno} of your file ({quote(lines, m)}) may "
                                            f"change, but must stay a plain value of the same kind as the course's "
                                            f"{quote(ref_lines, r)}"))
    return [text for _, text in sorted(found, key=lambda x: x[0])]


def check_harness(number: str, path: str | Path, editable: tuple[str, ...] = ()) -> Verdict:
    """Whether script ``path`` keeps exercise ``number``'s harness as shipped (see the notes above).

    Not ok, naming what differs, when it does not; ok with an empty message when it does; ok with a
    note for the grader's verdict when there is no shipped copy to compare with.
    """
    import ast

    reference = exercise_reference(number, path)
    if reference is None:
        return Verdict(True, f"(Note: the part of the script outside the TODO was not compared with the course's "
                             f"exercise {number}: no solutions/exercises/ or lessons/exercises/ copy was found beside "
                             "the ddp_course package, so this verdict trusts the script's own harness.)")
    source = Path(path).read_text(encoding="utf-8")
    try:
        differences = harness_differences(source, reference.source, editable)
    except SyntaxError:
        return Verdict(True, "")  # the grader's run shows the error
    if not differences:
        return Verdict(True, "")
    names = [f"{n}()" for n in answer_functions(ast.parse(reference.source))]
    keep = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else "the TODO"
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return Verdict(False, f"the part of {path} outside the TODO differs from the course's exercise, and the grader "
                          f"needs it as shipped: {'; '.join(differences[:3])}{more}. Restore the part of the file "
                          f"outside the TODO (copy it again from {reference.shown}) and keep your answer in {keep}, "
                          "then re-run the check.")


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
                              f"`python -m ddp_course check {_key(other)} {path}`, or grade your copy of "
                              f"lessons/exercises/{exercise.script} here.")
    left = unfinished(path_.read_text(encoding="utf-8")) if path_.is_file() else []
    if left:
        what = left[0] if len(left) == 1 else ", ".join(left[:-1]) + " and " + left[-1]
        return not_complete(what, path, plural=len(left) > 1)
    grader = importlib.import_module(exercise.module)
    harness = (check_harness(exercise.name, path, tuple(getattr(grader, "EDITABLE", ()))) if path_.is_file()
               else Verdict(True, ""))
    if not harness.ok:
        return harness
    return _graded_and_recorded(exercise.name, path, grader, kwargs, harness.message)


def notebook_exercises() -> list[tuple[str, str]]:
    """(lesson notebook, exercise heading) of every exercise done inside a notebook of ``lessons/``
    (a cell that still raises the stub), each graded by the cell below it; [] without ``lessons/``."""
    import json

    found = []
    for nb in sorted((Path(__file__).resolve().parents[1] / "lessons").glob("[0-9][0-9]_*.ipynb")):
        heading = ""
        for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                heading = next((line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")),
                               heading)
            elif STUB in text and (nb.name, heading) not in found:
                found.append((nb.name, heading))
    return found


def listing() -> str:
    """What ``python -m ddp_course check`` prints: every exercise, its lesson, how it is graded."""
    from ddp_course.course import lesson_folders

    topics = {nn: pkg.rsplit(".", 1)[1][4:] for nn, pkg in lesson_folders().items()}
    lines = ["Exercise scripts (write the TODOs in lessons/exercises/, then run the command):", ""]
    for ex in exercises().values():
        lines.append(f"  {ex.lesson} {topics[ex.lesson]:<22} {ex.name:<22} {ex.command}")
    inline = notebook_exercises()
    if inline:
        lines += ["", "Exercises inside the notebooks (the cell below each exercise grades it):", ""]
        lines += [f"  {nb[:2]} {nb[3:-6]:<22} {heading}" for nb, heading in inline]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(listing())
        return 0
    if len(argv) != 2:
        print("usage: python -m ddp_course check NN PATH   (python -m ddp_course check, alone, lists the exercises)",
              file=sys.stderr)
        return 2
    try:
        resolve(argv[0], argv[1])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if not path.is_file():
        print(f"error: {path} is not a file. Give the path of your exercise script, e.g. "
              f"{resolve(argv[0], argv[1]).command.split()[-1]}", file=sys.stderr)
        return 2
    verdict = grade(argv[0], path)
    print(verdict)
    return 0 if verdict.ok else 1


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

RECORDS = Path("runs") / "check"
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
