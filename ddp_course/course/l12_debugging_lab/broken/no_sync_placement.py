"""Bug: ``no_sync()`` in the wrong place during gradient accumulation. No error; see what it costs.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.no_sync_placement --out_dir=runs/broken/no_sync_placement

Accumulating K micro-batches per optimizer step, only the last backward needs DDP's all-reduce;
``with model.no_sync():`` skips it on the others. DDP decides whether a backward will all-reduce when
the *forward* runs, so the context has to hold the forward as well as the backward. Three
placements, each for ``--steps`` optimizer steps of ``--k`` micro-batches:

- **right** -- forward and backward of micro-steps 0 .. K-2 inside ``no_sync()``, the last outside:
  one all-reduce per optimizer step;
- **backward_only** -- the forward outside, only ``loss.backward()`` inside: DDP already prepared
  the all-reduce during the forward, so every micro-step all-reduces anyway. Correct gradients, no
  saving at all -- the bug is invisible except in a profile or a count;
- **all_inside** -- the whole loop inside ``no_sync()``, the last micro-step too: no all-reduce ever;
  every rank steps with its own gradient and the replicas drift apart, silently.

A communication hook counts the bucket all-reduces of each backward (``AllReduceCounter`` from
lesson 06's lab); after the steps every rank compares its weights with rank 0's. Each rank notes
the counts, the micro-steps that all-reduced and the largest weight difference in ``rank<R>.json``.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.cli import command
from ddp_course.course.l12_debugging_lab.broken._common import (
    started,
    tiny_model,
    token_batch,
)
from ddp_course.course.tiny import AllReduceCounter
from ddp_course.dist import log

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.no_sync_placement"
VARIANTS = ("right", "backward_only", "all_inside")


def accumulate(model: DDP, micro: list, variant: str) -> None:
    """One optimizer step's K forward/backward passes, with ``no_sync()`` placed as ``variant`` says."""
    k_total = len(micro)
    if variant == "all_inside":
        with model.no_sync():  # THE BUG (2): the last micro-step too
            for x, y in micro:
                (model(x, y)[1] / k_total).backward()
        return
    for k, (x, y) in enumerate(micro):
        last = k == k_total - 1
        if variant == "right":
            with model.no_sync() if not last else contextlib.nullcontext():
                (model(x, y)[1] / k_total).backward()
        else:  # backward_only
            loss = model(x, y)[1] / k_total  # THE BUG (1): the forward ran outside no_sync()
            with model.no_sync() if not last else contextlib.nullcontext():
                loss.backward()


@record
@command
def main(argv: list[str]) -> None:
    with started(argv, {"k": 4, "steps": 2, "batch": 4}, PROG) as (opts, info, rec):  # see _common.CPU_BY_DESIGN
        for variant in VARIANTS:
            model = DDP(tiny_model())
            counter = AllReduceCounter(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            per_step = []
            for step in range(opts["steps"]):
                micro = [token_batch(1000 * info.rank + step * opts["k"] + j, opts["batch"]) for j in range(opts["k"])]
                counter.reset()
                accumulate(model, micro, variant)
                per_step.append({"bucket_all_reduces": counter.calls, "synced_micro_steps": counter.synced_micro_steps})
                opt.step()
                opt.zero_grad(set_to_none=True)
            flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
            ref = flat.clone()
            dist.broadcast(ref, src=0)
            drift = torch.tensor([(flat - ref).abs().max().item()])
            dist.all_reduce(drift, op=dist.ReduceOp.MAX)
            rec.note(**{variant: {"k": opts["k"], "per_step": per_step, "replica_max_diff": drift.item()}})
            log(f"[{variant:<13}] all-reduces per optimizer step: {[s['bucket_all_reduces'] for s in per_step]}, "
                f"micro-steps that synced: {per_step[0]['synced_micro_steps']}, replicas differ by up to "
                f"{drift.item():.2e}")


if __name__ == "__main__":
    sys.exit(main())
