"""The DDP recipe with every step written out, in one program you launch with torchrun.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l04_ddp.ddp_recipe --out_dir=runs/04_recipe

Without torchrun it is one process with no process group -- the single-process reference. Give it
the global batch of the 2-rank run (2 x 8 windows) and it trains on the concatenated batch:

    python -m ddp_course.course.l04_ddp.ddp_recipe --out_dir=runs/04_single --micro_batch_size=16

The rest of the course gets steps 1-3 from ``ddp_course.dist.setup`` and the loop from
``ddp_course.train``; here they are spelled out so that each can be read (and broken) on its own:

1. who am I: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
2. the device, pinned by LOCAL_RANK (never the global RANK), and the backend to match it;
3. ``init_process_group`` -- and ``destroy_process_group`` however the program ends;
4. the same initial model on every rank (same seed; DDP also broadcasts rank 0's weights);
5. ``DistributedDataParallel``: averages the gradients over the ranks during ``backward()``;
6. ``DistributedSampler`` (disjoint shards, ``drop_last``), ``set_epoch`` every epoch, no shuffle
   in the DataLoader;
7. logging: every rank takes part in the all-reduce and calls ``.item()``; only rank 0 prints;
8. validation loss summed over ranks with ``all_reduce`` (sums and counts, then one division);
9. saving on rank 0 only, the unwrapped model ``ddp.module``, then a barrier.

``--variants=a,b,...`` trains each variant from scratch, in turn, in the same process group:

- ``recipe``: the recipe above.
- ``stream``: the recipe with the streaming alternative (``ddp_course.data.stream_offsets``): random
  windows anywhere in the token stream, each rank its slice of one draw; no sampler, no epochs.
- ``no_set_epoch``: the recipe without ``sampler.set_epoch``: every epoch repeats the same order.
- ``no_sampler``: ``DataLoader(shuffle=True)`` with the same seed on every rank and no sampler:
  every rank trains on the same windows, so the global batch is one rank's batch W times over.
- ``manual``: no DDP. Each rank seeds its model differently, rank 0's weights are broadcast once,
  and after each backward the gradients are all-reduced and divided by W by hand: what DDP does.
- ``no_broadcast``: ``manual`` without the broadcast: the replicas start apart and stay apart.
- ``adamw``: the recipe with AdamW instead of SGD with momentum (lesson 04 compares the two).

Rank 0 writes ``<out_dir>/<variant>/result.json`` (per-step losses, the windows every rank saw,
the validation loss, how far the replicas are apart) and ``<out_dir>/<variant>/final.pt`` (the
state dict of the unwrapped model). ``--help`` lists the options. The data and the model come from
``convert_kit``, which exercise 04 shares.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l04_ddp.convert_kit import build_model, small_data
from ddp_course.data import stream_offsets
from ddp_course.dist import clean_exit, cpu_count
from ddp_course.metrics import write_json
from ddp_course.model import MiniGPT
from ddp_course.paths import show

PROG = "python -m ddp_course.course.l04_ddp.ddp_recipe"
# The adamw variant's weight decay: torch.optim.AdamW's default (torch/optim/adamw.py), written out because
# lesson 04 measures what it moves (adamw_step.first_step).
ADAMW_WEIGHT_DECAY = 1e-2
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/ddp_recipe",  # one folder per variant is written inside
    "variants": "recipe",  # comma-separated, from VARIANTS
    "steps": 30,  # optimizer steps per variant
    "micro_batch_size": 8,  # windows per rank per step (the single-process reference: W times this)
    "train_windows": 96,  # train on the first N windows only, so that an epoch lasts a few steps
    "val_windows": 32,  # validation windows, split over the ranks
    "block_size": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "lr": 0.3,  # SGD with momentum 0.9, constant (no schedule: fewer moving parts)
    "adamw_lr": 3e-3,  # the learning rate of the `adamw` variant
    "seed": 1337,  # model init and data order
    "log_interval": 10,
    "device": "auto",  # auto: CUDA + NCCL when every local rank has a GPU, else CPU + gloo
    "timeout_s": 60.0,  # process-group timeout: a collective nobody answers fails after this long
    "threads": 1,  # CPU threads per process (tiny model: a second thread gains little and spins
    #               when the cores are busy); 0 = the cores divided by the processes on this node
    "corpus": "tinyshakespeare",
}


@dataclass(frozen=True)
class Variant:
    data: str  # "sampler" | "stream" | "loader_shuffle"
    set_epoch: bool = True
    wrap: str = "ddp"  # "ddp" | "manual" (gradients all-reduced by hand)
    seed_per_rank: bool = False  # init each rank's model from seed + rank
    broadcast: bool = True  # manual: copy rank 0's weights to every rank before training
    optimizer: str = "sgd"  # "sgd" (momentum 0.9, --lr) | "adamw" (--adamw_lr)


VARIANTS = {
    "recipe": Variant("sampler"),
    "stream": Variant("stream"),
    "no_set_epoch": Variant("sampler", set_epoch=False),
    "no_sampler": Variant("loader_shuffle"),
    "manual": Variant("sampler", wrap="manual", seed_per_rank=True),
    "no_broadcast": Variant("sampler", wrap="manual", seed_per_rank=True, broadcast=False),
    "adamw": Variant("sampler", optimizer="adamw"),
}


# --- small collectives the lab uses to look at the replicas ---------------------------------------------

def replica_spread(model: torch.nn.Module, world_size: int) -> float:
    """The largest |w_r - w_0| over every weight of every rank r (all_gather). Every rank must call it."""
    vec = parameters_to_vector(model.parameters()).detach()
    if world_size == 1:
        return 0.0
    gathered = [torch.empty_like(vec) for _ in range(world_size)]
    dist.all_gather(gathered, vec)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    """The mean of a scalar over the ranks. Every rank must call it: the all_reduce is a collective.
    (``.item()`` is not: it waits only for this rank's own device, wherever it is called.)"""
    t = value.detach().clone().double() if value.device.type == "cpu" else value.detach().clone().float()
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world_size
    return t.item()


# --- one variant, start to finish ------------------------------------------------------------------------

def train_variant(name: str, opts: dict[str, Any], ctx: dict[str, Any], train_ds, val_ds, vocab_size: int) -> None:
    spec = VARIANTS[name]
    rank, world_size, device = ctx["rank"], ctx["world_size"], ctx["device"]
    distributed = world_size > 1 or ctx["distributed"]
    is_main = rank == 0
    B = opts["micro_batch_size"]
    t0 = time.perf_counter()

    # 4. The same initial model on every rank: the same seed (the `manual` variants seed each rank
    #    differently on purpose, to show what the broadcast is for).
    seed = opts["seed"] + (rank if spec.seed_per_rank else 0)
    model = build_model(vocab_size, seed, block_size=opts["block_size"], n_layer=opts["n_layer"],
                        n_head=opts["n_head"], n_embd=opts["n_embd"]).to(device)
    init_spread = replica_spread(model, world_size)

    # 5. Wrap. DDP broadcasts rank 0's parameters and buffers here, then all-reduces (averages) the
    #    gradients bucket by bucket while backward() runs. device_ids: the one GPU of this process.
    if spec.wrap == "ddp" and distributed:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif spec.wrap == "manual" and distributed and spec.broadcast:
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)  # what DDP's constructor does for us
    raw = model.module if isinstance(model, DDP) else model  # 9. the plain model, for saving and sampling
    start_spread = replica_spread(raw, world_size)
    if spec.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=opts["adamw_lr"], weight_decay=ADAMW_WEIGHT_DECAY)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=opts["lr"], momentum=0.9)
    key_bias = watch_key_biases(raw, optimizer) if spec.optimizer == "adamw" else None  # for section 6, not the recipe

    # 6. Data. The sampler shards one shuffled permutation of the dataset: rank r takes every W-th
    #    index from position r, so the ranks' batches are disjoint and together they are the batch a
    #    single process with W x B would draw. drop_last=True: every rank gets the same number of
    #    samples (no padding with repeated windows), so no rank runs a step the others do not.
    #    Shuffling belongs to the sampler: DataLoader(shuffle=True) together with a sampler is refused.
    sampler = None
    if spec.data == "sampler":
        sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                     seed=opts["seed"], drop_last=True)
        loader = DataLoader(train_ds, batch_size=B, sampler=sampler, shuffle=False, drop_last=True)
    elif spec.data == "loader_shuffle":  # the bug: the same shuffled order on every rank
        loader = DataLoader(train_ds, batch_size=B, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(opts["seed"]))
    steps_per_epoch = len(loader) if spec.data != "stream" else None

    def batches():
        if spec.data == "stream":
            tokens = train_ds.windows.tokens[: len(train_ds) * opts["block_size"] + 1]  # the same text
            T = opts["block_size"]
            for starts in stream_offsets(len(tokens), T, B, rank, world_size, opts["seed"]):
                s = starts.tolist()
                yield (starts, torch.stack([tokens[i: i + T] for i in s]),
                       torch.stack([tokens[i + 1: i + T + 1] for i in s]))
            return
        epoch = 0
        while True:
            if sampler is not None and spec.set_epoch:
                sampler.set_epoch(epoch)  # a new permutation each epoch, the same one on every rank
            yield from loader
            epoch += 1

    losses, seen = [], []
    it = batches()
    model.train()
    for step in range(opts["steps"]):
        idx, x, y = next(it)
        x, y = x.to(device), y.to(device)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # under DDP the averaged gradients are in p.grad when this returns
        if spec.wrap == "manual" and distributed:
            for p in model.parameters():  # one all-reduce per tensor: DDP buckets them and overlaps
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world_size
        optimizer.step()
        # 7. Every rank joins the all-reduce and calls .item(); only rank 0 prints.
        losses.append(mean_over_ranks(loss, world_size))
        seen.append([int(i) for i in idx])
        if is_main and ((step + 1) % opts["log_interval"] == 0 or step + 1 == opts["steps"]):
            print(f"[{name}] step {step + 1:>3}/{opts['steps']}  loss {losses[-1]:.4f}", flush=True)

    # 8. Validation: rank r evaluates windows r, r+W, ...; the sums and counts are all-reduced and
    #    divided once (averaging per-rank means would be wrong if the shards were uneven).
    model.eval()
    mine = list(range(rank, len(val_ds), world_size))
    with torch.no_grad():
        xv = torch.stack([val_ds[i][1] for i in mine]).to(device)
        yv = torch.stack([val_ds[i][2] for i in mine]).to(device)
        _, vloss = raw(xv, yv)
    totals = torch.tensor([vloss.item() * len(mine), float(len(mine))], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    val_loss = (totals[0] / totals[1]).item()

    end_spread = replica_spread(raw, world_size)
    all_seen = [seen]
    if distributed:
        all_seen = [None] * world_size
        dist.all_gather_object(all_seen, seen)

    # 9. Save on rank 0 only, the unwrapped model: its keys have no "module." prefix, so the file
    #    loads into a plain MiniGPT. The barrier keeps the other ranks from reading it too early.
    out = Path(opts["out_dir"]) / name
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(raw.state_dict(), out / "final.pt")
        write_json(out / "result.json", {
            "variant": name, "spec": spec.__dict__, "world_size": world_size, "ranks": ctx["ranks"],
            "micro_batch_size": B, "global_batch": B * world_size, "steps": opts["steps"],
            "steps_per_epoch": steps_per_epoch, "options": opts,
            "losses": losses, "val_loss": val_loss, "seen": all_seen,
            "replica_spread": {"init": init_spread, "start": start_spread, "end": end_spread},
            "key_bias": key_bias,
            "state_dict_first_key": {"model": next(iter(model.state_dict())),
                                     "unwrapped": next(iter(raw.state_dict()))},
            "wall_s": time.perf_counter() - t0})
        print(f"[{name}] val_loss {val_loss:.4f}; replicas apart by {end_spread:.2e} at the end; "
              f"wrote {show(Path(out) / 'result.json')}", flush=True)
    if distributed:
        dist.barrier()


def watch_key_biases(model: MiniGPT, optimizer: torch.optim.Optimizer) -> dict[str, list[float]]:
    """Record, at every optimizer step, the largest |gradient| of the attention key biases (the key third
    of each ``attn.qkv.bias``, whose true gradient is zero: lesson 04, section 6) and the largest step
    the optimizer gives them; the returned dict fills as training runs (optimizer step hooks)."""
    C = model.cfg.n_embd
    biases = [b.attn.qkv.bias for b in model.blocks]
    out: dict[str, list[float]] = {"grad_max": [], "step_max": []}
    before: list[torch.Tensor] = []

    def pre(opt, args, kwargs) -> None:
        out["grad_max"].append(max(b.grad[C:2 * C].abs().max().item() for b in biases))
        before[:] = [b.detach()[C:2 * C].clone() for b in biases]

    def post(opt, args, kwargs) -> None:
        out["step_max"].append(max((b.detach()[C:2 * C] - b0).abs().max().item() for b, b0 in zip(biases, before)))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    return out


def check_options(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with ``variants`` cleaned up; a ``FlagError`` for an unknown variant or device."""
    names = [v.strip() for v in opts["variants"].split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise FlagError(f"{PROG}: unknown variant(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(VARIANTS)}, e.g. --variants=recipe,no_sampler.")
    if opts["device"] not in ("auto", "cpu", "cuda"):
        raise FlagError(f"{PROG}: --device must be auto, cpu or cuda (got {opts['device']!r}).")
    return {**opts, "variants": ",".join(names)}


@record  # on failure, torchrun's error file carries this rank's traceback
@command  # a bad option (FlagError): one line "error: ..." and exit code 2
def main(argv: list[str]) -> None:
    opts = check_options(parse_flags(argv, DEFAULTS, PROG, doc=__doc__))

    # 1. Who am I? torchrun sets these for every process it starts; without torchrun: one process.
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))  # 0 .. WORLD_SIZE-1 over all nodes
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # 0 .. LOCAL_WORLD_SIZE-1 on this node
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    # 2. The device, pinned by LOCAL_RANK: on the second node RANK is 8..15 but the GPUs are 0..7.
    #    NCCL for CUDA tensors (one GPU per process), gloo for CPU tensors.
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if opts["device"] == "cuda" and not enough_gpus:
        raise FlagError(f"--device=cuda needs one GPU per process: {local_world_size} process(es) on this node, "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA GPU(s) visible. "
                        "Use --device=auto or --device=cpu.")
    use_cuda = opts["device"] == "cuda" or (opts["device"] == "auto" and enough_gpus)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds to the current device
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(opts["threads"] or max(1, cpu_count() // local_world_size))  # share the cores

    # 3. Join the process group (env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
    #    with a short timeout, and leave it however the program ends.
    if distributed:
        with clean_exit():  # the course's workaround for an abort at exit (ddp_course/dist.py)
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=opts["timeout_s"]))
    try:
        me = {"rank": rank, "local_rank": local_rank, "device": str(device), "backend": backend if distributed else None}
        ranks = [me]
        if distributed:
            ranks = [None] * world_size
            dist.all_gather_object(ranks, me)
        if rank == 0:
            print(f"[ddp_recipe] {world_size} process(es), backend {me['backend']}, devices "
                  f"{[r['device'] for r in ranks]}; variants {opts['variants']}", flush=True)
        train_ds, val_ds, vocab = small_data(opts["corpus"], opts["block_size"], opts["train_windows"],
                                             opts["val_windows"])
        ctx = {"rank": rank, "world_size": world_size, "device": device, "distributed": distributed, "ranks": ranks}
        for name in opts["variants"].split(","):
            train_variant(name, opts, ctx, train_ds, val_ds, vocab)
        if rank == 0:
            write_json(Path(opts["out_dir"]) / "done.json", {"variants": opts["variants"].split(",")})
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
