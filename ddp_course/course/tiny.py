"""Tiny models, batches and gradient references that several lessons' labs and graders share.

A seeded two-block MiniGPT over the course's 65-character vocabulary (``tiny_model``), a micro-batch
that any process can build for any rank (``micro_batch``), the big-batch gradient those micro-batches
should average to (``reference_gradient``), and a counter of DDP's bucket all-reduces
(``AllReduceCounter``). Lesson 06 introduced them; the labs, graders and exercises of lessons 03 to 14
(08 aside) use them too, so they live here, beside the other helpers several lessons share (``plots``,
``noise``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_course.dist import seeded
from ddp_course.model import GPTConfig, MiniGPT

VOCAB = 65  # the size of the course's character vocabulary; the tokens here are random ids


def tiny_model(seed: int = 0, *, block_size: int = 32, n_layer: int = 2, n_head: int = 2,
               n_embd: int = 64) -> MiniGPT:
    """A small MiniGPT, seeded: every process, and every thread, that calls this gets the same initial
    weights (``seeded``: threads grading side by side each get the seed's weights)."""
    with seeded(seed):
        return MiniGPT(GPTConfig(vocab_size=VOCAB, block_size=block_size, n_layer=n_layer, n_head=n_head,
                                 n_embd=n_embd))


def micro_batch(index: int, rank: int, *, micro_batch_size: int, block_size: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of ``rank``: (x, y) of shape (micro_batch_size, block_size).

    Any process can build any rank's micro-batch (a generator seeded by seed, index and rank), which
    is what lets every rank compute the big-batch reference on its own.
    """
    g = torch.Generator().manual_seed(1_000_003 * seed + 1_009 * index + rank)
    tokens = torch.randint(VOCAB, (micro_batch_size, block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_gradient(model: MiniGPT, indices: Sequence[int], world_size: int, *, micro_batch_size: int,
                       block_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss over one big batch: micro-batches ``indices`` of every rank.

    ``model`` is a plain (unwrapped) model; its gradients are left zeroed. Equal-sized micro-batches
    make the mean over the concatenation equal to the mean of the micro-batch means. The batch goes
    to the model's device.
    """
    parts = [micro_batch(i, r, micro_batch_size=micro_batch_size, block_size=block_size, seed=seed)
             for i in indices for r in range(world_size)]
    device = next(model.parameters()).device
    x = torch.cat([p[0] for p in parts]).to(device)
    y = torch.cat([p[1] for p in parts]).to(device)
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads



class AllReduceCounter:
    """Counts DDP's gradient all-reduces, and notes during which micro-step each one ran.

    ``AllReduceCounter(ddp)`` registers a communication hook on the DDP model -- DDP calls it once
    per gradient bucket whenever a backward all-reduces -- and a forward pre-hook on the wrapped
    module that numbers the forwards. The hook all-reduces exactly as DDP's default does
    (``default_hooks.allreduce_hook``: divide by the world size, all_reduce SUM). Register it before
    the first backward (DDP allows one communication hook per model).
    """

    def __init__(self, ddp: torch.nn.Module):
        self.calls = 0  # bucket all-reduces since the last reset()
        self.forwards = 0  # forwards since the last reset()
        self._during: list[int] = []  # forward number (0-based) at each bucket all-reduce
        ddp.register_comm_hook(self, AllReduceCounter._hook)
        ddp.module.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module, args) -> None:
        self.forwards += 1

    @staticmethod
    def _hook(state: AllReduceCounter, bucket):
        state.calls += 1
        state._during.append(state.forwards - 1)
        return default_hooks.allreduce_hook(None, bucket)

    def reset(self) -> None:
        self.calls, self.forwards, self._during = 0, 0, []

    @property
    def synced_micro_steps(self) -> list[int]:
        """The micro-steps (numbered from 0 since reset()) whose backward all-reduced."""
        return sorted(set(self._during))
