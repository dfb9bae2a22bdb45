"""Self-checks for the exercises: ``python -m ddp_course check NN PATH`` and the notebook checks.

Script graders live in their lesson's folder, ``ddp_course/course/lNN_<topic>/grader.py`` (each with
``grade(path, **kwargs) -> Verdict``); ``results(output)`` reads the ``RESULT {json}`` lines that
exercise scripts print.

A grader runs the learner's code for real (scripts with torchrun) and compares it against the
course's own reference; it says what is wrong, not only that something is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Verdict:
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}: {self.message}"

    def _repr_markdown_(self) -> str:  # shown as a line of text in a notebook
        return f"**{'PASS' if self.ok else 'FAIL'}**: {self.message}"


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


def attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Verdict:
    """Notebook 01: a hand-written causal attention must equal F.scaled_dot_product_attention."""
    g = torch.Generator().manual_seed(0)
    for shape in ((2, 4, 8, 16), (1, 2, 5, 8)):
        q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            got = fn(q, k, v)
        except NotImplementedError:
            return not_complete(f"{getattr(fn, '__name__', 'your attention')}()")
        except Exception as exc:  # noqa: BLE001 -- a learner's bug is reported, not raised
            return Verdict(False, f"for inputs of shape {tuple(shape)} your attention raised {type(exc).__name__}: {exc}")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return Verdict(False, f"for inputs of shape {tuple(shape)} expected an output of shape "
                                  f"{tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}.")
        # SDPA and the explicit formula round differently in float32: ~1e-6 apart; 1e-5 is well above that
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            k_future = fn(q, k.clone().index_fill_(2, torch.tensor([shape[2] - 1]), 0.0), v)
            leak = not torch.allclose(k_future[:, :, :-1], got[:, :, :-1], atol=1e-6)
            hint = (" Position t attends to later positions: mask the scores above the diagonal with -inf."
                    if leak else " Check the 1/sqrt(head size) scaling and the softmax dimension (the last).")
            err = (got - want).abs().max().item()
            return Verdict(False, f"output differs from scaled_dot_product_attention by up to {err:.3g}.{hint}")
    return Verdict(True, "your attention equals F.scaled_dot_product_attention (causal) on two shapes.")


def graders() -> dict[str, str]:
    """{"NN": module} for the exercises that have a grader: ``ddp_course/course/lNN_<topic>/grader.py``."""
    import importlib.util

    from ddp_course.course import lesson_folders

    return {nn: f"{pkg}.grader" for nn, pkg in lesson_folders().items()
            if importlib.util.find_spec(f"{pkg}.grader") is not None}


def is_stub(node) -> bool:
    """True for an ``ast`` node that is the exercise's stub, ``raise NotImplementedError(STUB)``."""
    import ast

    return (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "NotImplementedError"
            and any(isinstance(a, ast.Constant) and a.value == STUB for a in node.exc.args))


def unfinished(source: str) -> list[str]:
    """Where ``source`` still raises the exercise's stub: ``["name()", ...]`` for each top-level
    function that does, ``["the script"]`` for a stub outside any function; [] when none is left
    (or the file does not parse: the grader's run then shows the error)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    where = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(is_stub(n) for n in ast.walk(node)):
                where.append(f"{node.name}()")
        elif any(is_stub(n) for n in ast.walk(node)):
            where.append("the script")
    return where


def grade(number: str, path: str | Path, **kwargs) -> Verdict:
    """Run exercise ``number``'s grader (``grade`` in its lesson folder's ``grader.py``) on a script.

    A script that still holds a TODO's stub gets its verdict at once, before any job is started.
    """
    import importlib

    if number not in graders():
        raise ValueError(f"no grader for exercise {number!r}; there are graders for {', '.join(graders())}")
    path_ = Path(path)
    left = unfinished(path_.read_text(encoding="utf-8")) if path_.is_file() else []
    if left:
        what = left[0] if len(left) == 1 else ", ".join(left[:-1]) + " and " + left[-1]
        return not_complete(what, path, plural=len(left) > 1)
    return importlib.import_module(graders()[number]).grade(path, **kwargs)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in graders():
        print(f"usage: python -m ddp_course check NN PATH   (NN one of {', '.join(graders())})")
        return 2
    path = Path(argv[1])
    if not path.is_file():
        print(f"error: {path} is not a file. Give the path of your exercise script, e.g. "
              f"lessons/exercises/01_global_val_loss.py")
        return 2
    verdict = grade(argv[0], path)
    print(verdict)
    return 0 if verdict.ok else 1
