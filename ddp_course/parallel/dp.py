"""nn.DataParallel: ONE process drives every visible GPU (lesson 03).

Each forward, DataParallel scatters the batch over the GPUs, replicates the module onto each of them
(a broadcast of every weight from GPU 0), runs the replicas in Python threads, and gathers their
outputs on GPU 0. Backward flows back through the gather and the broadcast, whose backward is a
reduce-add: the gradients land summed in the one real model on GPU 0, where the optimizer steps.

A run is one process, so it is launched without torchrun::

    python -m ddp_course.train --strategy=dp --device=cuda

It needs at least two CUDA GPUs: without CUDA, ``nn.DataParallel`` simply calls the module (no
scatter, no replicas: ``if not self.device_ids: return self.module(*inputs, **kwargs)`` in
``torch/nn/parallel/data_parallel.py``, ``DataParallel.forward``), and with one GPU it does the same on
that GPU, so this strategy refuses rather than pretend. Lesson 03 shows the mechanism step by step on CPU tensors (``ddp_course.course.l03_data_parallel.dp_mechanism``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_course.config import TrainConfig
from ddp_course.dist import DeviceError, DistInfo

NEEDS_PROCESS_GROUP = False  # one process drives every GPU
HELP_ORDER = 1  # its place in --help's list of strategies

HELPERS = ("lm_loss", "cuda_gpus", "refusal")  # public, not hooks: lesson 03 uses lm_loss

LESSON = "lessons/03_data_parallel.ipynb"


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions: the same expression as MiniGPT.forward."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.reshape(B * T, V).float(), targets.reshape(B * T))


class DataParallelLM(nn.DataParallel):
    """nn.DataParallel for a language model called as ``model(idx, targets)``.

    The replicas compute logits only; the logits are gathered on GPU 0 and the loss is computed there,
    over the whole batch. Passing the targets to the replicas instead would return one scalar loss
    per GPU, which DataParallel gathers into a vector of length n_gpus: its ``.mean()`` equals the
    loss of the whole batch only when every GPU got the same number of sequences (``torch.chunk``
    gives the last GPU fewer when the batch does not divide). Computing the loss after the gather is
    exact for any batch, and it is the classic DP pattern -- with its cost: GPU 0 holds the logits
    of the entire batch.
    """

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(idx)  # scatter, replicate, parallel forward, gather on device_ids[0]
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets.to(logits.device))


def cuda_gpus() -> int:
    """How many CUDA GPUs PyTorch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def refusal(n_gpus: int) -> str:
    """The one-paragraph reason ``--strategy=dp`` cannot run on a machine with ``n_gpus`` CUDA GPUs."""
    what = ("PyTorch sees no CUDA GPU here" if n_gpus == 0 else
            "PyTorch sees one CUDA GPU here")
    return (f"--strategy=dp needs at least 2 CUDA GPUs, and {what}. nn.DataParallel does nothing without "
            "CUDA devices (or another accelerator it supports: XPU, MTIA or a custom backend, not Apple's MPS): "
            "on a machine without one it keeps device_ids empty and simply calls the wrapped "
            "module -- no scatter, no replicas, no gradient reduction -- and with a single GPU it does the "
            "same on that GPU. Rather than pretend to run data parallelism, the course stops here. The "
            f"lesson's CPU walk-through ({LESSON}, functions in ddp_course.course.l03_data_parallel.dp_mechanism) shows every step of "
            "the mechanism by hand on CPU tensors; to train with several processes on this machine, use "
            "--strategy=ddp with torchrun (lesson 04).")


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """DataParallelLM over every GPU, the run's device first; refuses without 2 GPUs (a job of several
    processes is refused before: ``Strategy.refusal``)."""
    n = cuda_gpus()
    if n < 2:
        raise DeviceError(refusal(n))
    if info.device.type != "cuda":
        raise DeviceError(f"--strategy=dp runs on the GPUs, but this run's device is {info.device} "
                          "(--device=cpu?). Use --device=auto or --device=cuda.")
    # DataParallel keeps the real model on device_ids[0] (where it already is) and replicates from
    # there every forward; the outputs are gathered there too.
    first = info.device.index or 0
    return DataParallelLM(model, device_ids=[first, *(i for i in range(n) if i != first)])


def unwrap(model: DataParallelLM) -> nn.Module:
    """The module DataParallel replicates."""
    return model.module


def devices_per_rank(model: DataParallelLM) -> int:
    """Every GPU the one process drives does arithmetic (for MFU)."""
    return len(model.device_ids)
