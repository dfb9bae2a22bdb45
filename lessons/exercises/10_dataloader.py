"""Exercise 10 -- tune the input pipeline of a distributed job.

Every rank of this job reads its shard of a dataset that behaves like network storage
(``ddp_course/course/l10_scaling/slow_storage.py``): each sample takes ``READ_S`` seconds to arrive,
and each process that reads first opens its own connection, which takes ``OPEN_S`` seconds. The
harness in ``main()`` reads ``EPOCHS`` epochs on every rank with two loaders, side by side, epoch by
epoch:

- the untuned loader: this rank's ``DistributedSampler`` and the training process reading every
  sample itself (``num_workers=0``);
- yours, from ``make_loader()``: the same shard in the same order, read as fast as you can make it,
  with ``start_epoch()`` called at the start of every epoch.

Complete the two TODOs, then run it from the repository root:

    torchrun --standalone --nproc_per_node=2 lessons/exercises/10_dataloader.py

and grade it (the grader runs it on 2 processes, recomputes every rank's samples from the sampler's
definition, and compares your loader's time per epoch with the untuned loader's of the same run):

    python -m ddp_course check 10 lessons/exercises/10_dataloader.py

Every rank prints one ``RESULT {json}`` line at the end, for the grader.
"""

import json
import os
import sys
import time

import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.course.l10_scaling.slow_storage import SlowStorage, fingerprint, untuned_loader
from ddp_course.dist import setup

# The grader's speed target is set for these values: leave them as they are.
N_SAMPLES = 192  # the dataset: 96 samples per rank, 12 batches of 8 per rank and epoch
BATCH_SIZE = 8  # per rank
EPOCHS = 3
SEED = 1234  # the shuffle's seed: every rank must use the same one
READ_S = 0.004  # seconds to read one sample (a request to network storage)
OPEN_S = 0.3  # seconds for a process to open its connection before its first read


def make_loader(dataset, batch_size: int, rank: int, world_size: int) -> DataLoader:
    """This rank's DataLoader: its own shuffled shard of ``dataset`` (seed ``SEED``), as fast as you can."""
    # TODO: this rank's shuffled shard (SEED), read as fast as you can make it (the notebook's hints say where the time goes)
    raise NotImplementedError("exercise: complete this part")


def start_epoch(loader: DataLoader, epoch: int) -> None:
    """Called at the start of every epoch, before the loader is iterated."""
    # TODO: tell the loader's sampler which epoch starts, or every epoch repeats epoch 0's order
    raise NotImplementedError("exercise: complete this part")


def read_epoch(loader: DataLoader) -> dict:
    """Iterate one epoch: its seconds, and what each batch held (indices, fingerprints, readers)."""
    t0 = time.perf_counter()
    indices, prints, readers = [], [], set()
    for batch in loader:
        indices.append(batch["index"].tolist())
        prints.append(fingerprint(batch["x"]))
        readers.update(batch["reader"].tolist())
    return {"seconds": time.perf_counter() - t0, "indices": indices, "fingerprints": prints,
            "readers": sorted(readers)}


def main(argv: list[str]) -> None:
    for arg in argv:  # --out_dir: where the grader keeps the job's log (this script writes nothing else)
        if not arg.startswith("--out_dir="):
            raise SystemExit(f"error: unknown option {arg!r}; the only option is --out_dir=PATH")
    with setup(device="cpu", threads=1, because="the input pipeline runs on the CPU") as info:
        rank, world_size = info.rank, info.world_size
        dataset = SlowStorage(N_SAMPLES, READ_S, OPEN_S)
        tuned = make_loader(dataset, BATCH_SIZE, rank, world_size)
        runs = {"untuned": [], "tuned": []}
        for epoch in range(EPOCHS):
            untuned = untuned_loader(dataset, BATCH_SIZE, rank, world_size, SEED, epoch)  # this epoch's order
            start_epoch(tuned, epoch)
            for name, loader in (("untuned", untuned), ("tuned", tuned)):
                dist.barrier()  # both ranks time the same loader at the same moment
                runs[name].append(read_epoch(loader))
            if rank == 0:
                print(f"epoch {epoch}: untuned {runs['untuned'][-1]['seconds']:.2f} s, "
                      f"yours {runs['tuned'][-1]['seconds']:.2f} s", flush=True)
        if rank == 0:
            u, t = (sum(ep["seconds"] for ep in runs[name][1:]) for name in ("untuned", "tuned"))
            print(f"epochs after the first: untuned {u:.2f} s, yours {t:.2f} s ({u / t:.2f}x as fast); grade it with "
                  "python -m ddp_course check 10 lessons/exercises/10_dataloader.py", flush=True)
        settings = {k: getattr(tuned, k, None) for k in ("num_workers", "persistent_workers", "prefetch_factor",
                                                        "pin_memory", "batch_size", "drop_last")}
        settings["sampler"] = type(tuned.sampler).__name__
        result = json.dumps({
            "rank": rank, "world_size": world_size, "pid": os.getpid(), "loader": settings, **runs,
            "config": {"n_samples": N_SAMPLES, "batch_size": BATCH_SIZE, "epochs": EPOCHS, "seed": SEED,
                       "read_s": READ_S, "open_s": OPEN_S}})
        sys.stdout.write(f"RESULT {result}\n")  # one write: lines of two ranks cannot interleave
        sys.stdout.flush()
        del tuned  # its workers (if any) stop here, before the process group is torn down
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
