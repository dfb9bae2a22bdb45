"""Bug: a collective called on rank 0 only. The job hangs until the process-group timeout.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.collective_rank0 --out_dir=runs/broken/collective_rank0
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.collective_rank0

An evaluation job: every rank computes the mean loss of a small model on its own shard of batches,
and the job reports the mean over all ranks. Twice:

1. **fixed** -- every rank calls ``all_reduce`` on its (loss sum, count), then all meet at a
   ``barrier`` and rank 0 reports. Completes.
2. **broken** -- "only rank 0 prints, so only rank 0 needs the global loss"::

       if rank == 0:
           dist.all_reduce(stats)        # rank 0 waits here for the others...
       dist.barrier()                    # ...who wait here for rank 0

   Collectives are matched by the order each rank issues them, so rank 0's all-reduce and the other
   ranks' barrier can never complete each other. Nothing fails until the process group's timeout
   (``--timeout_s``) ends the wait on every rank. (The collectives run in a group made right after
   the rendezvous with that short timeout; joining gets a generous one, since a busy machine can
   take many seconds to start every rank.)

Before each collective a rank notes which one it is entering (``in_collective``) in its record
``rank<R>.json``; the error that ended the wait is noted too. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
the process group checks, before every collective, that all ranks are calling the same one, and
fails at once with a message naming each rank's collective.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course.cli import FlagError, command
from ddp_course.course.l12_debugging_lab.broken._common import (
    INIT_TIMEOUT_S,
    Record,
    cpu_setup,
    flags,
    short_group,
    tiny_model,
    token_batch,
)
from ddp_course.dist import log

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.collective_rank0"


def local_stats(rank: int, world: int, n_batches: int = 4) -> torch.Tensor:
    """(sum of batch losses, number of batches) over this rank's shard: batches rank, rank + W, ..."""
    model = tiny_model()
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, n_batches * world, world):
            _, loss = model(*token_batch(i, 4))
            total += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
    return total


@record  # if this rank fails, torchrun's error file carries its traceback
@command
def main(argv: list[str]) -> None:
    opts = flags(argv, {"variant": "both", "timeout_s": 5.0}, PROG)
    if opts["variant"] not in ("both", "fixed", "broken"):
        raise FlagError(f"{PROG}: --variant must be both, fixed or broken")
    with cpu_setup(INIT_TIMEOUT_S) as info:  # by design: see _common.CPU_BY_DESIGN
        group = short_group(opts["timeout_s"])  # the collectives below give up after --timeout_s
        rec = Record(opts["out_dir"], info.rank)
        rec.note(world_size=info.world_size, timeout_s=opts["timeout_s"])
        stats = local_stats(info.rank, info.world_size)
        rec.note(local_mean_loss=(stats[0] / stats[1]).item())

        if opts["variant"] in ("both", "fixed"):
            fixed = stats.clone()
            rec.note(in_collective="all_reduce", phase="fixed")
            dist.all_reduce(fixed, group=group)  # every rank: the collectives match
            rec.note(in_collective="barrier")
            dist.barrier(group=group)
            rec.note(in_collective=None, fixed_global_mean_loss=(fixed[0] / fixed[1]).item(), fixed_completed=True)
            log(f"[fixed] global mean loss {(fixed[0] / fixed[1]).item():.4f} over {int(fixed[1])} batches")

        if opts["variant"] in ("both", "broken"):
            broken = stats.clone()
            rec.note(phase="broken")
            try:
                if info.rank == 0:  # THE BUG: a collective only one rank calls
                    rec.note(in_collective="all_reduce")
                    dist.all_reduce(broken, group=group)
                rec.note(in_collective="barrier")
                dist.barrier(group=group)
                rec.note(in_collective=None, broken_completed=True)
            except Exception as exc:
                rec.error(exc, where=rec.data["in_collective"])
                log(f"[broken] rank {info.rank} gave up in {rec.data['in_collective']} after "
                    f"{rec.data['error']['seconds']}s: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                    all_ranks=True)
                raise


if __name__ == "__main__":
    sys.exit(main())
