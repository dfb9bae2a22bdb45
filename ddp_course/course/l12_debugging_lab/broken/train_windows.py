"""A small DDP training on windows of the course's corpus, run twice.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.train_windows --out_dir=runs/broken/train_windows

Exercise C of lesson 12: what goes wrong in this program is for the learner to find, so the program
says no more about it than a real one would. (The answer, for maintainers: ``BUGS["train_windows"]`` in
``broken/__init__.py``.)

Both runs train the same small MiniGPT with DDP for ``--steps`` steps: the ``broken`` one picks its
batches the way the program was first written, the ``fixed`` one with the course's
``DistributedSampler``. Like most training scripts, only rank 0 prints (its loss per step). Each rank
notes in ``rank<R>.json``, per run, the window indices it trained on at every step and its own loss
before DDP averaged the gradients: the per-rank data to compare.
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

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.train_windows"


def batches_for(variant: str, n: int, batch: int, steps: int, rank: int, world: int, seed: int) -> list[list[int]]:
    if variant == "broken":
        g = torch.Generator().manual_seed(seed)  # a reproducible shuffle
        order = torch.randperm(n, generator=g).tolist()
        return [order[s * batch:(s + 1) * batch] for s in range(steps)]
    sampler = train_sampler(range(n), rank, world, seed)  # the course's DistributedSampler
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
            torch.manual_seed(0)  # the model's initial weights
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
            log(f"[{variant}] loss by step: " + ", ".join(f"{v:.4f}" for v in losses))  # rank 0's, as usual


if __name__ == "__main__":
    sys.exit(main())
