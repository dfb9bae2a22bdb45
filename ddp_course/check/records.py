"""The record of the verdicts: ``runs/check/<exercise>.json``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddp_course.check.registry import RECORDS, parse_source
from ddp_course.check.verdicts import GradedRun, Verdict
from ddp_course.check.workspace import home, shown

# --------------------------------------------------------------------------------------------------
# the record of the verdicts: runs/check/<exercise>.json
#
# Every verdict a lesson's grader gives through ``grade`` is noted in ``runs/check/<exercise>.json``
# (e.g. ``runs/check/01_global_val_loss.json``) of the learner's workspace (``check.workspace.home``:
# the same folder whatever the current directory): which file was graded (its path in the workspace,
# or as shown when outside it, and the sha256 of its bytes), by which grader (its module and the sha256 of its source), with which options, when, how
# long it took, and the verdict. The last ``RECORD_KEEP`` files graded are kept, newest first (the
# same file graded again replaces its entry). With the same course code and torch, grading the same
# bytes again with the same grader and options gives the same verdict (on the CPU the graders' runs
# are deterministic; on a GPU the measured gaps it quotes may differ in their last digits), unless
# the first one hit its timeout: an entry can stand for a grading not yet run. A folder that cannot
# be written leaves no record and changes nothing else.

RECORD_KEEP = 8


def record_path(name: str, base: str | Path | None = None) -> Path:
    """Where the verdicts on exercise ``name`` (e.g. "01_global_val_loss") are noted, under folder ``base``
    (default: the learner's workspace, ``check.workspace.home()``)."""
    return (home() if base is None else Path(base)) / RECORDS / f"{name}.json"


def sha256_file(path: str | Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def grader_options(grader, path: str | Path, kwargs: dict) -> dict:
    """The options ``grader.grade(path, **kwargs)`` runs with, its defaults filled in (e.g. ``timeout``)."""
    import inspect

    bound = inspect.signature(grader.grade).bind(path, **kwargs)
    bound.apply_defaults()
    return {k: v for i, (k, v) in enumerate(bound.arguments.items()) if i > 0}


def recorded(name: str, base: str | Path | None = None) -> list[dict]:
    """The verdicts noted for exercise ``name`` under folder ``base`` (default: the workspace), newest first
    ([] if none)."""
    import json

    try:
        return json.loads(record_path(name, base).read_text(encoding="utf-8"))["verdicts"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def graded_and_recorded(name: str, path: str | Path, grader, kwargs: dict, note: str) -> Verdict:
    """``grader.grade(path, **kwargs)``, with ``note`` (the harness check's) appended to its message,
    noted in ``runs/check/<name>.json``."""
    import time

    from ddp_course.metrics import write_json

    started = time.time()
    verdict = grader.grade(path, **kwargs)
    if note:
        verdict = dataclasses.replace(verdict, message=f"{verdict.message} {note}")  # a subclass keeps its records
    try:
        digest, base = sha256_file(path), home()
        entry = {"file": shown(Path(path), base), "sha256": digest, "grader": grader.__name__,
                 "grader_sha256": sha256_file(grader.__file__), "options": grader_options(grader, path, kwargs),
                 "started": started, "elapsed_s": round(time.time() - started, 3), "ok": verdict.ok,
                 "message": verdict.message}
        if isinstance(verdict, GradedRun):
            entry["records"] = verdict.records  # what the job measured, for whoever reads this verdict again
        older = [e for e in recorded(name, base) if e.get("sha256") != digest]
        write_json(record_path(name, base), {"exercise": name, "verdicts": [entry, *older][:RECORD_KEEP]})
    except (OSError, TypeError, ValueError):
        pass  # no record (a read-only folder, an option that is not JSON): the verdict stands
    return verdict


# --------------------------------------------------------------------------------------------------
# exercises inside a notebook: their check cells note their verdicts the same way
#
# The exercise cell defines the answer (a function, or a variable such as ``answer_a``); the cell
# below passes it to a check function of the lesson, decorated with ``notebook_exercise``. The
# verdict is noted in ``runs/check/<NN>_<answer>.json`` of the workspace, with the digest of
# the exercise cell as the kernel ran it (``cell_digest``; the latest cell of the kernel's history
# that binds the answer's name), so that ``python -m ddp_course progress`` can tell a cell edited
# since from the one graded.

def cell_digest(text: str) -> str:
    """The sha256 of a cell's code, formatting and comments aside (its syntax tree, printed back)."""
    import ast
    import hashlib

    try:
        text = ast.unparse(parse_source(text))
    except SyntaxError:
        pass
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def binds(text: str, name: str) -> bool:
    """Whether the cell ``text`` defines ``name`` at its top level (a def, a class or an assignment)."""
    import ast

    try:
        tree = parse_source(text)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def _kernel_cell(name: str) -> str | None:
    """The latest cell this IPython kernel ran that binds ``name`` (None outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    history = shell.user_ns.get("In", []) if shell is not None else []
    return next((cell for cell in reversed(history) if binds(cell, name)), None)


def note_notebook_verdict(lesson: str, answer: str, verdict: Verdict, base: str | Path | None = None,
                          cell: str | None = None) -> None:
    """Note the verdict on lesson ``lesson``'s in-notebook exercise (the one that defines ``answer``),
    given on ``cell`` (default: the latest cell of this kernel that binds ``answer``), in the workspace
    ``base`` (default: the learner's, ``check.workspace.home()``)."""
    import time

    from ddp_course.metrics import write_json

    name, base = f"{lesson}_{answer}", home() if base is None else Path(base)
    notebook = next(iter(sorted(Path.cwd().glob(f"{lesson}_*.ipynb"))), None)
    if notebook is None:  # not run from a folder of lesson notebooks (a test, a script): nothing to note
        return
    cell = _kernel_cell(answer) if cell is None else cell
    entry = {"file": shown(notebook, base), "answer": answer, "cell_sha256": cell_digest(cell) if cell is not None else None,
             "started": time.time(), "ok": verdict.ok, "message": verdict.message}
    try:
        older = [e for e in recorded(name, base) if e.get("file") != entry["file"]]
        write_json(record_path(name, base), {"exercise": name, "verdicts": [entry, *older][:RECORD_KEEP]})
    except (OSError, TypeError, ValueError):
        pass


def notebook_exercise(answer):
    """Decorate an in-notebook exercise's check function (returning a Verdict) so that its verdict is
    noted: ``answer`` is the name the exercise cell defines, or a function of the check's arguments
    that gives it. The lesson is the one of the module the check function lives in."""
    import functools
    import re

    def decorate(check):
        lesson = re.search(r"\.l(\d\d)_", check.__module__ + ".").group(1)

        @functools.wraps(check)
        def checked(*args, **kwargs):
            verdict = check(*args, **kwargs)
            note_notebook_verdict(lesson, answer(*args, **kwargs) if callable(answer) else answer, verdict)
            return verdict

        return checked

    return decorate
