"""``python -m ddp_course update`` and ``reset``: the course's new versions brought into the learner's
workspace without writing over their work (the rules are in ``check.workspace``'s docstring).

An update, for each lesson notebook and exercise script of the course:

- not in the workspace: copied (a file the learner deleted is brought back the same way);
- there, and the course has not changed it since it was copied: left alone;
- the course changed it, and the learner did not: the new version is written;
- the course changed a notebook that the learner only ran (the cells' sources are the ones copied, the
  outputs differ): the new version is written, theirs with its outputs kept in ``backups/``;
- the course changed it, and so did the learner: left as it is, and listed, with how to see the course's
  change and how to take the new version.

``reset NAME`` writes the course's version of NAME (a notebook or an exercise script) after moving the
learner's file, and that exercise's grading records, into ``backups/<time>/``: nothing is deleted.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ddp_course.check.registry import RECORDS, ROOT, exercises
from ddp_course.check.workspace import (
    BACKUPS,
    MANIFEST,
    VAR,
    Workspace,
    adopt_records,
    cells,
    course_files,
    home,
    read,
    refusal,
    sha256_text,
    shown,
    stamp,
)

USAGE = """usage: python -m ddp_course update                  bring new lessons and exercises into your workspace
       python -m ddp_course update --diff NAME      what the course changed in NAME since it was copied
       python -m ddp_course reset NAME [NAME ...]   the course's copy of NAME back (yours kept in backups/)
       python -m ddp_course reset --all             start over: every notebook, exercise and record (all kept)
NAME: a notebook or an exercise script, e.g. 05_inside_ddp.ipynb, exercises/05_my_ddp.py or 05_my_ddp"""


@dataclasses.dataclass
class Report:
    """What an update did, by file (paths relative to the workspace)."""

    folder: Path
    made: bool = False  # the workspace was made by this update
    new: list[str] = dataclasses.field(default_factory=list)
    restored: list[str] = dataclasses.field(default_factory=list)  # copied again: the learner's was missing
    updated: list[str] = dataclasses.field(default_factory=list)  # the learner had not changed it
    ran: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (notebook, backup of the run)
    kept: list[str] = dataclasses.field(default_factory=list)  # changed by both: the learner's stays
    theirs: list[str] = dataclasses.field(default_factory=list)  # there before the course brought it
    moved_in: list[str] = dataclasses.field(default_factory=list)  # the learner's edits found in lessons/
    grades: int = 0  # verdicts found where the course kept them before there were workspaces, copied in
    gone: list[str] = dataclasses.field(default_factory=list)  # no longer in the course (left as they are)

    def __str__(self) -> str:
        where = shown(self.folder)
        if self.made and not (self.moved_in or self.theirs or self.grades):
            notebooks = sum(rel.endswith(".ipynb") for rel in self.new)
            return (f"Made your workspace: {where}/, your copy of the course: {notebooks} notebooks and "
                    f"{len(self.new) - notebooks} exercise scripts (exercises/). Start with 00_setup.ipynb.")
        lines = [f"{'Made your workspace' if self.made else 'Your workspace'}: {where}/"]
        if self.new:
            lines.append(f"new from the course ({len(self.new)}): {', '.join(self.new)}")
        if self.restored:
            lines.append(f"brought back (they were missing): {', '.join(self.restored)}")
        if self.updated:
            lines.append(f"updated (you had not changed them): {', '.join(self.updated)}")
        for rel, kept in self.ran:
            lines.append(f"updated {rel} (you had only run it; your copy with its outputs: {kept})")
        if self.grades:
            lines.append(f"your earlier grades ({self.grades} verdict{'s' if self.grades != 1 else ''}, from lessons/runs/check/ and runs/check/) copied "
                         f"into {where}/runs/check/")
        if self.moved_in:
            lines.append(f"your edits found in lessons/, copied into the workspace: {', '.join(self.moved_in)}; "
                         "`git checkout lessons/` then gives the checkout the course's copies back, so that "
                         "`git pull` can update them")
        for title, rels in (("changed by the course since you copied them; yours are kept as they are", self.kept),
                            ("there before the course brought them; yours are kept as they are", self.theirs)):
            if rels:
                lines += [f"{title}:"] + [f"  {rel}" for rel in rels]
                lines += ["  see the course's change:   python -m ddp_course update --diff NAME",
                          "  take the course's version: python -m ddp_course reset NAME   (yours is moved to "
                          f"{BACKUPS}/ first)"]
        if self.gone:
            lines.append(f"no longer in the course (left as they are): {', '.join(self.gone)}")
        if len(lines) == 1:
            lines.append("up to date: nothing new from the course since the last update.")
        return "\n".join(lines)


def update(folder: Path, course: dict[str, str] | None = None) -> Report:
    """Bring the course's files (``course``: {path: text}, default :func:`course_files`) into ``folder``."""
    made = not (folder / MANIFEST).is_file()
    ws, report = Workspace.open(folder), Report(folder, made=made and not any(folder.glob("[0-9][0-9]_*.ipynb")))
    course = course_files() if course is None else course
    when = stamp()
    for rel, text in course.items():
        new, mine, base = sha256_text(text), read(folder / rel), ws.copied.get(rel)
        if mine is None:
            old = read(ROOT / "lessons" / rel) if made else None
            if old is not None and old != text:  # a learner who worked in lessons/ before there were workspaces
                ws.take(rel, old)
                ws.note(rel, text)
                report.moved_in.append(rel)
            else:
                ws.take(rel, text)
                (report.restored if base else report.new).append(rel)
        elif base is None:
            ws.note(rel, text)
            if mine != text:
                report.theirs.append(rel)
        elif base == new:
            continue
        elif sha256_text(mine) in (base, new):
            ws.take(rel, text)
            if sha256_text(mine) == base:
                report.updated.append(rel)
        elif rel.endswith(".ipynb") and cells(mine) is not None and cells(mine) == cells(ws.base(rel)):
            kept = ws.backup([rel], when)
            ws.take(rel, text)
            report.ran.append((rel, shown(kept / rel, folder)))
        else:
            report.kept.append(rel)
    if made:
        report.grades = adopt_records(folder, ROOT)
    for rel in sorted(set(ws.copied) - set(course)):
        report.gone.append(rel)
        del ws.copied[rel]
    ws.save()
    return report


