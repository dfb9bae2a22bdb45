"""The exercises' grading harness: ``python -m ddp_course check NN PATH``.

Script graders live in their lesson's folder, ``ddp_course/course/lNN_<topic>/grader.py`` (each with
``grade(path, **kwargs) -> Verdict``); ``run_exercise`` runs a script and collects the ``RESULT
{json}`` lines it prints (``results(output)`` reads them). A notebook's own checks live in its lesson
folder too (e.g. ``ddp_course.course.l01_minigpt.grader.attention``).

A grader runs the learner's code for real (scripts with torchrun) and compares it against the
course's own reference; it says what is wrong, not only that something is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


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


def last_lines(output: str, n: int = 15) -> str:
    """`` Last lines:`` and the last ``n`` lines of a job's output: what a failing verdict shows."""
    return " Last lines:\n" + "\n".join(output.splitlines()[-n:])


def run_exercise(path: str | Path, nproc: int, what: str, timeout: float, *,
                 hint: Callable[[str], str] = lambda output: "", tail: Callable[[str], str] = last_lines,
                 **run_kwargs) -> list[dict] | Verdict:
    """Run exercise script ``path`` on ``nproc`` processes: its ``RESULT`` lines, one per rank.

    Or, when there are not that many, the failing verdict that says why: a TODO left (``what`` names
    it), a job stopped at ``timeout``, or a rank that did not finish (``hint(output)`` may add a
    likely cause, ``tail(output)`` shows the end of the output). The graders share this first step.
    """
    from ddp_course.launch import LaunchTimeout, run

    try:
        r = run(str(path), nproc=nproc, echo="none", progress=False, timeout=timeout, check=False, **run_kwargs)
    except LaunchTimeout as exc:
        return Verdict(False, f"the script did not finish within {timeout:.0f}s and was stopped."
                              f"{hint(exc.run.output)}{tail(exc.run.output)}")
    if "NotImplementedError" in r.output:
        return not_complete(what, path)
    found = results(r.output)
    if len(found) != nproc:
        return Verdict(False, f"with {nproc} processes the script did not finish on every rank "
                              f"(exit code {r.returncode}).{hint(r.output)}{tail(r.output)}")
    return found


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
