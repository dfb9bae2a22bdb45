"""What the lesson programs add around :mod:`ddp_course.cli` (which parses every ``--key=value``).

- :func:`require_device`: refuse a ``--device`` this machine cannot give as bad input (exit code 2
  through ``@command``), before any process group is made.
- :func:`write_result`: a lab's last step, its JSON written by rank 0, every rank waiting for it.
- :func:`lab_help`: the ``--help`` texts of a lab's options, the common ones (:data:`COMMON_HELP`)
  written once here.
"""

from __future__ import annotations

import os
from typing import Any

from ddp_course.cli import FlagError

# what the options most labs share mean, unless a lab words one its own way
COMMON_HELP = {
    "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "model width",
    "block_size": "tokens per sequence", "lr": "AdamW learning rate", "corpus": "the training text",
    "timeout_s": "process-group timeout in seconds",
    "device": "auto (NCCL on GPUs when each rank has one, else gloo on CPU) | cpu | cuda",
}


def lab_help(name: str, defaults: dict[str, Any], **own: str) -> dict[str, str]:
    """The ``--help`` text of each of a lab's options (``defaults``): ``own`` where the lab words one its
    own way, else :data:`COMMON_HELP`'s; ``out_dir`` is where rank 0 writes ``<name>.json``. An option
    with neither is a mistake of the lab's, refused here (at import)."""
    common = {"out_dir": f"where rank 0 writes {name}.json", **COMMON_HELP}
    missing = [k for k in defaults if k not in own and k not in common]
    unknown = [k for k in own if k not in defaults]
    if missing or unknown:
        raise KeyError(f"{name}: options without a help text {missing}, help texts of no option {unknown}")
    return {k: own.get(k) or common[k] for k in defaults}


def require_device(device: str) -> None:
    """Raise :class:`FlagError` (with the reason) when this node cannot give ``device`` to each of its
    ``LOCAL_WORLD_SIZE`` processes: a wrong ``--device`` is bad input, told before any process group."""
    from ddp_course.dist import DeviceError, choose_device

    try:
        choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except DeviceError as exc:
        raise FlagError(str(exc)) from None


def write_result(info: Any, out_dir: str, name: str, result: dict[str, Any], note: str = "") -> None:
    """Rank 0 writes ``out_dir/<name>.json`` and says so (``[<name>] wrote <path><note>``); then every rank
    waits at a barrier, so that no rank leaves the process group before the file is whole."""
    from pathlib import Path

    import torch.distributed as dist

    from ddp_course.dist import log
    from ddp_course.metrics import write_json
    from ddp_course.paths import show

    if info.is_main:
        path = Path(out_dir) / f"{name}.json"
        write_json(path, result)
        log(f"[{name}] wrote {show(path)}{note}")
    dist.barrier()