def resolve(name: str, course: dict[str, str], folder: Path) -> list[str]:
    """The course files ``name`` stands for: a path (relative to the workspace or to here), a file name,
    its stem, or ``--all``. Raises ValueError saying what names there are."""
    if name == "--all":
        return list(course)
    path = Path(name).expanduser()
    for base in (folder, Path.cwd()):
        try:
            rel = (base / path).resolve().relative_to(folder.resolve()).as_posix()
        except ValueError:
            continue
        if rel in course:
            return [rel]
    found = [rel for rel in course if name in (Path(rel).name, Path(rel).stem)]
    if len(found) == 1:
        return found
    ours = [rel for rel in course if Path(rel).name.startswith(f"{name}_")]
    if ours:
        raise ValueError(f"{name!r} could be any of {', '.join(ours)}: name one.")
    raise ValueError(f"{name!r} is not a notebook or an exercise of the course. Names look like "
                     "05_inside_ddp.ipynb, exercises/05_my_ddp.py or 05_my_ddp; `ls` your workspace for the others.")


def records_of(rel: str, folder: Path) -> list[str]:
    """The grading records of ``rel``: its exercise's, or those of the exercises inside the notebook."""
    if rel.startswith("exercises/"):
        return [Path(rel).stem]
    scripts = set(exercises())
    lesson = Path(rel).name[:2]
    return sorted(p.stem for p in (folder / RECORDS).glob(f"{lesson}_*.json") if p.stem not in scripts)


def reset(folder: Path, rels: list[str], course: dict[str, str] | None = None, everything: bool = False) -> str:
    """Write the course's version of each of ``rels`` after moving the learner's file and its grading
    records to ``backups/<time>/``; what was done, in lines. ``everything``: every record too."""
    course = course_files() if course is None else course
    ws, when, lines = Workspace.open(folder), stamp(), []
    records = sorted({r for rel in rels for r in records_of(rel, folder)}
                     | ({p.stem for p in (folder / RECORDS).glob("*.json")} if everything else set()))
    moved = [rel for rel in rels if (folder / rel).is_file() and read(folder / rel) != course[rel]]
    moved_records = [r for r in records if (folder / RECORDS / f"{r}.json").is_file()]
    kept = ws.backup(moved, when, moved_records)
    for rel in rels:
        ws.take(rel, course[rel])
    ws.save()
    if moved or moved_records:
        what = [*moved, *(f"{RECORDS.as_posix()}/{r}.json" for r in moved_records)]
        lines.append(f"moved to {shown(kept, folder)}/: {', '.join(what) if len(what) <= 6 else f'{len(what)} files'}")
    same = [rel for rel in rels if rel not in moved]
    lines.append(f"the course's copy of {', '.join(rels) if len(rels) <= 6 else f'{len(rels)} files'} is in "
                 f"{shown(folder)}/" + (f" ({', '.join(same)} had not changed)" if same and len(rels) <= 6 else ""))
    return "\n".join(lines)


def rendered(rel: str, text: str | None) -> list[str]:
    """A file's lines for a diff: a notebook as its cells' sources, each under a header."""
    if text is None:
        return []
    if not rel.endswith(".ipynb"):
        return text.splitlines(keepends=True)
    lines = []
    for i, (kind, source) in enumerate(cells(text) or []):
        lines += [f"# ---- cell {i} ({kind}) ----\n", *(ln + "\n" for ln in source.splitlines())]
    return lines


def diff(folder: Path, rel: str, course: dict[str, str]) -> str:
    """The course's change to ``rel`` since it was copied into ``folder`` (a unified diff), or why none."""
    import difflib

    base = Workspace.open(folder).base(rel)
    if base is None:
        return f"{rel}: the workspace keeps no copy of the course's earlier version; nothing to compare."
    if base == course[rel]:
        return f"{rel}: the course has not changed it since it was copied into {shown(folder)}/."
    return "".join(difflib.unified_diff(rendered(rel, base), rendered(rel, course[rel]),
                                        f"{rel} (the course's, when copied)", f"{rel} (the course's, now)"))


def main(command: str, argv: list[str]) -> int:
    """``update [--diff NAME]`` and ``reset NAME... | --all``: exit 0, or 2 with one ``error:`` line."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    folder = home()
    problem = refusal(folder)
    try:
        if problem:
            raise ValueError(problem)
        if command == "update" and not argv:
            print(update(folder))
            return 0
        if command == "update" and len(argv) == 2 and argv[0] == "--diff":
            course = course_files()
            print(diff(folder, resolve(argv[1], course, folder)[0], course))
            return 0
        if command == "reset" and argv and (argv == ["--all"] or "--all" not in argv):
            course = course_files()
            rels = list(dict.fromkeys(rel for name in argv for rel in resolve(name, course, folder)))
            print(reset(folder, rels, course, everything=argv == ["--all"]))
            return 0
        raise ValueError(f"unexpected arguments {' '.join(argv)!r} for {command}.")
    except ValueError as exc:
        print(f"error: {exc} (`python -m ddp_course {command} --help` shows every form)", file=sys.stderr)
        return 2


__all__ = ["VAR", "Report", "diff", "main", "reset", "resolve", "update"]
