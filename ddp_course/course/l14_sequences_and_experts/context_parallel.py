"""MiniGPT with its sequence split over the ranks (context parallelism), attention by the ring.

Every rank holds the whole model and the same batch of sequences, but only its chunks of each sequence
(``ring.layout``): the token and position embeddings, the LayerNorms, the MLPs and the head work
token by token, so they need nothing from the other ranks; only attention does, and
:class:`RingSelfAttention` gives it the ring. The loss of a rank is the *sum* of its tokens'
cross-entropies divided by the number of tokens in the whole batch, so that the ranks' losses add up
to one process's mean loss, and so do their gradients: :func:`sum_gradients` all-reduces them with SUM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_course.course.l14_sequences_and_experts.ring import Ring, positions, ring_attention, shard
from ddp_course.model import CausalSelfAttention, MiniGPT


@contextlib.contextmanager
def sdpa_put_back() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as it was when the block began, put back when it ends,
    whatever was raised inside: for trying PyTorch's own ``context_parallel`` in a notebook's kernel.

    ``context_parallel`` puts its ring wrapper in place of ``F.scaled_dot_product_attention`` while its
    block runs. In PyTorch 2.10 it takes the wrapper away after the ``yield`` with no ``finally``
    (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, ``context_parallel``:
    ``_enable_context_parallel_dispatcher_impl(...)``, ``yield``, ``_disable_context_parallel_dispatcher_impl()``),
    so when the attention inside raises, as it does on a CPU, the wrapper stays for the rest of the
    process and every later attention fails, MiniGPT's and the graders' included. PyTorch 2.13 takes it
    away in a ``finally``. Held by tests/lessons/test_ring_attention.py, which the course's floor run
    (PyTorch 2.10) fails without this.
    """
    original = F.scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class RingSelfAttention(nn.Module):
    """MiniGPT's attention (its own ``qkv`` and ``proj``) with the ring in place of
    ``scaled_dot_product_attention``: the same weights, this rank's tokens only."""

    def __init__(self, attn: CausalSelfAttention, ring: Ring) -> None:
        super().__init__()
        self.n_head, self.qkv, self.proj, self.resid_drop = attn.n_head, attn.qkv, attn.proj, attn.resid_drop
        self.ring = ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # T: this rank's tokens
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.ring)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


def context_parallel(model: MiniGPT, ring: Ring) -> MiniGPT:
    """Give every block the ring's attention (in place; the parameters are the model's own)."""
    for block in model.blocks:
        block.attn = RingSelfAttention(block.attn, ring)
    return model


def local_loss(model: MiniGPT, x: torch.Tensor, y: torch.Tensor, ring: Ring) -> torch.Tensor:
    """This rank's share of the batch's mean loss: x, y are the whole (B, T) batch; the rank keeps its
    chunks, embeds them at their global positions and sums their cross-entropies over B * T."""
    B, T = x.shape
    xs, ys = shard(x, ring.kind, ring.size, ring.rank, dim=1), shard(y, ring.kind, ring.size, ring.rank, dim=1)
    pos = positions(ring.kind, ring.size, ring.rank, T)
    h = model.drop(model.tok_emb(xs) + model.pos_emb(pos))
    for block in model.blocks:
        h = block(h)
    logits = model.head(model.ln_f(h))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ys.reshape(-1), reduction="sum") / (B * T)


def sum_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Every parameter's gradient summed over the ranks (each rank's holds its tokens' share), in one
    all-reduce of all of them laid end to end."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
