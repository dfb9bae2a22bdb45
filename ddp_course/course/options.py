"""What the lesson programs add around :mod:`ddp_course.cli` (which parses every ``--key=value``).

- :func:`parse_flags_or_help`: ``parse_flags`` that answers ``-h``/``--help`` with the program's
  usage, its docstring and one line per option (its default and, where given, a help string).
- :func:`require_device`: refuse a ``--device`` this machine cannot give as bad input (exit code 2
  through ``@command``), before any process group is made.
"""

from __future__ import annotations

import os
from typing import Any

from ddp_course.cli import FlagError, parse_flags


def usage(prog: str, doc: str | None, defaults: dict[str, Any], helps: dict[str, str] | None = None) -> str:
    """The ``--help`` text: how to run ``prog``, its docstring, then each option with its default."""
    helps = helps or {}
    lines = [f"usage: {prog} [--key=value ...]", "", (doc or "").strip(), "", "options:"]
    lines += [f"  {'--' + k + '=' + str(v):<28} {helps.get(k, '')}".rstrip() for k, v in defaults.items()]
    return "\n".join(lines)


def parse_flags_or_help(argv: list[str], defaults: dict[str, Any], prog: str, doc: str | None,
                        helps: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`ddp_course.cli.parse_flags`, except that ``-h`` or ``--help`` prints :func:`usage` and exits 0."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage(prog, doc, defaults, helps), flush=True)
        raise SystemExit(0)
    return parse_flags(argv, defaults, prog)


def require_device(device: str) -> None:
    """Raise :class:`FlagError` (with the reason) when this node cannot give ``device`` to each of its
    ``LOCAL_WORLD_SIZE`` processes: a wrong ``--device`` is bad input, told before any process group."""
    from ddp_course.dist import DeviceError, choose_device

    try:
        choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except DeviceError as exc:
        raise FlagError(str(exc)) from None
