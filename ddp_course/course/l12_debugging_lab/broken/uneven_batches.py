"""Bug: ranks with different numbers of batches (a hand-made shard, no ``drop_last``). The job hangs.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.uneven_batches --out_dir=runs/broken/uneven_batches

The dataset is split by hand, ``indices[rank::world_size]``, and loaded with ``drop_last=False``. With
``--n`` = 2 x 4 x 3 + 1 = 25 samples and batches of 4, rank 0 gets 13 samples (4 batches, the last of
one sample) and rank 1 gets 12 (3 batches). Every backward of a DDP model all-reduces the gradients,
so rank 0's fourth backward waits for a partner that has already left the loop -- here for the
``barrier`` before saving a checkpoint. Neither can finish: the job hangs until the process-group
timeout (``--timeout_s``; DDP and the barrier use a group made with that short timeout right after
the rendezvous, and each variant starts once every rank has arrived, on the default group's generous
timeout: a rank a busy machine slowed down is never what times out).

Three variants, in this order:

1. **fixed** -- ``drop_last=True`` on the loader (a ``DistributedSampler(drop_last=True)`` does the
   same for the sampler): every rank runs the same number of full batches;
2. **join** -- the uneven shards, but the loop inside ``Join([model])``: a rank that runs out of data
   joins the all-reduces of the others with zeros until all are done (DDP's tool for uneven inputs);
3. **broken** -- the uneven shards with ``drop_last=False``: hangs, then times out.

Each rank notes in ``rank<R>.json`` its number of samples and batches per variant (the per-rank
data that shows the problem before anything hangs) and where it was when the timeout ended it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddp_course.cli import command
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

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.uneven_batches"


class Windows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x, y = token_batch(i, 1)
        return x[0], y[0]


def epoch(model, loader, rec: Record, variant: str) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    done = 0
    for x, y in loader:
        rec.note(**{f"{variant}_in_batch": done})
        _, loss = model(x, y)
        loss.backward()  # DDP: an all-reduce every rank must join
        opt.step()
        opt.zero_grad(set_to_none=True)
        done += 1
    return done


@record
@command
def main(argv: list[str]) -> None:
    opts = flags(argv, {"n": 25, "batch": 4, "variant": "all", "timeout_s": 5.0}, PROG)
    variants = ("fixed", "join", "broken") if opts["variant"] == "all" else (opts["variant"],)
    with cpu_setup(INIT_TIMEOUT_S) as info:  # by design: see _common.CPU_BY_DESIGN
        group = short_group(opts["timeout_s"])  # DDP's all-reduces and the barrier give up after --timeout_s
        rec = Record(opts["out_dir"], info.rank)
        ds = Windows(opts["n"])
        shard = list(range(len(ds)))[info.rank::info.world_size]  # a hand-made shard: uneven when n % W != 0
        for variant in variants:
            together()  # every rank here before the short timeout can count
            loader = DataLoader(ds, batch_size=opts["batch"], sampler=shard, drop_last=(variant == "fixed"))
            rec.note(**{variant: {"samples": len(shard), "batches": len(loader)}}, phase=variant)
            log(f"[{variant}] rank {info.rank}: {len(shard)} samples, {len(loader)} batches", all_ranks=True)
            model = DDP(tiny_model(), process_group=group)
            where = "training loop"
            try:
                if variant == "join":
                    with Join([model]):  # ranks that finish early shadow the others' all-reduces
                        n_done = epoch(model, loader, rec, variant)
                else:
                    n_done = epoch(model, loader, rec, variant)
                where = "barrier"
                rec.note(in_call="barrier")
                dist.barrier(group=group)  # "everyone done? then rank 0 saves"
                rec.note(in_call=None, **{f"{variant}_completed": True, f"{variant}_batches_done": n_done})
                log(f"[{variant}] rank {info.rank}: finished {n_done} batches, passed the barrier", all_ranks=True)
            except Exception as exc:
                rec.error(exc, where=where)
                log(f"[{variant}] rank {info.rank} gave up in the {where} after {rec.data['error']['seconds']}s: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", all_ranks=True)
                raise


if __name__ == "__main__":
    sys.exit(main())
