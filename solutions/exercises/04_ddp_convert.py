"""Exercise 04 -- turn a single-process training script into a DDP script.

As given, this is a single-process training loop whose process-specific parts are marked TODO. Each
TODO has the single-process line it replaces written above it. Convert them so that

    torchrun --standalone --nproc_per_node=2 lessons/exercises/04_ddp_convert.py

trains ONE model on two processes, each process taking half of every batch, and the result equals
one process training on the whole (concatenated) batch:

1. ``setup``: read RANK / LOCAL_RANK / WORLD_SIZE, pin the device by LOCAL_RANK, and
   ``init_process_group`` with the backend that fits the device (gloo on CPU, nccl on GPUs);
2. ``make_loader``: a ``DistributedSampler`` (shuffled, ``drop_last``, the seed below) and a DataLoader
   that uses it and does not shuffle itself;
3. ``wrap``: ``DistributedDataParallel``;
4. ``start_epoch``: tell the sampler which epoch begins, at the start of every epoch;
5. ``mean_over_ranks``: the loss to log, averaged over the ranks, ``.item()`` on every rank;
6. ``save``: rank 0 saves the unwrapped model (``.module``); every rank waits at a barrier;
7. ``teardown``: leave the process group.

Grade it (the grader runs it with torchrun on 2 processes and compares the final parameters, and the
losses every rank logged, with a single process trained on the concatenated batch):

    python -m ddp_course check 04 lessons/exercises/04_ddp_convert.py

Every rank prints one ``RESULT {json}`` line at the end, for the grader.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.course.l04_ddp.convert_kit import build_model, clean_exit, small_data

# The run the grader reproduces in one process. Changing these is fine: the grader reads them from
# the RESULT lines (MICRO_BATCH is per process: one process with the concatenated batch takes 2x).
STEPS = 18  # optimizer steps: 3 epochs of 6 steps (96 windows / 2 processes / 8 per batch)
MICRO_BATCH = 8
LR = 0.3  # SGD with momentum 0.9
SEED = 1337
SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
TRAIN_WINDOWS = 96  # train on the first 96 windows of the corpus: an epoch is a few steps
VAL_WINDOWS = 32


def setup() -> tuple[int, int, torch.device]:
    """Join the job: returns (rank, world_size, device)."""
    # single process: return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # BEGIN SOLUTION hint: read the rank, local rank and world size torchrun set; one GPU per local rank (nccl) if there are enough, else the CPU (gloo); join the process group with a timeout
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", local_rank)  # LOCAL_RANK: the GPUs of every node are 0..N-1
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=60))
    return rank, world_size, device
    # END SOLUTION


def make_loader(ds, rank: int, world_size: int) -> tuple[DataLoader, DistributedSampler | None]:
    """This process's DataLoader, and the sampler whose epoch must be set (None if there is none)."""
    # single process: return DataLoader(ds, batch_size=MICRO_BATCH, shuffle=True, drop_last=True), None
    # BEGIN SOLUTION hint: a distributed sampler gives this rank its own shuffled shard (SEED, drop the tail); the DataLoader uses it and does not shuffle itself
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, drop_last=True)
    return DataLoader(ds, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True), sampler
    # END SOLUTION


def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    # single process: return model
    # BEGIN SOLUTION hint: wrap the model in DistributedDataParallel (device_ids only on a GPU)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # END SOLUTION


def start_epoch(sampler: DistributedSampler | None, epoch: int) -> None:
    # single process: nothing to do (DataLoader(shuffle=True) reshuffles by itself)
    # BEGIN SOLUTION hint: tell the sampler which epoch starts, or every epoch repeats epoch 0's order
    sampler.set_epoch(epoch)
    # END SOLUTION


def mean_over_ranks(loss: torch.Tensor, world_size: int) -> float:
    """The loss averaged over the ranks, as a float on every rank (for logging)."""
    # single process: return loss.item()
    # BEGIN SOLUTION hint: average a detached copy of the loss over the ranks (a collective: every rank calls it), return a float
    t = loss.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / world_size).item()
    # END SOLUTION


def save(model: torch.nn.Module, path: Path, rank: int) -> None:
    # single process: torch.save(model.state_dict(), path)
    # BEGIN SOLUTION hint: only rank 0 writes the unwrapped model's weights; then every rank waits until the file is written
    if rank == 0:
        torch.save(model.module.state_dict(), path)  # the plain model: no "module." in the keys
    dist.barrier()  # nobody goes on (to read the file, or to exit) before it is written
    # END SOLUTION


def teardown() -> None:
    # single process: nothing to do
    # BEGIN SOLUTION hint: leave the process group
    dist.destroy_process_group()
    # END SOLUTION


def main(argv: list[str]) -> None:
    out_dir = Path("runs/04_ddp_convert")
    for arg in argv:
        if not arg.startswith("--out_dir="):
            raise SystemExit(f"error: unknown option {arg!r}; the only option is --out_dir=PATH")
        out_dir = Path(arg.split("=", 1)[1])
    with clean_exit():  # the course's workaround for an abort at exit (see ddp_course/dist.py)
        rank, world_size, device = setup()
    torch.set_num_threads(1)  # a tiny model: one thread per process
    train_ds, _, vocab = small_data("tinyshakespeare", SHAPE["block_size"], TRAIN_WINDOWS, VAL_WINDOWS)
    model = wrap(build_model(vocab, SEED, **SHAPE).to(device), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader, sampler = make_loader(train_ds, rank, world_size)

    seen, losses, epoch = [], [], 0
    while len(losses) < STEPS:
        start_epoch(sampler, epoch)
        for idx, x, y in loader:  # idx: which windows this batch holds (the grader checks them)
            x, y = x.to(device), y.to(device)
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(mean_over_ranks(loss, world_size))
            seen.append(idx.tolist())
            if len(losses) == STEPS:
                break
        if rank == 0:
            print(f"epoch {epoch}: step {len(losses)}, loss {losses[-1]:.4f}", flush=True)
        epoch += 1

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "final.pt"
    save(model, path, rank)
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    result = json.dumps({
        "rank": rank, "world_size": world_size, "device": str(device), "final": str(path.resolve()),
        "param_checksum": [flat.sum().item(), flat.square().sum().item()], "seen": seen, "losses": losses,
        "config": {"steps": len(losses), "micro_batch_size": MICRO_BATCH, "lr": LR, "seed": SEED,
                   "train_windows": TRAIN_WINDOWS, "val_windows": VAL_WINDOWS, **SHAPE}})
    sys.stdout.write(f"RESULT {result}\n")  # one write: lines of two ranks cannot interleave
    sys.stdout.flush()
    teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
