"""Ranks that disagree about the collectives they call: wrong numbers first, then a timeout.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l02_collectives.mismatch --case=skip --timeout_s=10 --out_dir=runs/mm

Collectives are matched by the order in which each rank issues them, not by name or by tensor.
This program breaks that rule twice, on purpose:

1. ``swap`` (always, first): every rank all-reduces two tensors of the same shape, ``a`` and ``b``,
   but the ranks after rank 0 do it in the other order. Nothing fails: the sizes match, so the
   backend pairs rank 0's ``a`` with the others' ``b`` and every rank ends with wrong numbers.
2. then the ``--case``, which leaves a rank waiting for a partner that never comes:
   - ``skip``: only rank 0 all-reduces a value "for its log" (``if rank == 0: all_reduce(loss)``),
     then every rank meets at a barrier. Rank 0 waits in its all_reduce, the others in the barrier.
   - ``order``: rank 0 calls all_reduce then broadcast, the others broadcast then all_reduce.

   Neither can complete. After ``--timeout_s`` seconds the process group's timeout fires on every
   waiting rank with a RuntimeError, instead of the job hanging forever.

Every rank writes ``mismatch_rank<R>.json`` into ``--out_dir`` -- what ``swap`` produced and what it
should have, the collectives the rank issued in order, and the error that ended it (type, message,
the call it was in, seconds waited) -- then exits with status 1. The job is *meant* to fail.

On NCCL (``--device=cuda``) the same mismatches hang until NCCL's watchdog aborts the process after
the timeout; the abort may kill the process before it can write its JSON. That is why the lab runs
on the CPU with gloo by default on every machine (``CPU_BY_DESIGN``, printed in the first line).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags

CPU_BY_DESIGN = ("gloo ends a mismatched collective with an error every rank can catch and record; under NCCL "
                 "the watchdog aborts the process, which may die before it writes what it saw")
DEFAULTS: dict[str, Any] = {"out_dir": "runs/mismatch", "case": "skip", "timeout_s": 10.0,
                            "device": "cpu"}  # by design: see CPU_BY_DESIGN
CASES = ("skip", "order")
PROG = "python -m ddp_course.course.l02_collectives.mismatch"


class Trace:
    """The collectives this rank issued, in order; which one it was in when something failed."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, label: str, fn, *args, **kwargs):
        self.calls.append(label)
        return fn(*args, **kwargs)


def swap(rank: int, world: int, device: torch.device, trace: Trace) -> dict[str, Any]:
    """all_reduce(a); all_reduce(b) on rank 0 but b first elsewhere: completes, silently wrong."""
    a = torch.full((3,), float(rank + 1), device=device)  # a on rank r: r + 1
    b = torch.full((3,), 100.0 * (rank + 1), device=device)  # b on rank r: 100 (r + 1)
    before = {"a": a[0].item(), "b": b[0].item()}
    if rank == 0:
        trace("all_reduce(a)", dist.all_reduce, a)
        trace("all_reduce(b)", dist.all_reduce, b)
    else:
        trace("all_reduce(b)", dist.all_reduce, b)
        trace("all_reduce(a)", dist.all_reduce, a)
    expected = {"a": sum(r + 1.0 for r in range(world)), "b": sum(100.0 * (r + 1) for r in range(world))}
    after = {"a": a[0].item(), "b": b[0].item()}
    return {"before": before, "after": after, "expected": expected, "correct": after == expected}


def stuck(case: str, rank: int, device: torch.device, trace: Trace) -> None:
    """The collectives of ``case``; they cannot all be matched, so some rank waits until the timeout."""
    loss = torch.tensor([float(rank)], device=device)
    params = torch.ones(4, device=device)
    if case == "skip":
        if rank == 0:  # "only rank 0 logs, so only rank 0 needs the global loss" -- the classic bug
            trace("all_reduce(loss)", dist.all_reduce, loss)
        trace("barrier()", dist.barrier)
    else:  # order
        if rank == 0:
            trace("all_reduce(loss)", dist.all_reduce, loss)
            trace("broadcast(params, src=0)", dist.broadcast, params, 0)
        else:
            trace("broadcast(params, src=0)", dist.broadcast, params, 0)
            trace("all_reduce(loss)", dist.all_reduce, loss)


@command
def main(argv: list[str]) -> int:
    from ddp_course.dist import log, setup
    from ddp_course.metrics import write_json

    opts = parse_flags(argv, DEFAULTS, PROG)
    if opts["case"] not in CASES:
        raise FlagError(f"{PROG}: --case must be one of {', '.join(CASES)} (got {opts['case']!r}).")
    if opts["timeout_s"] <= 0:
        raise FlagError(f"{PROG}: --timeout_s must be positive (got {opts['timeout_s']}); it bounds how long "
                        "the stuck collective waits, e.g. --timeout_s=10.")
    if int(os.environ.get("WORLD_SIZE", 1)) < 2:
        raise FlagError(f"{PROG} needs at least two processes to disagree: launch it with "
                        "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l02_collectives.mismatch")

    out_dir = Path(opts["out_dir"])
    because = CPU_BY_DESIGN if opts["device"] == "cpu" else ""
    with setup(device=opts["device"], timeout_s=opts["timeout_s"], because=because) as info:
        log(f"[mismatch] {info.world_size} ranks, {info.device_reason}")
        trace = Trace()
        result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                                  "case": opts["case"], "timeout_s": opts["timeout_s"]}
        result["swap"] = swap(info.rank, info.world_size, info.device, trace)
        log(f"swap: a = {result['swap']['after']['a']:g} (should be {result['swap']['expected']['a']:g}), "
            f"b = {result['swap']['after']['b']:g} (should be {result['swap']['expected']['b']:g}) -- no error",
            all_ranks=True)
        dist.barrier()  # everyone is past `swap` before the deliberate mismatch starts
        trace.calls.append("barrier()")
        log(f"case {opts['case']}: the ranks now disagree; the timeout is {opts['timeout_s']:g} s", all_ranks=False)
        t0 = time.monotonic()
        try:
            stuck(opts["case"], info.rank, info.device, trace)
            result["error"] = None  # not reached on a working backend: a mismatch cannot complete
        except Exception as exc:  # the process group's timeout, or a lost peer
            result["error"] = {"type": type(exc).__name__, "message": str(exc), "in_call": trace.calls[-1],
                               "waited_s": time.monotonic() - t0}
            log(f"{type(exc).__name__} after {result['error']['waited_s']:.1f} s in {trace.calls[-1]}: "
                f"{str(exc).splitlines()[0]}", all_ranks=True)
        result["calls"] = trace.calls
        write_json(out_dir / f"mismatch_rank{info.rank}.json", result)
    # The job must fail: a mismatch that "succeeded" would be the most dangerous outcome of all.
    return 1


if __name__ == "__main__":
    sys.exit(main())
