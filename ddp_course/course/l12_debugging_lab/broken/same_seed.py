"""Bug: every rank shuffles the data with the same seed. All ranks train on the same batches.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.same_seed --out_dir=runs/broken/same_seed

A hand-written shuffle instead of a ``DistributedSampler``: each rank draws its batches from a
``torch.Generator`` seeded with the job's seed -- the same seed on every rank, so the same batches
on every rank. DDP still averages the gradients and the loss still falls, but the N ranks compute
the same gradient N times: the job trains on one rank's worth of data at N times the cost.

Both variants train a small MiniGPT with DDP for ``--steps`` steps on windows of the course's corpus:

- **broken** -- ``g = torch.Generator().manual_seed(seed)``, batch ``i`` = the next ``batch`` indices
  of ``torch.randperm(len(dataset), generator=g)``;
- **fixed** -- the course's ``DistributedSampler`` (shared seed, a disjoint shard per rank).

Each rank notes in ``rank<R>.json``, per step, the window indices it trained on and its own loss
before DDP averaged the gradients: the per-rank data to compare. (Identical losses on every rank,
to the last bit, are the tell-tale sign; different data never gives that.) The model itself is
seeded identically on every rank, as it must be -- only the *data* seed must differ or be sharded.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.cli import command
from ddp_course.course.l12_debugging_lab.broken._common import started
from ddp_course.data import prepare, train_sampler
from ddp_course.dist import log
from ddp_course.model import GPTConfig, MiniGPT

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.same_seed"


def batches_for(variant: str, n: int, batch: int, steps: int, rank: int, world: int, seed: int) -> list[list[int]]:
    if variant == "broken":
        g = torch.Generator().manual_seed(seed)  # THE BUG: the same seed on every rank
        order = torch.randperm(n, generator=g).tolist()
        return [order[s * batch:(s + 1) * batch] for s in range(steps)]
    sampler = train_sampler(range(n), rank, world, seed)  # DistributedSampler: a disjoint shard per rank
    sampler.set_epoch(0)
    order = list(sampler)
    return [order[s * batch:(s + 1) * batch] for s in range(steps)]


@record
@command
def main(argv: list[str]) -> None:
    with started(argv, {"steps": 4, "batch": 4, "seed": 1337, "corpus": "tinyshakespeare"}, PROG) as (opts, info, rec):  # see _common.CPU_BY_DESIGN
        data = prepare(opts["corpus"], 32, 0.1, announce=lambda m: log(m))
        ds = data.train
        for variant in ("broken", "fixed"):
            torch.manual_seed(0)  # the model: the same initial weights on every rank (correct)
            model = DDP(MiniGPT(GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=32, n_layer=1,
                                          n_head=2, n_embd=32)))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            plan = batches_for(variant, len(ds), opts["batch"], opts["steps"], info.rank, info.world_size,
                               opts["seed"])
            losses = []
            for idx in plan:
                x = torch.stack([ds[i][0] for i in idx])
                y = torch.stack([ds[i][1] for i in idx])
                _, loss = model(x, y)
                loss.backward()  # DDP averages the gradients over the ranks here
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())  # this rank's own loss, before any averaging
            rec.note(**{variant: {"indices": plan, "local_losses": losses}})
            log(f"[{variant}] rank {info.rank}: first batch windows {plan[0]}, local losses "
                + ", ".join(f"{v:.6f}" for v in losses), all_ranks=True)


if __name__ == "__main__":
    sys.exit(main())
