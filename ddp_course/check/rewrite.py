"""Generate the learner copies in ``lessons/`` from the answer keys in ``solutions/``.

The solutions are the single source. Each answer is marked once, in the solution::

    # BEGIN SOLUTION hint: average the gradients with dist.all_reduce
    dist.all_reduce(grad)
    grad /= world_size
    # END SOLUTION

and the learner copy gets, at the indentation of the BEGIN line::

    # TODO: average the gradients with dist.all_reduce
    raise NotImplementedError("exercise: complete this part")

A notebook code cell whose first line is ``# SOLUTION CELL [hint]`` becomes a cell with only those
two lines. A notebook cell tagged ``solution-only`` is left out of the learner copy. Code cells lose
their outputs and execution counts; markdown cells are copied unchanged.

    python tools/make_lessons.py            # write lessons/*.ipynb and lessons/exercises/*.py
    python tools/make_lessons.py --check    # exit 1 if any learner file is stale, missing or orphaned
    python tools/make_lessons.py --prune    # write, and delete learner files that have no solution
    python tools/make_lessons.py --answered build/learner   # the lessons as a learner completes them

``--answered DIR`` writes what a learner's *completed* work looks like: every lesson notebook with
the answer in place of each TODO (the solution's lines, without the marker lines), the solutions'
stored outputs kept (nbval compares against them), and ``DIR/exercises/*.py`` answered the same way.
CI runs the notebooks there, so every cell a learner runs is executed, with the learner's files.

Sources -> targets: ``solutions/*.ipynb -> lessons/*.ipynb`` and
``solutions/exercises/*.py -> lessons/exercises/*.py``. Only the standard library and nbformat
(imported when a notebook is read or written) are used. ``tools/make_lessons.py`` is the command
line over this module; the grading harness uses the same rewrite to regenerate the shipped copy of an
exercise it compares a learner's file with (``ddp_course.check.reference``).
"""

from __future__ import annotations

import copy
import hashlib
import re
import warnings
from pathlib import Path

from ddp_course.check.registry import parse_source

FIX = "python tools/make_lessons.py"

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)#\s*BEGIN SOLUTION\b(?P<rest>.*?)\s*$")
END_RE = re.compile(r"^[ \t]*#\s*END SOLUTION\b\s*$")
CELL_RE = re.compile(r"^[ \t]*#\s*SOLUTION CELL\b(?P<rest>.*?)\s*$")
ANY_MARKER_RE = re.compile(r"#\s*(BEGIN SOLUTION|END SOLUTION|SOLUTION CELL)\b")
RAISE = 'raise NotImplementedError("exercise: complete this part")'
DEFAULT_HINT = "your code here"
SOLUTION_ONLY_TAG = "solution-only"
# Notebook metadata kept in the learner copy. Running a notebook rewrites the rest (language_info
# gains the kernel's version, widgets their state), which must not make the learner copy stale.
KEPT_NB_METADATA = ("kernelspec", "title", "authors")
VOLATILE_CELL_METADATA = ("execution",)  # JupyterLab's per-cell run timestamps


class MarkerError(ValueError):
    """A solution marker is nested, unbalanced or malformed. The message names the file and line."""


def _hint(rest: str) -> str:
    rest = rest.strip()
    if rest.lower().startswith("hint:"):
        rest = rest[len("hint:"):].strip()
    return rest or DEFAULT_HINT


def _stub(indent: str, hint: str, newline: str) -> list[str]:
    return [f"{indent}# TODO: {hint}{newline}", f"{indent}{RAISE}{newline}"]


def _newline_of(line: str) -> str:
    for nl in ("\r\n", "\n", "\r"):
        if line.endswith(nl):
            return nl
    return ""


