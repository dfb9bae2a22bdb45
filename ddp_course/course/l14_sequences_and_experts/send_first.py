"""One ring step, four ways, on gloo: which of them finishes?

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.send_first --out_dir=runs/14_send_first

Every rank passes a tensor to the next rank and receives the previous rank's:

- ``isend/irecv``: both posted without waiting, then both waited for;
- ``even sends first``: blocking ``send``/``recv``, even ranks sending first and odd ranks receiving first;
- ``all send first``: blocking ``send`` then ``recv`` on every rank -- the classic mistake;
- ``all receive first``: blocking ``recv`` then ``send`` on every rank -- its mirror image.

The last two run last, each in a process group of its own whose timeout is ``--wait_s``, so that the job
ends either way.

Each is tried with ``--sizes`` elements. Rank 0 writes ``send_first.json``: per way and size, whether every
rank finished and in how many seconds, or the error it stopped with.
"""

from __future__ import annotations

import datetime
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, number_list, parse_flags
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.paths import show

PROG = "torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.send_first"
DEFAULTS: dict[str, Any] = {"out_dir": "runs/14_send_first", "sizes": "16,1048576", "wait_s": 3.0}
HELP = {"out_dir": "where rank 0 writes send_first.json", "sizes": "comma-separated tensor sizes (elements)",
        "wait_s": "how long the blocking sends may wait before their process group gives up"}


def step(way: str, t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    buf = torch.empty_like(t)
    if way == "isend/irecv":
        for req in [dist.isend(t, nxt, group=group), dist.irecv(buf, prv, group=group)]:
            req.wait()
    elif way == "all receive first":  # the blocking calls, receive first on every rank
        dist.recv(buf, prv, group=group)
        dist.send(t, nxt, group=group)
    elif way == "all send first" or rank % 2 == 0:  # the blocking calls, send first
        dist.send(t, nxt, group=group)
        dist.recv(buf, prv, group=group)
    else:  # "even sends first": the odd ranks receive first
        dist.recv(buf, prv, group=group)
        dist.send(t, nxt, group=group)
    return buf


def attempt(way: str, n: int, group: dist.ProcessGroup | None) -> dict[str, Any]:
    t = torch.full((n,), float(dist.get_rank()))
    t0 = time.perf_counter()
    try:
        got = step(way, t, group)
    except RuntimeError as exc:
        first = re.sub(r"^\[[^\]]*\] ", "", str(exc).split("\n")[0])  # without the C++ source file's tag
        return {"finished": False, "seconds": time.perf_counter() - t0, "error": first[:160]}
    right = float(got[0]) == float((dist.get_rank() - 1) % dist.get_world_size())
    return {"finished": True, "seconds": time.perf_counter() - t0, "right": right}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    sizes = number_list(opts["sizes"], "sizes", int)
    with setup(device="cpu", threads=1, because="the question is gloo's send") as info:
        if not info.is_distributed:
            raise FlagError(f"the demo needs a process group: launch it with `{PROG}`.")
        results: dict[str, dict[str, Any]] = {}
        for way in ("isend/irecv", "even sends first", "all send first", "all receive first"):
            for n in sizes:
                # a group of its own each time: a group whose operation timed out is closed for good
                short = (dist.new_group(timeout=datetime.timedelta(seconds=opts["wait_s"])) if way.startswith("all ")
                         else None)
                mine = attempt(way, n, short)
                every: list = [None] * info.world_size
                dist.all_gather_object(every, mine)
                results[f"{way}, {n} elements"] = {"way": way, "elements": n, "per_rank": every}
                done = all(r["finished"] for r in every)
                log(f"[send_first] {way:<17} {n:>9,} elements: "
                    + (f"finished in {max(r['seconds'] for r in every):.3f} s" if done else
                       f"no rank finished; stopped after {max(r['seconds'] for r in every):.1f} s: {every[0]['error']}"))
        if info.is_main:
            path = Path(opts["out_dir"]) / "send_first.json"
            write_json(path, {"world_size": info.world_size, "options": opts, "results": results})
            log(f"[send_first] wrote {show(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
