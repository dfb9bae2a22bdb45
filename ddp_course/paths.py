"""Paths as the course prints them: relative to the repository, or to ``~``, never the machine's.

What a notebook prints ends up in its committed outputs, and a learner's machine has other
folders than the author's: ``solutions/runs/01_single/summary.json`` reads the same everywhere,
``/home/someone/ddp-course/solutions/runs/01_single/summary.json`` does not.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _anchors() -> list[tuple[Path, str]]:
    """(folder, how to print it), most specific first."""
    found = [(REPO, "")]
    data = os.environ.get("DDP_COURSE_DATA")
    if data:
        found.append((Path(data).expanduser().resolve(), "$DDP_COURSE_DATA/"))
    found.append((Path.home().resolve(), "~/"))
    return found


def show(path: str | os.PathLike) -> str:
    """``path`` for printing: relative to the repository when inside it, else ``$DDP_COURSE_DATA/...``
    (the corpus folder) or ``~/...``; other paths unchanged. Relative paths are taken from the
    current directory; a relative name with a space that names no file is a description, not a path
    (the offline corpus's "pydoc_data.topics (offline fallback)"), and is returned as written."""
    if "://" in str(path):  # a URL (a corpus downloaded on first use)
        return str(path)
    p = Path(path).expanduser()
    if " " in str(path) and not p.is_absolute() and not p.exists():
        return str(path)
    try:
        p = p.resolve()
    except OSError:
        return str(path)
    for folder, prefix in _anchors():
        try:
            rel = p.relative_to(folder)
        except ValueError:
            continue
        text = rel.as_posix()
        if not prefix:
            return text or "."
        return prefix + text if text != "." else prefix.rstrip("/")
    return str(path)


def shorten(text: str) -> str:
    """``text`` with every absolute path under the repository, the corpus folder or ``~`` printed as
    :func:`show` prints it (for tracebacks and logs shown in a notebook)."""
    for folder, prefix in _anchors():
        if str(folder) in ("/", "."):
            continue
        text = re.sub(re.escape(str(folder)) + r"(/|\b)", lambda _m, p=prefix: p, text)
    return text
