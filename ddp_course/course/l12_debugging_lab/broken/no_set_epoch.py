"""Bug: a DistributedSampler whose ``set_epoch`` is never called. Every epoch repeats the same order.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.no_set_epoch --out_dir=runs/broken/no_set_epoch

``DistributedSampler(shuffle=True)`` draws its permutation from ``seed + epoch``, and the epoch is
only what ``set_epoch`` last told it (0 if never). Without the call every epoch is shuffled the same
way: each rank sees its samples in the same order, in the same batches, every epoch. Nothing fails
and the loss still falls; the model simply trains on less variety than intended.

The program iterates ``--epochs`` epochs of a ``DataLoader`` over a dataset of ``--n`` numbered
samples twice: **broken** (no ``set_epoch``) and **fixed** (``sampler.set_epoch(epoch)`` at the start
of every epoch), and notes in ``rank<R>.json`` the sample numbers of each batch, per epoch: the
per-rank data the diagnosis compares.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.cli import command
from ddp_course.course.l12_debugging_lab.broken._common import started
from ddp_course.dist import log

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.no_set_epoch"


def epochs_seen(rank: int, world: int, n: int, batch: int, epochs: int, call_set_epoch: bool) -> list[list[int]]:
    """The sample numbers this rank reads in each epoch, in order."""
    dataset = torch.arange(n)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    seen = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)  # THE FIX; the broken variant leaves this line out
        seen.append([int(i) for b in loader for i in b])
    return seen


@record
@command
def main(argv: list[str]) -> None:
    with started(argv, {"epochs": 3, "n": 16, "batch": 4}, PROG) as (opts, info, rec):  # see _common.CPU_BY_DESIGN
        for variant, call in (("broken", False), ("fixed", True)):
            seen = epochs_seen(info.rank, info.world_size, opts["n"], opts["batch"], opts["epochs"], call)
            rec.note(**{variant: seen})
            same = all(e == seen[0] for e in seen)
            log(f"[{variant}] rank {info.rank}: " + " | ".join(" ".join(map(str, e)) for e in seen)
                + ("   <- the same order every epoch" if same else ""), all_ranks=True)


if __name__ == "__main__":
    sys.exit(main())
