"""What ``make``'s set-up can use of the Python it is given (standard library only: it runs before any
virtual environment exists).

    python3 tools/setup_python.py venv                      # exit 1, saying what to install, when python3 cannot make a venv
    python3 tools/setup_python.py torch --floor 2.10 --spec "torch==2.13.0"   # exit 0: keep this Python's torch

``venv``: ``python3 -m venv`` needs the ``ensurepip`` module, which Debian and Ubuntu ship apart from
Python, in the ``python3-venv`` package (``python3.X-venv`` for another version); without it venv fails
with a message about ensurepip and nothing is set up. This says so in one line, before anything is made.

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


def venv_problem() -> str | None:
    """Why this Python cannot create a virtual environment with pip, or None."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 tools/setup_python.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("venv", help="exit 1 (saying what to install) if this Python cannot make a virtual environment")
    t = sub.add_parser("torch", help="exit 0 if this Python's torch meets the floor (keep it), 1 otherwise")
    t.add_argument("--floor", required=True, help="the oldest torch the course supports, e.g. 2.10")
    t.add_argument("--spec", required=True, help="what the set-up installs otherwise, e.g. torch==2.13.0")
    args = parser.parse_args(argv)
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
