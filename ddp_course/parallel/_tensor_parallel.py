"""MiniGPT's attention split by heads, and the qkv row order every state dict is put back into: what
``--strategy=fsdp_tp``, ``--strategy=pipeline`` and the lessons' labs and exercises share (not a strategy:
its name starts with ``_``).

MiniGPT's attention has ONE fused linear layer, ``qkv``, whose 3C output rows are all of q, then all of
k, then all of v. A column-wise shard of it in that order would give rank 0 of 2 all of q and half of k.
So before parallelizing, its rows are reordered head-major per rank (:func:`rearrange_qkv`): rank r's
contiguous block becomes [q of its heads; k of its heads; v of its heads] -- the same weights in
another order. :class:`HeadParallelAttention` is the attention's computation on a rank's heads. Every
state dict that leaves a strategy puts the rows back in the model's own order (:func:`natural_rows`),
and every one that comes in is reordered again (:func:`tp_rows`), AdamW's moments with them
(:func:`optimizer_rows`), so that a checkpoint means the same weights whatever the mesh that wrote it.

Which module gets which parallel style (the plans) is not here: ``ddp_course.parallel._tp_plan`` holds
them, apart from what an exercise imports (lesson 13's exercise asks for the plan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from ddp_course.model import CausalSelfAttention

QKV = ("attn.qkv.weight", "attn.qkv.bias")  # the entries whose rows are reordered (suffixes of their names)


class _SequentialRedistribution(logging.Filter):
    """Drops DTensor's note that a redistribution over two mesh dimensions runs as two collectives."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in str(record.msg)


def quiet_sequential_redistribution() -> None:
    """On a 2-D mesh, DTensor logs a warning, on every rank, each time a tensor placed over both
    dimensions is made whole: the gradients' norm (``clip_grad_norm_``) and a state dict's full
    tensors, by two collectives, one per dimension (torch/distributed/tensor/_redistribute.py,
    "sequential ... operations will be performed"). The course asks for those on purpose, once per
    step and per checkpoint, and every rank runs the same two in the same order; the warning repeats
    at each, with a path of the machine's PyTorch. Other warnings of that logger still pass."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _SequentialRedistribution) for f in logger.filters):
        logger.addFilter(_SequentialRedistribution())


def hidden_block(n: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s block of ``n`` features in ``torch.chunk`` order: ``slice(r * n / N, (r + 1) * n / N)``."""
    if n % world_size:
        raise ValueError(f"{n} features do not split evenly over {world_size} ranks")
    size = n // world_size
    return slice(rank * size, (rank + 1) * size)


def qkv_order(n_embd: int, world_size: int) -> torch.Tensor:
    """The permutation of qkv's 3C output rows that makes rank r's contiguous block [q_r; k_r; v_r].

    Row ``i`` of the reordered weight is row ``qkv_order(...)[i]`` of the original one; q_r, k_r, v_r
    are rank r's block (``hidden_block``) of the rows of q (0 .. C-1), k (C .. 2C-1) and v (2C .. 3C-1).
    """
    parts = []
    for r in range(world_size):
        block = hidden_block(n_embd, r, world_size)
        parts += [torch.arange(which * n_embd + block.start, which * n_embd + block.stop) for which in range(3)]
    return torch.cat(parts)


def rearrange_qkv(attn: CausalSelfAttention, world_size: int) -> None:
    """Reorder ``attn.qkv``'s output rows (weight and bias) in place with ``qkv_order``."""
    order = qkv_order(attn.qkv.out_features // 3, world_size)
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[order])
        attn.qkv.bias.copy_(attn.qkv.bias[order])


class HeadParallelAttention(nn.Module):
    """``CausalSelfAttention``'s computation on this rank's heads: the same layers, n_head / N heads.

    ``qkv``'s (column-wise sharded) output holds this rank's q, k and v, C/N features each; the heads'
    outputs, C/N features, go into ``proj`` (row-wise sharded), which sums the ranks' partial outputs.
    The module keeps the attention's names (``qkv``, ``proj``), so parameter names do not change.
    """

    def __init__(self, attn: CausalSelfAttention, world_size: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.resid_drop = attn.qkv, attn.proj, attn.resid_drop
        self.n_head = attn.n_head // world_size  # the heads on this rank
        self.dropout = attn.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C/N): this rank's heads
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh/N, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C/N): this rank's heads, in order
        return self.resid_drop(self.proj(y))


def _reorder(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` with its rows in the order ``rows``: a plain tensor indexed; a DTensor gathered whole,
    indexed, and cut again into its own placements (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t[rows.to(t.device)]
    full = t.full_tensor()[rows.to(t.device)]
    return DTensor.from_local(full, t.device_mesh, [Replicate()] * t.device_mesh.ndim).redistribute(
        t.device_mesh, t.placements)


def natural_rows(state: dict[str, Any], n_embd: int, tp: int) -> dict[str, Any]:
    """``state`` (name -> tensor: a model state dict, or one parameter's optimizer state keyed by the
    parameter's name) with the qkv rows put back in the model's own order. A collective for DTensors."""
    return _reorder_qkv(state, torch.argsort(qkv_order(n_embd, tp)))


def tp_rows(state: dict[str, Any], n_embd: int, tp: int) -> dict[str, Any]:
    """The inverse of :func:`natural_rows`: the qkv rows in the tensor-parallel order of ``tp`` ranks."""
    return _reorder_qkv(state, qkv_order(n_embd, tp))


def optimizer_rows(optim_sd: dict[str, Any], convert: Callable[[dict[str, Any], int, int], dict[str, Any]],
                   n_embd: int, tp: int) -> dict[str, Any]:
    """``optim_sd`` with ``convert`` (:func:`natural_rows` or :func:`tp_rows`) applied to the AdamW moments
    of every qkv parameter, keyed by parameter name as DCP keys them: nested (``{"state": {name:
    {"exp_avg": ...}}}``) or flattened (``{"state.<name>.exp_avg": ...}``). The same order on every
    rank: reordering a DTensor is a collective."""
    if tp == 1:  # one tensor-parallel rank: the rows are in the model's own order already
        return optim_sd

    def rows(name: Any, t: Any) -> Any:
        if not (isinstance(name, str) and name.endswith(QKV) and isinstance(t, torch.Tensor) and t.dim() >= 1):
            return t
        return convert({name: t}, n_embd, tp)[name]

    if "state" in optim_sd:
        return {**optim_sd, "state": {name: {k: rows(name, t) for k, t in per.items()}
                                      for name, per in optim_sd["state"].items()}}
    return {key: rows(key.split(".", 1)[1].rsplit(".", 1)[0], t) if key.startswith("state.") else t
            for key, t in optim_sd.items()}


def _reorder_qkv(state: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    return {k: _reorder(v, rows) if k.endswith(QKV) and isinstance(v, torch.Tensor) and v.dim() >= 1 else v
            for k, v in state.items()}