def _rewrite(text: str, filename: str, answered: bool) -> str:
    """The learner copy (``answered=False``: each region becomes a TODO and a raise) or the answered
    copy (``answered=True``: each region keeps its lines, only the marker lines go) of ``text``."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    open_at: int | None = None  # line number of the BEGIN of the region we are in
    for no, line in enumerate(lines, start=1):
        body = line.rstrip("\r\n")
        begin, end = BEGIN_RE.match(body), END_RE.match(body)
        if begin:
            if open_at is not None:
                raise MarkerError(f"{filename}:{no}: '# BEGIN SOLUTION' inside the region opened at line "
                                  f"{open_at}; regions cannot nest (close it with '# END SOLUTION' first).")
            open_at = no
            if not answered:
                nl = _newline_of(line) or "\n"
                out.extend(_stub(begin["indent"], _hint(begin["rest"]), nl))
            continue
        if end:
            if open_at is None:
                raise MarkerError(f"{filename}:{no}: '# END SOLUTION' without a '# BEGIN SOLUTION' before it.")
            open_at = None
            continue
        if CELL_RE.match(body):
            raise MarkerError(f"{filename}:{no}: '# SOLUTION CELL' must be the first line of a notebook code "
                              "cell; in other places mark the answer with '# BEGIN SOLUTION' / '# END SOLUTION'.")
        if ANY_MARKER_RE.search(body) and body.lstrip().startswith("#"):
            raise MarkerError(f"{filename}:{no}: malformed solution marker {body.strip()!r}: write "
                              "'# BEGIN SOLUTION [hint: ...]' or '# END SOLUTION' alone on its line.")
        if open_at is None or answered:
            out.append(line)
    if open_at is not None:
        raise MarkerError(f"{filename}:{open_at}: '# BEGIN SOLUTION' is never closed by '# END SOLUTION'.")
    result = "".join(out)
    if not text.endswith(("\n", "\r")):  # a region closed on the last line: keep the original's ending
        result = result.rstrip("\r\n")
    return result


def transform_source(text: str, filename: str = "<source>") -> str:
    """Replace every ``# BEGIN SOLUTION`` .. ``# END SOLUTION`` region by a TODO and a raise.

    ``filename`` only labels error messages. Raises :class:`MarkerError` for a BEGIN inside a region,
    an END without a BEGIN, a BEGIN never closed, or a ``# SOLUTION CELL`` marker (notebooks only,
    first line of a cell) found here.
    """
    return _rewrite(text, filename, answered=False)


def answer_source(text: str, filename: str = "<source>") -> str:
    """What a learner's completed file looks like: every region's answer in place, the marker lines gone.

    The same marker checks (and errors) as :func:`transform_source`.
    """
    return _rewrite(text, filename, answered=True)


def transform_cell_source(source: str, label: str, answered: bool = False) -> str:
    """A notebook code cell: ``# SOLUTION CELL`` on its first line replaces the whole cell.

    With ``answered``, the cell as a learner completes it: a whole-cell answer loses only its marker
    line, a region only its marker lines.
    """
    first, newline, rest = source.partition("\n")
    whole = CELL_RE.match(first.rstrip("\r"))
    if whole:
        if answered:
            return _rewrite(rest, label, answered=True) if newline else ""
        return f"# TODO: {_hint(whole['rest'])}\n{RAISE}"
    return _rewrite(source, label, answered)


def transform_notebook(nb, name: str = "<notebook>", answered: bool = False):
    """The learner copy of a solution notebook (a new object; ``nb`` is not changed).

    Drops cells tagged ``solution-only``; in code cells, replaces solution regions and clears outputs
    and execution counts; copies markdown and raw cells unchanged. Cell ids are derived from ``name``
    and the cell's position, and notebook metadata is cut to the kernel and language name, so running
    or rebuilding the solution notebook changes its learner copy only where its content changes.

    With ``answered``, the learner copy as a learner who completed every exercise has it: the same
    cells, ids and metadata, each answer in place of its TODO (no markers), and the solution's
    outputs and execution counts kept (what nbval compares a re-run against).
    """
    import nbformat

    nb = copy.deepcopy(nb)
    cells = []
    for index, cell in enumerate(nb.cells):
        if SOLUTION_ONLY_TAG in (cell.get("metadata", {}).get("tags") or []):
            continue
        if cell.cell_type == "code":
            cell.source = transform_cell_source(cell.source, f"{name} cell {index}", answered)
            if not answered:
                cell.outputs = []
                cell.execution_count = None
            for key in VOLATILE_CELL_METADATA:
                cell.metadata.pop(key, None)
        if "id" in cell:
            cell.id = hashlib.sha1(f"{name}:{len(cells)}".encode()).hexdigest()[:8]
        cells.append(cell)
    nb.cells = cells
    meta = {k: nb.metadata[k] for k in KEPT_NB_METADATA if k in nb.metadata}
    lang = nb.metadata.get("language_info", {}).get("name")
    if lang:
        meta["language_info"] = {"name": lang}
    nb.metadata = nbformat.from_dict(meta)
    return nb


# --------------------------------------------------------------------------------------------------
# files

def load_notebook(path: Path):
    """Read a solution notebook as nbformat v4 (cells without ids are fine: the copy gets its own)."""
    import nbformat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nbformat.read(path, as_version=4)


def notebook_text(nb) -> str:
    """What ``nbformat.write`` puts in the file: the JSON, then a trailing newline."""
    import nbformat

    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def targets(root: Path, out: Path | None = None, answered: bool = False) -> dict[Path, str]:
    """{learner file: expected content} for every solution under ``root``.

    The files go to ``out`` (default ``root/lessons``); ``answered`` gives the completed copies.
    """
    out = root / "lessons" if out is None else out
    expected: dict[Path, str] = {}
    for src in sorted((root / "solutions").glob("*.ipynb")):
        label = str(src.relative_to(root))
        expected[out / src.name] = notebook_text(transform_notebook(load_notebook(src), label, answered))
    for src in sorted((root / "solutions" / "exercises").glob("*.py")):
        label = str(src.relative_to(root))
        text = _rewrite(src.read_text(encoding="utf-8"), label, answered)
        try:
            parse_source(text, filename=label)
        except SyntaxError as exc:
            raise MarkerError(f"{label}: the learner copy is not valid Python ({exc.msg}, line {exc.lineno}); "
                              "put the markers around whole statements.") from None
        expected[out / "exercises" / src.name] = text
    return expected


def learner_files(root: Path) -> list[Path]:
    found = sorted((root / "lessons").glob("*.ipynb")) + sorted((root / "lessons" / "exercises").glob("*.py"))
    return [p for p in found if p.is_file()]


def read_text(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)


def check(root: Path) -> tuple[list[str], int]:
    """(problems, one line each and empty when every learner file matches its solution; files checked)."""
    expected = targets(root)
    problems = []
    for path, text in expected.items():
        rel = path.relative_to(root)
        if not path.exists():
            problems.append(f"missing: {rel} (run `{FIX}`)")
        elif read_text(path) != text:
            problems.append(f"stale: {rel} differs from its solution (run `{FIX}`)")
    for path in learner_files(root):
        if path not in expected:
            rel = path.relative_to(root)
            src = "solutions/" + str(rel.relative_to("lessons"))
            problems.append(f"orphaned: {rel} has no {src} (add the solution, or run `{FIX} --prune` to delete it)")
    return problems, len(expected)


def generate(root: Path, prune: bool = False) -> tuple[list[Path], list[Path], list[Path]]:
    """Write every learner file that differs. Returns (written, unchanged, orphaned-or-pruned)."""
    expected = targets(root)
    written, unchanged = [], []
    for path, text in expected.items():
        if path.exists() and read_text(path) == text:
            unchanged.append(path)
        else:
            write_text(path, text)
            written.append(path)
    orphans = [p for p in learner_files(root) if p not in expected]
    if prune:
        for path in orphans:
            path.unlink()
    return written, unchanged, orphans


def write_answered(root: Path, out: Path) -> tuple[list[Path], list[Path]]:
    """Write into ``out`` the lessons as a learner who completed every exercise has them.

    ``out/NN_*.ipynb`` and ``out/exercises/*.py``, laid out like ``lessons/`` so that the notebooks
    run from ``out`` exactly as from ``lessons/`` (relative paths such as ``exercises/...`` and
    ``runs/...``). Notebooks and exercise scripts in ``out`` that no solution produces are deleted;
    anything else there (the runs of an earlier execution) is left alone. Returns (written, deleted).
    """
    out = out.resolve()
    protected = {root, root / "solutions", root / "lessons", root / "solutions" / "exercises",
                 root / "lessons" / "exercises", root / "ddp_course", root / "tests", root / "tools"}
    if out in protected or out in root.parents:
        raise MarkerError(f"refusing to write answered copies into {out}: give a folder of their own, "
                          "e.g. build/learner")
    expected = targets(root, out, answered=True)
    written = []
    for path, text in expected.items():
        if not (path.exists() and read_text(path) == text):
            write_text(path, text)
        written.append(path)
    stale = [p for p in sorted(out.glob("*.ipynb")) + sorted((out / "exercises").glob("*.py")) if p not in expected]
    for path in stale:
        path.unlink()
    return written, stale
