"""Expert parallelism by hand: the lesson's exchanges and gradient rule for ``experts_base``'s layer.

``experts_base`` holds the mixture of experts in one process (:class:`MoE`), the frame of its
expert-parallel version (``ExpertParallelLayer``: routing, capacity, the local experts) and the exchange
(:class:`AllToAll`); this module gives them under the same names and adds the lesson's own pieces:
:class:`ExpertParallelMoE` sends every token-slot to the rank of its expert with :func:`dispatch` (counts
first, then the rows, both with ``all_to_all_single``) and gets the results back with :func:`combine` (the
reverse ``all_to_all_single``); :func:`expert_parallel` makes the expert-parallel copy of a one-process
model (each rank keeps only its experts, under the same names), and :func:`sync_gradients` is the one
gradient rule of expert parallelism: replicated parameters averaged over ranks, expert parameters divided
by the world size and never all-reduced.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.course.l14_sequences_and_experts.experts_base import (  # noqa: F401  (the lesson's names for them)
    AllToAll,
    Exchange,
    ExpertParallelLayer,
    MoE,
    Routing,
    aux_loss,
    capacity,
    dropped_slots,
    exchange,
    expert_parameters,
    inverse,
    kept_slots,
    moe_gpt,
    moe_layers,
    moe_loss,
    relative_error,
    route,
)
from ddp_course.model import MiniGPT


def dispatch(slots: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup | None = None,
             ledger: dict[str, int] | None = None) -> tuple[torch.Tensor, Exchange]:
    """Send this rank's token-slots to the ranks of their experts.

    In: ``slots`` (S, C) this rank's token-slots sorted by expert (stably: within an expert in slot order);
    ``counts`` (E,) how many of them go to each expert. Rank q holds experts ``q E/p .. (q+1) E/p - 1``, so
    sorting by expert also sorts by destination rank.
    Out: ``grouped`` (M, C) the rows this rank's experts must process, grouped by local expert and, inside
    a group, by source rank (rank 0's rows first), each source's rows in its own order -- the global
    priority order -- and the :class:`Exchange` that :func:`combine` reverses.

    1. The counts first: each rank must size its receive buffer, and ``all_to_all_single`` with uneven
       splits needs both sides' splits. An ``all_to_all_single`` of the (E,) counts, E/p to each rank, gives
       every rank the (p, E/p) matrix of the rows coming to each of its experts from each rank.
    2. The rows, with :class:`AllToAll` (its backward sends the gradients back).
    3. Regroup: they arrive ordered (source rank, local expert); the experts want (local expert, source rank).
    """
    p = dist.get_world_size(group)
    local_experts = counts.numel() // p
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    from_rank = incoming.view(p, local_experts)
    send_splits = counts.view(p, local_experts).sum(1).tolist()
    recv_splits = from_rank.sum(1).tolist()
    arrivals = AllToAll.apply(slots, send_splits, recv_splits, group, ledger, "dispatch")
    which = torch.arange(local_experts, device=slots.device).repeat(p).repeat_interleave(from_rank.reshape(-1))
    regroup = torch.sort(which, stable=True).indices
    return arrivals[regroup], Exchange(send_splits, recv_splits, from_rank, regroup)


def combine(outputs: torch.Tensor, ex: Exchange, order: torch.Tensor, gate: torch.Tensor,
            group: dist.ProcessGroup | None = None, ledger: dict[str, int] | None = None) -> torch.Tensor:
    """Bring the experts' outputs home and mix them: the reverse of :func:`dispatch`.

    In: ``outputs`` (M, C) the experts' outputs in :func:`dispatch`'s grouped order (zero rows for dropped
    slots), ``ex`` its :class:`Exchange`, ``order`` (S,) the sort that put this rank's slots in expert
    order (``slots = h_slots[order]``), ``gate`` (N, k) this rank's gates (S = N k).
    Out: (N, C), for each token the gate-weighted sum of its k experts' outputs.

    1. Undo the regroup: back to (source rank, local expert) order.
    2. The reverse exchange: the splits swapped, each row goes back to the rank it came from.
    3. Un-sort: the rows are in expert order; ``inverse(order)`` puts them back in slot order.
    4. Gate, and sum each token's k slots.
    """
    arrivals = outputs[inverse(ex.regroup)]
    mine = AllToAll.apply(arrivals, ex.recv_splits, ex.send_splits, group, ledger, "combine")
    n_tokens, k = gate.shape
    slots = mine[inverse(order)].view(n_tokens, k, -1)
    return (slots * gate.unsqueeze(-1)).sum(1)


class ExpertParallelMoE(ExpertParallelLayer):
    """``ExpertParallelLayer`` with the lesson's exchanges: :func:`dispatch` out, :func:`combine` back,
    each recording its bytes in ``ledger``."""

    def send_out(self, slots: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, Exchange]:
        return dispatch(slots, counts, self.group, self.ledger)

    def bring_back(self, outputs: torch.Tensor, ex: Exchange, order: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return combine(outputs, ex, order, gate, self.group, self.ledger)


def expert_parallel(model: MiniGPT, group: dist.ProcessGroup | None = None) -> MiniGPT:
    """A copy of the one-process ``model`` with each :class:`MoE` made an :class:`ExpertParallelMoE`:
    the same weights, this rank keeping only its experts. Its ``state_dict`` is the one-process state dict
    less the other ranks' experts, under the same names."""
    ep = copy.deepcopy(model)
    for block in ep.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, group)
    return ep


def sync_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """After each rank's ``backward`` of its own loss (the mean over its tokens), make every gradient one
    process's gradient of the global-mean loss ``L = (1/p) sum_r L_r``.

    - Replicated parameters (embeddings, attention, norms, routers): rank r's copy holds dL_r/dw, so
      all-reduce (sum) and divide by p -- what DDP does (here in one flat all-reduce).
    - Expert parameters live on one rank, and the all-to-all's backward has already brought them the
      gradient of every rank's tokens: they hold ``sum_r dL_r/dw = p dL/dw``. Divide by p, nothing else.
      All-reducing them is the classic mistake: rank 0's expert 0 would be summed with rank 1's expert 2,
      another parameter. Forgetting the 1/p leaves them p times too large -- which AdamW nearly hides (it
      divides by the gradient's own scale), SGD or gradient clipping would not.
    """
    p = dist.get_world_size(group)
    local = expert_parameters(model)
    shared = [w for w in model.parameters() if id(w) not in local]
    flat = torch.cat([(w.grad if w.grad is not None else torch.zeros_like(w)).reshape(-1) for w in shared])
    dist.all_reduce(flat, group=group)
    flat /= p
    offset = 0
    for w in shared:
        w.grad = flat[offset:offset + w.numel()].view_as(w).clone()
        offset += w.numel()
    for w in model.parameters():
        if id(w) in local and w.grad is not None:
            w.grad /= p
