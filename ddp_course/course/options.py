"""What the lesson programs add around :mod:`ddp_course.cli` (which parses every ``--key=value``).

- :func:`require_device`: refuse a ``--device`` this machine cannot give as bad input (exit code 2
  through ``@command``), before any process group is made.
"""

from __future__ import annotations

import os

from ddp_course.cli import FlagError


def require_device(device: str) -> None:
    """Raise :class:`FlagError` (with the reason) when this node cannot give ``device`` to each of its
    ``LOCAL_WORLD_SIZE`` processes: a wrong ``--device`` is bad input, told before any process group."""
    from ddp_course.dist import DeviceError, choose_device

    try:
        choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except DeviceError as exc:
        raise FlagError(str(exc)) from None
