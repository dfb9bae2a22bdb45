"""The learner's workspace: their own copy of the lessons, which the course never overwrites.

    python -m ddp_course update                 bring new lessons and exercises in; list what the course changed
    python -m ddp_course update --diff NAME     what the course changed in NAME since it was copied
    python -m ddp_course reset NAME [NAME ...]  the course's copy of NAME back (yours kept in backups/)
    python -m ddp_course reset --all            every notebook, exercise and grading record (all kept in backups/)

The course's copy is what ``lessons/`` holds, written from ``solutions/`` (``check.rewrite``); git
tracks it. The workspace (``work/`` in the checkout unless told otherwise, untracked) holds the
learner's copies and ``runs/check/``, the grading records. ``.course/manifest.json`` there notes,
for each file the course copied, the sha256 of the course's version it was copied from, and
``.course/base/`` keeps that version: an update compares the three (the learner's file, the version it
was copied from, the course's version now) and never writes over a file the learner changed.

Where the workspace is (:func:`home`), the first that applies:

1. the folder of lesson notebooks that holds the current directory (a notebook's folder, its
   ``exercises/``), looking upward; the checkout's ``lessons/``, the course's copy, never counts;
2. ``$DDP_COURSE_WORK``;
3. ``work/`` in the checkout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from ddp_course.check.registry import ROOT

VAR = "DDP_COURSE_WORK"
DEFAULT = ROOT / "work"
STATE = Path(".course")  # the manifest and the versions copied, inside the workspace
MANIFEST = STATE / "manifest.json"
BACKUPS = "backups"


def is_lessons_folder(folder: Path) -> bool:
    """Whether ``folder`` is a workspace or another folder of lesson notebooks (solutions/, a test's copy)."""
    return (folder / MANIFEST).is_file() or any(folder.glob("[0-9][0-9]_*.ipynb"))


def home(cwd: str | Path | None = None) -> Path:
    """The learner's workspace, found as the module's docstring says (it need not exist yet)."""
    here = Path.cwd() if cwd is None else Path(cwd)
    here = here.resolve()
    for folder in (here, *here.parents):
        if folder != ROOT / "lessons" and is_lessons_folder(folder):
            return folder
    named = os.environ.get(VAR)
    return Path(named).expanduser().resolve() if named else DEFAULT


def shown(path: Path, base: Path | None = None) -> str:
    """``path`` relative to the workspace ``base`` when inside it, else as the course prints paths."""
    from ddp_course.paths import show

    if base is not None:
        try:
            return path.resolve().relative_to(base.resolve()).as_posix()
        except ValueError:
            pass
    return show(path)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def course_files(root: Path = ROOT) -> dict[str, str]:
    """{path in the workspace: the course's text}: every lesson notebook and exercise script, as
    ``lessons/`` holds them (written from ``solutions/`` by ``check.rewrite``)."""
    from ddp_course.check import rewrite

    lessons = root / "lessons"
    return {path.relative_to(lessons).as_posix(): text for path, text in rewrite.targets(root).items()}


def read(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


def write(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def cells(text: str | None) -> list[tuple[str, str]] | None:
    """A notebook's cells as (type, source), outputs and metadata aside; None if it is not one."""
    try:
        return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
                for c in json.loads(text or "")["cells"]]
    except (ValueError, KeyError, TypeError):
        return None


@dataclasses.dataclass
class Workspace:
    """A workspace folder and its manifest ({path: sha256 of the course's version copied})."""

    folder: Path
    copied: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def open(cls, folder: Path) -> Workspace:
        try:
            copied = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            copied = {}
        return cls(folder, dict(copied))

    def save(self) -> None:
        write(self.folder / MANIFEST, json.dumps({"files": dict(sorted(self.copied.items()))}, indent=1) + "\n")

    def base(self, rel: str) -> str | None:
        """The course's version ``rel`` was last copied from (None when unknown)."""
        return read(self.folder / STATE / "base" / rel)

    def take(self, rel: str, text: str) -> None:
        """Write the course's ``text`` as the learner's ``rel`` and note it as copied."""
        write(self.folder / rel, text)
        self.note(rel, text)

    def note(self, rel: str, text: str) -> None:
        """Note ``text`` as the course's version ``rel`` was copied from (the learner's file untouched)."""
        write(self.folder / STATE / "base" / rel, text)
        self.copied[rel] = sha256_text(text)

    def backup(self, rels: list[str], stamp: str, records: list[str] = ()) -> Path:
        """Move the learner's ``rels`` and grading ``records`` (names) into ``backups/<stamp>/``; the folder."""
        from ddp_course.check.registry import RECORDS

        kept = self.folder / BACKUPS / stamp
        for rel in [*rels, *(f"{RECORDS.as_posix()}/{name}.json" for name in records)]:
            source = self.folder / rel
            if source.is_file():
                (kept / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, kept / rel)
        return kept


def stamp() -> str:
    """A backup folder's name: the time, to the second (and a counter if that one is taken)."""
    return time.strftime("%Y-%m-%d_%H%M%S")


def refusal(folder: Path) -> str | None:
    """Why ``folder`` cannot be made, updated or reset as a workspace, or None: inside the checkout, only
    a folder that is not the course's own (``work/``, or one ``$DDP_COURSE_WORK`` names) may be."""
    folder = folder.resolve()
    if (folder / MANIFEST).is_file():
        return None
    tracked = ("lessons", "solutions", "ddp_course", "tests", "tools", "docs", "build")
    theirs = folder == ROOT or any(folder == ROOT / t or ROOT / t in folder.parents for t in tracked)
    if theirs:
        return (f"{shown(folder)}/ is a folder of the course itself, not a workspace: run this from the checkout's "
                f"top or from your workspace (work/, or the folder ${VAR} names).")
    return None


def adopt_records(folder: Path, root: Path = ROOT) -> int:
    """Copy the grading records kept before there were workspaces (``lessons/runs/check/`` of the checkout,
    where the notebooks graded, and ``runs/check/`` at its top, where ``check`` wrote) into ``folder``'s,
    each verdict's file named as in the workspace (``lessons/exercises/x.py`` -> ``exercises/x.py``); the
    workspace's own verdicts win. Returns how many verdicts were copied."""
    from ddp_course.check.registry import RECORDS

    copied = 0
    for old in (root / "lessons" / RECORDS, root / RECORDS):
        for path in sorted(old.glob("*.json")) if old.is_dir() else []:
            try:
                theirs = json.loads(path.read_text(encoding="utf-8"))["verdicts"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            mine_path = folder / RECORDS / path.name
            try:
                mine = json.loads(mine_path.read_text(encoding="utf-8"))["verdicts"]
            except (OSError, ValueError, KeyError, TypeError):
                mine = []
            for entry in theirs:
                entry = {**entry, "file": str(entry.get("file", "")).removeprefix("lessons/")}
                if not any(e.get("file") == entry["file"] and e.get("started") == entry.get("started") for e in mine):
                    mine.append(entry)
                    copied += 1
            mine.sort(key=lambda e: e.get("started", 0), reverse=True)
            write(mine_path, json.dumps({"exercise": path.stem, "verdicts": mine}, indent=2) + "\n")
    return copied
