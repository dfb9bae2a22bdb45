"""A dataset that reads like network storage: the input pipeline of exercise 10.

``SlowStorage`` stands in for samples fetched from a remote file system or an object store:

- every read of a sample waits ``read_s`` seconds for its answer;
- every process that reads opens its own connection first, which takes ``open_s`` seconds (a
  connection cannot be shared between processes, so each DataLoader worker opens one when it reads
  its first sample, and a worker started again opens again).

Both are sleeps, not computation: a waiting process holds no core, so reads waiting in several
worker processes overlap however busy the machine is. That keeps the exercise's measured speedups
large and steady on a loaded 2-core machine, where CPU-bound decoding (``bench_dataloader``) would
compete with the training processes for the cores.

Sample ``i`` is ``{"index": i, "x": sample(i), "reader": pid}``: its position in the dataset, a vector
that depends on ``i`` alone, and the id of the process that read it (which tells the exercise's
harness whether workers read it, and whether they were the same workers as in the last epoch).
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

DIM = 8  # length of every sample's vector


def sample(i: int, dim: int = DIM) -> torch.Tensor:
    """The vector of sample ``i``: pseudo-random, a function of ``i`` alone (any process, any order)."""
    g = torch.Generator().manual_seed(7919 * i + 1)
    return torch.randn(dim, generator=g)


def fingerprint(x: torch.Tensor) -> list[float]:
    """One number per sample of a batch ``x`` of shape (batch, dim): the vectors, weighted by position.

    Two batches hold the same samples in the same order exactly when their fingerprints agree (the
    weights make a permuted vector count as another).
    """
    weights = torch.arange(1, x.shape[-1] + 1, dtype=torch.float64)
    return (x.double() * weights).sum(-1).tolist()


class SlowStorage(Dataset):
    """``n`` samples, each read in ``read_s`` seconds after a per-process open of ``open_s`` seconds."""

    def __init__(self, n: int, read_s: float, open_s: float, dim: int = DIM):
        if n < 1 or read_s < 0 or open_s < 0:
            raise ValueError(f"SlowStorage needs n >= 1 and non-negative times (got n={n}, read_s={read_s}, "
                             f"open_s={open_s})")
        self.n, self.read_s, self.open_s, self.dim = n, read_s, open_s, dim
        self._connected_pid: int | None = None  # the process that opened the connection this object holds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of a dataset of {self.n}")
        pid = os.getpid()
        if self._connected_pid != pid:  # a new process (a forked worker inherits the parent's object)
            time.sleep(self.open_s)
            self._connected_pid = pid
        time.sleep(self.read_s)
        return {"index": i, "x": sample(i, self.dim), "reader": pid}


def untuned_loader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int,
                   epoch: int) -> DataLoader:
    """Exercise 10's baseline for one epoch: this rank's shard in that epoch's order (a shuffled
    ``DistributedSampler``), every sample read by the training process itself (no workers, so a new
    loader per epoch costs nothing)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=0)
