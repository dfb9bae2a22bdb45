"""What ``make``'s set-up can use of the Python it is given (standard library only: it runs before any
virtual environment exists).

    python3 tools/setup_python.py venv                      # exit 1, saying what to install, when python3 cannot make a venv
    python3 tools/setup_python.py torch --floor 2.10 --spec "torch==2.13.0"   # exit 0: keep this Python's torch
    .venv/bin/python tools/setup_python.py asked --record .venv/.ddp_course-torch --spec "torch==2.11.0" --pip-args ""

``venv`` also refuses a Python older than the course's (3.10), in one line naming another to use: an older
one would get through ``venv`` and die inside pip, in a message about the package's requirements.

``venv``: ``python3 -m venv`` needs the ``ensurepip`` module, which Debian and Ubuntu ship apart from
Python, in the ``python3-venv`` package (``python3.X-venv`` for another version); without it venv fails
with a message about ensurepip and nothing is set up. This says so in one line, before anything is made.

``asked``: exit 0 when the venv's torch was installed from this ``--spec`` and ``--pip-args`` (the
record file holds them), 1 with one line saying what changed; ``--write`` records them. ``make`` asks
when ``TORCH_SPEC`` or ``TORCH_PIP_ARGS`` is given, and installs again on 1, so that a changed request
is honoured on an existing venv instead of silently ignored.

``torch``: the set-up keeps a torch that this Python can already import (the virtual environment then
sees its site-packages) only when it is at least the course's floor. An older one (Debian 12 ships
1.13.1 as ``python3-torch``) would otherwise make pip install the newest torch from PyPI into the
venv to satisfy ``torch>=FLOOR``, ignoring ``TORCH_SPEC``; the venv is made without the system's
packages instead, and gets ``--spec``. One line says which happened.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

OLDEST = (3, 10)  # pyproject.toml's requires-python


def python_problem(version: tuple = tuple(sys.version_info)) -> str | None:
    """Why this Python is too old for the course, or None."""
    if tuple(version[:2]) >= OLDEST:
        return None
    have, oldest = ".".join(str(v) for v in version[:3]), ".".join(str(v) for v in OLDEST)
    return (f"error: {sys.executable} is Python {have}; the course needs {oldest} or newer. Name a newer one, e.g. "
            f"`make lab PYTHON=python3.11` (and the same for `make test`).")


def venv_problem() -> str | None:
    """Why this Python cannot create a virtual environment with pip, or None."""
    too_old = python_problem()
    if too_old:
        return too_old
    try:
        import ensurepip  # noqa: F401 -- Debian ships it in python3-venv
        import venv  # noqa: F401
        missing = False
    except ImportError:
        missing = True
    if missing:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (f"error: {sys.executable} cannot create a virtual environment: its venv/ensurepip modules are "
                f"missing. On Debian or Ubuntu install them with `sudo apt install python3-venv` (python{version}-venv "
                "for this Python), then run make again.")
    return None


def version_tuple(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``: the leading numbers of a version."""
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def torch_choice(floor: str, spec: str, executable: str = sys.executable) -> tuple[bool, str]:
    """(keep this Python's torch?, the line that says what the set-up does)."""
    if importlib.util.find_spec("torch") is None:
        return False, f"[setup] {executable} has no torch: installing {spec}"
    try:
        have = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        have = "an unknown version"
    if have != "an unknown version" and version_tuple(have) >= version_tuple(floor):
        return True, f"[setup] using the torch already installed for {executable}: {have}"
    return False, (f"[setup] {executable} has torch {have}, older than the {floor} this course needs: the virtual "
                   f"environment leaves it out and installs {spec}")


def asked(record: Path, spec: str, pip_args: str) -> tuple[bool, str]:
    """(was the venv's torch installed from ``spec`` and ``pip_args``?, the line saying what changed)."""
    want = f"{spec}\n{pip_args}".strip()
    try:
        have = record.read_text(encoding="utf-8").strip()
    except OSError:
        have = ""
    if have == want:
        return True, ""
    was = ("the torch its Python already had" if have in ("", "system")
           else " ".join(part for part in have.splitlines() if part))
    now = spec + (f" {pip_args}" if pip_args.strip() else "")
    return False, f"[setup] {record.parent} was set up with {was}; installing {now}, as asked"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 tools/setup_python.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="exit 1 (saying what to install) if this Python cannot make a virtual environment")
    t = sub.add_parser("torch", help="exit 0 if this Python's torch meets the floor (keep it), 1 otherwise")
    t.add_argument("--floor", required=True, help="the oldest torch the course supports, e.g. 2.10")
    t.add_argument("--spec", required=True, help="what the set-up installs otherwise, e.g. torch==2.13.0")
    a = sub.add_parser("asked", help="exit 0 if the venv's torch came from --spec and --pip-args, 1 otherwise")
    a.add_argument("--record", required=True, type=Path, help="the venv's record, e.g. .venv/.ddp_course-torch")
    a.add_argument("--spec", required=True)
    a.add_argument("--pip-args", default="")
    a.add_argument("--write", action="store_true", help="record --spec and --pip-args as installed")
    args = parser.parse_args(argv)
    if args.cmd == "asked":
        if args.write:
            args.record.write_text(f"{args.spec}\n{args.pip_args}".strip() + "\n", encoding="utf-8")
            return 0
        same, line = asked(args.record, args.spec, args.pip_args)
        if line:
            print(line, flush=True)
        return 0 if same else 1
    if args.cmd == "venv":
        problem = venv_problem()
        if problem:
            print(problem, file=sys.stderr)
        return 1 if problem else 0
    keep, line = torch_choice(args.floor, args.spec)
    print(line, flush=True)
    return 0 if keep else 1


if __name__ == "__main__":
    sys.exit(main())
