"""Where a learner stands: ``python -m ddp_course progress``, and the table at the end of every lesson.

Every exercise of the course, lesson by lesson -- the scripts of ``exercises/`` and the exercises
inside the notebooks -- in one of four states:

- **not started**: its TODO stub is still there and it was never graded;
- **not checked**: the stub is gone, but no verdict was noted for it;
- **failing**: the last verdict's first line, and when;
- **passed**: when;

with "changed since last graded" when the file (a script's bytes, a notebook exercise cell's code)
is not the one the last verdict was given on. It reads the learner's files and the grading records
(``runs/check/`` of the workspace, see ``ddp_course.check.records`` and ``ddp_course.check.workspace``)
and nothing else: no job starts, no torch is
imported. A notebook's exercise cell is read from the saved notebook: save it to see a change.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
from pathlib import Path

from ddp_course.check import rewrite
from ddp_course.check.records import binds, cell_digest, sha256_file
from ddp_course.check.reference import unfinished
from ddp_course.check.registry import RECORDS, ROOT, exercises, parse_source, shortest_key
from ddp_course.check.verdicts import STUB
from ddp_course.check.workspace import VAR, home, shown

STATES = ("not started", "not checked", "failing", "passed")


@dataclasses.dataclass
class Item:
    """One exercise and where the learner stands on it."""

    lesson: str  # "05"
    name: str  # the record's name: "05_my_ddp", "01_causal_attention"
    what: str  # "exercises/05_my_ddp.py", or the notebook exercise's heading
    state: str  # one of STATES
    changed: bool = False  # the file or cell differs from the one the last verdict was given on
    when: float | None = None  # the last verdict's time (seconds since the epoch)
    why: str = ""  # the first line of a failing verdict
    todo: str = ""  # what to run next for it

    @property
    def done(self) -> bool:
        return self.state == "passed" and not self.changed

    def status(self) -> str:
        stamp = datetime.datetime.fromtimestamp(self.when).strftime("%Y-%m-%d %H:%M") if self.when else ""
        text = {"passed": f"passed {stamp}", "failing": f"failing {stamp}: {self.why}"}.get(self.state, self.state)
        return text + (" (changed since last graded)" if self.changed else "")


@dataclasses.dataclass
class NotebookExercise:
    lesson: str
    notebook: str  # "01_minigpt.ipynb"
    heading: str  # the heading above the exercise cell
    answer: str  # the name the exercise cell defines: "causal_attention", "answer_a"
    cell: str | None  # the exercise cell's code in the learner's notebook now (None: not there)


def _answer_name(learner_cell: str) -> str:
    """The name the exercise cell defines: the function holding the stub, else the last name assigned
    before the stub."""
    import ast

    tree = parse_source(learner_cell)
    last = ""
    for node in tree.body:
        holds = any(STUB in ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.Raise))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and holds:
            return node.name
        if holds:
            return last
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            last = node.targets[0].id
    return last


def notebook_exercises(folder: Path) -> list[NotebookExercise]:
    """The exercises inside the lesson notebooks, each with its cell as it is in ``folder`` now.

    Which exercises there are is read from ``solutions/`` (where each answer is marked), else from
    ``folder`` itself (the cells that still hold the stub): a learner's answered cell holds none.
    """
    source = ROOT / "solutions" if (ROOT / "solutions").is_dir() else folder
    found = []
    for path in sorted(source.glob("[0-9][0-9]_*.ipynb")):
        heading = ""
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            text = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                heading = next((ln.lstrip("#").strip() for ln in text.splitlines() if ln.startswith("#")), heading)
            elif cell["cell_type"] == "code" and STUB in rewrite.transform_cell_source(text, path.name):
                answer = _answer_name(rewrite.transform_cell_source(text, path.name))
                found.append(NotebookExercise(path.name[:2], path.name, heading, answer,
                                              _cell_binding(folder / path.name, answer)))
    return found


def _cell_binding(notebook: Path, name: str) -> str | None:
    """The code of the first cell of ``notebook`` that binds ``name`` (solution markers removed); None
    when the notebook or the cell is not there."""
    try:
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):
        return None
    for cell in cells:
        text = rewrite.transform_cell_source("".join(cell["source"]), notebook.name, answered=True)
        if cell["cell_type"] == "code" and binds(text, name):
            return text
    return None


def _entries(name: str, folder: Path, file: str) -> list[dict]:
    """Every verdict noted on exercise ``name`` for ``file`` (its path in the workspace ``folder``), newest first."""
    try:
        data = json.loads((folder / RECORDS / f"{name}.json").read_text(encoding="utf-8"))
        found = [e for e in data["verdicts"] if e.get("file") == file]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(found, key=lambda e: e.get("started", 0), reverse=True)


def _judged(item: Item, entries: list[dict], digest: str | None, key: str, started: bool) -> Item:
    same = [e for e in entries if e.get(key) == digest]
    last = (same or entries or [None])[0]
    if last is None:
        item.state = "not checked" if started else "not started"
        return item
    item.state, item.when = ("passed" if last.get("ok") else "failing"), last.get("started")
    item.why = "" if last.get("ok") else str(last.get("message", "")).split("\n")[0][:160]
    item.changed = not same and digest is not None and last.get(key) is not None
    return item


def _script_items(folder: Path) -> list[Item]:
    items = []
    for ex in exercises().values():
        path, rel = folder / "exercises" / ex.script, f"exercises/{ex.script}"
        item = Item(ex.lesson, ex.name, rel, "not started", todo=f"python -m ddp_course check {shortest_key(ex)}")
        if not path.is_file():
            items.append(dataclasses.replace(item, why=f"{rel} is missing",
                                             todo=f"python -m ddp_course reset {rel}"))
            continue
        source = path.read_text(encoding="utf-8")
        items.append(_judged(item, _entries(ex.name, folder, rel), sha256_file(path), "sha256",
                             started=not unfinished(source)))
    return items


def _notebook_items(folder: Path) -> list[Item]:
    items = []
    for ex in notebook_exercises(folder):
        item = Item(ex.lesson, f"{ex.lesson}_{ex.answer}", ex.heading, "not started",
                    todo=f"open {ex.notebook} at \u201c{ex.heading}\u201d and run its check cell")
        if ex.cell is None:
            items.append(dataclasses.replace(item, why=f"{ex.notebook} has no cell defining {ex.answer}"))
            continue
        items.append(_judged(item, _entries(item.name, folder, ex.notebook), cell_digest(ex.cell),
                             "cell_sha256", started=STUB not in ex.cell))
    return items


@dataclasses.dataclass
class Progress:
    """The table: every exercise in lesson order, and what to do next."""

    folder: Path
    items: list[Item]

    @property
    def next(self) -> Item | None:
        return next((i for i in self.items if not i.done), None)

    def next_line(self) -> str:
        item = self.next
        if item is None:
            return f"next: nothing left -- every exercise has passed ({len(self.items)} of {len(self.items)})."
        return f"next: lesson {item.lesson}, {item.what}: {item.todo}"

    def __str__(self) -> str:
        width = max((len(i.what) for i in self.items), default=10)
        done = sum(i.done for i in self.items)
        lines = [f"Exercises in {shown(self.folder)}/: {done} of {len(self.items)} passed", "",
                 f"{'lesson':<7} {'exercise':<{width}}  state"]
        lines += [f"{i.lesson:<7} {i.what:<{width}}  {i.status()}" for i in self.items]
        return "\n".join([*lines, "", self.next_line()])

    __repr__ = __str__  # text/plain, where a notebook is not rendered as HTML

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{i.lesson}</td><td>{html.escape(i.what)}</td><td>{html.escape(i.status())}</td></tr>"
                       for i in self.items)
        done = sum(i.done for i in self.items)
        return (f"<p>Exercises in <code>{html.escape(shown(self.folder))}/</code>: {done} of {len(self.items)} "
                f"passed</p><table><thead><tr><th>lesson</th><th>exercise</th><th>state</th></tr></thead>"
                f"<tbody>{rows}</tbody></table><p>{html.escape(self.next_line())}</p>")


def progress(folder: str | Path | None = None) -> Progress:
    """Where the learner stands in ``folder`` (default: their workspace, ``check.workspace.home()``);
    reads files only."""
    folder = home() if folder is None else Path(folder)
    items = _script_items(folder) + _notebook_items(folder)
    return Progress(folder, sorted(items, key=lambda i: i.lesson))  # a stable sort: scripts first in a lesson


def main(argv: list[str]) -> int:
    """``python -m ddp_course progress [FOLDER]``: the table and the next step; exit 0."""
    import sys

    usage = "usage: python -m ddp_course progress [FOLDER]   (default: your workspace, work/ of this checkout)"
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        return 0
    if len(argv) > 1 or (argv and argv[0].startswith("--")):
        print(f"error: unexpected argument(s) {' '.join(argv)!r}. {usage}", file=sys.stderr)
        return 2
    folder = Path(argv[0]) if argv else home()
    if not argv and not folder.is_dir():
        print(f"error: no workspace yet ({shown(folder)}/): `make lab` or `python -m ddp_course update` makes it, "
              f"with your copy of every lesson (${VAR} names another folder).", file=sys.stderr)
        return 2
    if not folder.is_dir() or not any(folder.glob("[0-9][0-9]_*.ipynb")):
        print(f"error: {folder} is not a folder of lesson notebooks; give your workspace (the folder that holds "
              "NN_*.ipynb and exercises/), or run it with no folder.", file=sys.stderr)
        return 2
    print(progress(folder))
    return 0


def inline_exercises() -> list[tuple[str, str]]:
    """(lesson notebook, exercise heading) of every exercise done inside a notebook, each graded by
    the cell below it (:func:`notebook_exercises` finds them)."""
    return list(dict.fromkeys((ex.notebook, ex.heading) for ex in notebook_exercises(ROOT / "lessons")))


def listing() -> str:
    """What ``python -m ddp_course check`` prints: every exercise, its lesson, how it is graded."""
    from ddp_course.course import lesson_folders

    topics = {nn: pkg.rsplit(".", 1)[1][4:] for nn, pkg in lesson_folders().items()}
    lines = ["Exercise scripts (write the TODOs in exercises/ of your workspace, then run the command, from any "
             "folder):", ""]
    for ex in exercises().values():
        lines.append(f"  {ex.lesson} {topics[ex.lesson]:<22} {ex.name:<22} {ex.command}")
    inline = inline_exercises()
    if inline:
        lines += ["", "Exercises inside the notebooks (the cell below each exercise grades it):", ""]
        lines += [f"  {nb[:2]} {nb[3:-6]:<22} {heading}" for nb, heading in inline]
    return "\n".join(lines)
