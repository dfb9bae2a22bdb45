"""An evaluation job: the mean loss of a small model over every rank's shard, run twice.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.eval_loss --out_dir=runs/broken/eval_loss
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.eval_loss

Exercise A of lesson 12: what goes wrong in this program is for the learner to find, so the program
says no more about it than a real one would. (The answer, for maintainers: ``BUGS["eval_loss"]`` in
``broken/__init__.py``.)

Every rank computes the loss sum and batch count of its own shard of batches, then the job reports
the mean over all ranks, twice: the ``fixed`` evaluation, then the ``broken`` one, the way the
program was first written. The collectives of both run in a group made with the short
``--timeout_s``, entered only once every rank has arrived (``_common.together``, on the default
group's generous timeout): a rank a busy machine slowed down is never what times out. Each rank
writes ``rank<R>.json`` (its local loss, the phase it is in, and the error that ended it); the
start-up hook every ``launch.run`` job carries keeps each rank's traceback or stack
(``ddp_course.postmortem``), which is where the grader reads what each rank was waiting in.
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
    together,
    token_batch,
)
from ddp_course.dist import log

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.eval_loss"


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
        group = short_group(opts["timeout_s"])  # the evaluations' collectives give up after --timeout_s
        rec = Record(opts["out_dir"], info.rank)
        rec.note(world_size=info.world_size, timeout_s=opts["timeout_s"])
        stats = local_stats(info.rank, info.world_size)
        rec.note(local_mean_loss=(stats[0] / stats[1]).item())

        if opts["variant"] in ("both", "fixed"):
            together()
            fixed = stats.clone()
            rec.note(phase="fixed")
            dist.all_reduce(fixed, group=group)
            dist.barrier(group=group)
            rec.note(fixed_global_mean_loss=(fixed[0] / fixed[1]).item(), fixed_completed=True)
            log(f"[fixed] global mean loss {(fixed[0] / fixed[1]).item():.4f} over {int(fixed[1])} batches")

        if opts["variant"] in ("both", "broken"):
            together()
            broken = stats.clone()
            rec.note(phase="broken")
            try:
                if info.rank == 0:  # only rank 0 prints, so only rank 0 needs the global loss
                    dist.all_reduce(broken, group=group)
                dist.barrier(group=group)
                rec.note(broken_completed=True)
                log(f"[broken] global mean loss {(broken[0] / broken[1]).item():.4f} over {int(broken[1])} batches")
            except Exception as exc:
                rec.error(exc, where="broken evaluation")
                raise


if __name__ == "__main__":
    sys.exit(main())
