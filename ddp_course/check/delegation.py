"""An answer that hands its work to the course's own version of it is not an answer.

The course keeps its own versions of what some exercises ask for, for the lessons' demonstrations
(``experts.dispatch`` of the lesson on experts, ``no_sync_lab.accumulate`` of the one on accumulation,
the 2-D plan in ``parallel/``). An exercise does not import those modules (``tests/exercises/test_exercises_ask.py``
holds every exercise to it), but a learner can still reach them. :func:`delegation` reads the answer
functions of a learner's script, resolves every name they use that comes from the course (through the
script's imports, imports inside the function, attribute chains such as ``R.merge``) to the object it
names, and reports the first that is the course's version of an answer (:func:`same_contract`): a
function or class of the course with an answer function's qualified name (``merge``, ``Ring.pass_on``)
and as many required arguments, or one the grader lists in ``DELEGATES`` (dotted names, e.g.
``"ddp_course.parallel.fsdp_tp.wrap"``).
"""

from __future__ import annotations

import ast
import importlib
from typing import Any

from ddp_course.check.reference import functions_of
from ddp_course.check.registry import parse_source


def bindings(body: list[ast.stmt]) -> dict[str, str]:
    """{name: dotted path} for the names ``body``'s imports bind (``import a.b as c``, ``from a import b``)."""
    found = {}
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def resolve(dotted: str) -> Any:
    """The object ``dotted`` names (``"ddp_course.x.y.f"``: the longest importable module, then
    attributes), or None when it names nothing of the course."""
    if not dotted.startswith("ddp_course"):
        return None
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else (a call's result, a subscript)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else [*inner, node.attr]
    return None


def required(fn: Any) -> int | None:
    """How many arguments ``fn`` needs (``self`` and ``cls`` aside); None when it has no signature."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and p.name not in ("self", "cls") for p in params)


def same_contract(obj: Any, answers: dict[str, int | None], delegates: tuple[str, ...]) -> str | None:
    """``obj``'s dotted name when it is the course's version of an answer (``answers``: qualified name ->
    the arguments it needs), else None."""
    module, name = getattr(obj, "__module__", "") or "", getattr(obj, "__qualname__", None)
    if not module.startswith("ddp_course") or name is None or not callable(obj):
        return None
    dotted = f"{module}.{name}"
    return dotted if dotted in delegates or (name in answers and required(obj) == answers[name]) else None


def answer_arity(source: str) -> dict[str, int | None]:
    """{qualified name: the arguments it needs} of every function of ``source`` (the shipped copy)."""
    out = {}
    for qual, fn in functions_of(parse_source(source).body):
        args = [a for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
        out[qual] = len(args) - len(fn.args.defaults)
    return out


def delegation(source: str, shipped: str, answers: list[str], delegates: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(answer function, the course's version it uses) for the first answer function of ``source`` that
    uses one (``shipped``: the exercise as shipped, whose answer functions are ``answers``); None when
    none does (or the source does not parse: the grader's run shows the error)."""
    try:
        tree = parse_source(source)
    except SyntaxError:
        return None
    arity = answer_arity(shipped)
    names = {a: arity.get(a) for a in answers}  # qualified: a course class's forward is not TensorParallelMLP.forward
    top = bindings(tree.body)
    for qual, fn in functions_of(tree.body):
        if qual not in answers:
            continue
        local = {**top, **bindings([n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))])}
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                paths = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, (ast.Name, ast.Attribute)) and (parts := _dotted(node)) and parts[0] in local:
                paths = [".".join([local[parts[0]], *parts[1:]])]
            else:
                continue
            for path in paths:
                found = same_contract(resolve(path), names, delegates)
                if found:
                    return qual, found
    return None
