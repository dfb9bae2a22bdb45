"""What exercise 06 (``exercises/06_no_sync.py``) measures its answer with, and what the lab shares with it.

The tiny seeded MiniGPT, each rank's micro-batches, the gradient of one big batch on a plain model,
the counter of DDP's all-reduces (a communication hook, from :mod:`ddp_course.course.tiny`), and the
comparisons of an accumulated gradient with that reference. The exercise imports this module and not
the lab (:mod:`ddp_course.course.l06_grad_accumulation.no_sync_lab`), whose ``accumulate`` holds the
course's own accumulation loops, the correct one among them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_course.course.tiny import AllReduceCounter, micro_batch, reference_gradient, tiny_model

__all__ = ["AllReduceCounter", "compare", "flat_grad", "micro_batch", "reference_gradient", "replica_spread",
           "tiny_model"]


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient in one float64 vector (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
                      for p in model.parameters()])


def compare(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """This rank's gradient against the reference: relative error and norm ratio."""
    g = flat_grad(model)
    r = torch.cat([ref[n].reshape(-1).double() for n, _ in model.named_parameters()])
    return {"rel_err": ((g - r).norm() / r.norm()).item(), "norm_ratio": (g.norm() / r.norm()).item()}


def replica_spread(model: torch.nn.Module) -> float:
    """Largest element-wise gradient difference between any rank and rank 0 (every rank must call it).

    Uses broadcast and all_reduce directly, not DDP, so the communication hook does not see them.
    """
    g = flat_grad(model)
    g0 = g.clone()
    dist.broadcast(g0, src=0)
    diff = (g - g0).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()
