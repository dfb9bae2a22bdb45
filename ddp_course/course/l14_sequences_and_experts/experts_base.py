"""A mixture of experts in one process, and what its expert-parallel version is built from.

:class:`MoE` replaces MiniGPT's ``Block.mlp``: ``n_experts`` MLPs of the model's own shape
(``ddp_course.model.MLP``), a router ``Linear(C, n_experts)`` that picks ``top_k`` of them per token, and a
capacity per expert beyond which tokens are dropped. :class:`ExpertParallelLayer` is the frame of the same
layer with the experts spread over the ranks: each rank routes its own tokens (data parallel), sends every
token-slot to the rank of its expert, runs its own experts under the global capacity, and brings the results
back -- the two exchanges are a subclass's (``experts.ExpertParallelMoE`` has the lesson's; exercise 14
gives the learner's). :func:`exchange` is one ``all_to_all_single`` of rows with uneven splits, and
:class:`AllToAll` the same as an autograd function whose backward is the reverse exchange, written by hand.

The decisions both versions share, so that the expert-parallel one drops exactly the tokens one
process drops:

- **gates**: top-1 keeps the chosen softmax probability (Switch Transformer: the router learns through
  it); top-2 renormalises the two chosen probabilities to sum 1 (Mixtral), so a token's output is a
  weighted mean of its two experts;
- **priority** for the capacity: *slot order* in the global batch -- the ranks' batches concatenated in
  rank order, then by position, and for top-2 a token's first choice before its second. GShard and
  Switch put every first choice before any second choice; slot order is what makes the expert-parallel
  version simple: the rows an expert's rank receives, grouped by source rank in rank order, are already in
  priority order, so the receiver applies the capacity with no further exchange;
- **capacity** :func:`capacity` per expert, ``ceil(capacity_factor * n_tokens * top_k / n_experts)``
  over the whole global batch; a dropped slot's expert output is zero and the residual connection
  carries the token on (for top-2 its other slot may still be served);
- **auxiliary loss** :func:`aux_loss`, Switch Transformer's ``n_experts * sum_e f_e * P_e``.

:func:`moe_gpt` builds the seeded model, :func:`moe_loss` its loss, and :func:`expert_parameters` tells the
parameters that live on one rank only from the replicated ones.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_course.course.tiny import VOCAB
from ddp_course.dist import seeded
from ddp_course.model import MLP, GPTConfig, MiniGPT

# --- what both versions share ------------------------------------------------------------------------------


def capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Slots one expert serves per step: ``ceil(factor * n_tokens * top_k / n_experts)``, ``n_tokens`` the
    tokens of the whole global batch. Computed with fractions (``0.75`` read as ``3/4``, from its decimal
    form), so that the result is the formula's exact value: in floats ``1.1 * 100 * 2 / 4`` is
    ``55.00000000000001``, whose ceiling is 56, not 55."""
    return math.ceil(Fraction(str(factor)) * n_tokens * top_k / n_experts)


@dataclass
class Routing:
    """The router's decision for N tokens: ``probs`` (N, E) its softmax, ``expert`` (N, k) the chosen
    experts, best first, and ``gate`` (N, k) the weights of their outputs (``probs`` and ``gate`` carry
    gradient to the router; ``expert`` is a choice, it carries none)."""

    probs: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor


def route(router: nn.Linear, h: torch.Tensor, top_k: int) -> Routing:
    """Top-k of the router's softmax for the tokens ``h`` (N, C). Top-1's gate is the chosen probability
    (renormalised it would be 1 and the router would learn nothing from the main loss); top-2's two gates
    are the chosen probabilities divided by their sum."""
    probs = F.softmax(router(h), dim=-1)
    top, expert = probs.topk(top_k, dim=-1)
    gate = top if top_k == 1 else top / top.sum(dim=-1, keepdim=True)
    return Routing(probs, expert, gate)


def kept_slots(expert: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """(S,) bool for the token-slots ``expert`` (S,) in priority order: a slot is kept when fewer than
    ``cap`` earlier slots chose the same expert (its place in its expert's queue is below the capacity)."""
    onehot = F.one_hot(expert, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(1) - 1
    return place < cap


def aux_loss(probs: torch.Tensor, slots_per_expert: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E * sum_e f_e * P_e``: ``f_e`` the fraction of token-slots
    routed to expert e (``slots_per_expert`` / its sum: counts, no gradient), ``P_e`` the mean router
    probability of e over the tokens of ``probs`` (N, E), which carries the gradient. 1 when the load and the
    probabilities are uniform, up to E when one expert takes everything: the gradient lowers the
    probability of the experts that are already busy."""
    f = slots_per_expert.to(probs.dtype) / slots_per_expert.sum()
    return probs.shape[1] * (f * probs.mean(0)).sum()


def dropped_slots(slots_per_expert: torch.Tensor, cap: int) -> int:
    """Slots beyond the capacity, summed over the experts: what any version of the layer must drop."""
    return int((slots_per_expert - cap).clamp(min=0).sum())


class MoE(nn.Module):
    """A mixture-of-experts MLP in one process: the reference for its expert-parallel version.

    After each forward it holds ``aux_loss`` (the tensor, with gradient), ``tokens_per_expert`` (E,) the
    slots routed to each expert before the capacity, ``capacity`` and ``dropped`` (slots over it)."""

    def __init__(self, cfg: GPTConfig, n_experts: int, top_k: int = 2, capacity_factor: float = 1.25) -> None:
        super().__init__()
        if top_k not in (1, 2) or top_k > n_experts:
            raise ValueError(f"top_k must be 1 or 2 and at most n_experts={n_experts} (got {top_k})")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(cfg.n_embd, n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(n_experts))
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert = torch.zeros(n_experts, dtype=torch.long)
        self.capacity, self.dropped = 0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(B * T, C)
        r = route(self.router, h, self.top_k)
        expert = r.expert.reshape(-1)  # (N k,) slot order: token by token, first choice first
        token = torch.arange(B * T, device=h.device).repeat_interleave(self.top_k)
        gate = r.gate.reshape(-1)
        counts = torch.bincount(expert, minlength=self.n_experts)
        cap = capacity(B * T, self.top_k, self.n_experts, self.capacity_factor)
        kept = kept_slots(expert, self.n_experts, cap)
        out = torch.zeros_like(h)
        for e, mlp in enumerate(self.experts):
            slots = ((expert == e) & kept).nonzero().squeeze(1)
            if slots.numel():  # an expert with no token is not called (its gradient stays None)
                out = out.index_add(0, token[slots], mlp(h[token[slots]]) * gate[slots, None])
        self.aux_loss = aux_loss(r.probs, counts)
        self.tokens_per_expert, self.capacity, self.dropped = counts.detach(), cap, dropped_slots(counts, cap)
        return out.view(B, T, C)


# --- the exchange --------------------------------------------------------------------------------------------


def exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None,
             ledger: dict[str, int] | None, phase: str) -> torch.Tensor:
    """``rows`` split by ``send_splits`` (rows to each rank, in rank order) -> the rows every rank sent
    here, by ``recv_splits``, in source-rank order: one ``all_to_all_single``. Adds to ``ledger[phase]``
    the bytes this rank handed to the collective, and to ``ledger[phase + ".others"]`` those bound for
    other ranks (its own split is a local copy)."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    if ledger is not None:
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        own = send_splits[dist.get_rank(group)]
        ledger[phase] = ledger.get(phase, 0) + sum(send_splits) * row_bytes
        ledger[phase + ".others"] = ledger.get(phase + ".others", 0) + (sum(send_splits) - own) * row_bytes
    return out


class AllToAll(torch.autograd.Function):
    """:func:`exchange` with a gradient. Forward: row i of this rank goes to some rank q. Backward: the
    gradient of that row is on q, so q sends it back -- the same exchange with the splits swapped (what
    was received is sent, what was sent is received). Nothing else is needed: the exchange only moves
    rows, its Jacobian is a permutation across ranks, and a permutation's transpose is its inverse."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: dist.ProcessGroup | None, ledger: dict[str, int] | None, phase: str) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.ledger, ctx.phase = (
            send_splits, recv_splits, group, ledger, phase)
        return exchange(rows, send_splits, recv_splits, group, ledger, phase)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group, ctx.ledger, ctx.phase + ".backward")
        return back, None, None, None, None, None


@dataclass
class Exchange:
    """What the exchange back needs to send the experts' outputs to where the exchange out took them from.

    ``send_splits[q]``: rows this rank sent to rank q; ``recv_splits[s]``: rows it received from rank s;
    ``from_rank`` (p, E/p): rows received from rank s for local expert j; ``regroup`` (M,): the arrivals in
    the experts' order are ``arrivals[regroup]``."""

    send_splits: list[int]
    recv_splits: list[int]
    from_rank: torch.Tensor
    regroup: torch.Tensor

    @property
    def per_expert(self) -> list[int]:
        """Rows received for each local expert, all source ranks together (before the capacity)."""
        return self.from_rank.sum(0).tolist()


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``perm``: ``t[perm][inverse(perm)] == t``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


# --- the expert-parallel layer's frame -------------------------------------------------------------------------


class ExpertParallelLayer(nn.Module):
    """:class:`MoE` with its experts spread over the ranks of ``group``: rank r keeps experts
    ``r E/p .. (r+1) E/p - 1`` (under their global numbers: ``experts.<e>.fc.weight`` as in one process)
    and a copy of the router; each rank brings its own tokens. The two exchanges are a subclass's:
    :meth:`send_out` (this rank's token-slots, sorted by expert, and their counts per expert -> the rows
    this rank's experts must process, grouped by local expert, and an :class:`Exchange`) and
    :meth:`bring_back` (the experts' outputs -> this rank's tokens' outputs).

    After each forward it holds ``aux_loss`` (this rank's term: see :meth:`forward`),
    ``tokens_per_expert`` (E,) the global slots per expert before the capacity (all-reduced counts),
    ``local_tokens_per_expert`` (E,) this rank's router's, ``received`` the rows each local expert received,
    ``capacity``, ``dropped_here`` the slots this rank's experts dropped (measured where they are dropped),
    ``dropped`` the global count the counts imply, and ``ledger``: the bytes each exchange handed to
    ``all_to_all_single``, accumulated until the caller clears it."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        p, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_experts % p:
            raise ValueError(f"{moe.n_experts} experts cannot be split evenly over {p} ranks")
        self.group, self.n_experts, self.top_k = group, moe.n_experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.first = rank * (moe.n_experts // p)
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleDict({str(e): copy.deepcopy(moe.experts[e])
                                      for e in range(self.first, self.first + moe.n_experts // p)})
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert = self.local_tokens_per_expert = torch.zeros(moe.n_experts, dtype=torch.long)
        self.received: list[int] = []
        self.capacity, self.dropped, self.dropped_here = 0, 0, 0
        self.ledger: dict[str, int] = {}

    def send_out(self, slots: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, Exchange]:
        raise NotImplementedError("the exchange out is a subclass's")

    def bring_back(self, outputs: torch.Tensor, ex: Exchange, order: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the exchange back is a subclass's")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route here, send out, run the local experts under the global capacity, bring back.

        The auxiliary loss: one process computes ``E sum_e f_e P_e`` over the global batch. Here ``f_e``
        is global too (this rank's counts all-reduced: they are counts, no gradient), and ``P_e`` is this
        rank's mean router probability. Every rank has the same number of tokens, so the mean over ranks
        of the ``P_e`` is the global ``P_e``, and, ``f_e`` being common, the mean over ranks of these local
        terms is the global loss."""
        B, T, C = x.shape
        h = x.reshape(B * T, C)
        r = route(self.router, h, self.top_k)
        expert = r.expert.reshape(-1)
        order = torch.sort(expert, stable=True).indices  # slots by expert, slot order inside an expert
        counts = torch.bincount(expert, minlength=self.n_experts)
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        cap = capacity(int(total.sum()) // self.top_k, self.top_k, self.n_experts, self.capacity_factor)
        grouped, ex = self.send_out(h[order // self.top_k], counts)
        per_expert = [int(n) for n in ex.per_expert]
        outputs = self.run_experts(grouped, per_expert, cap)
        out = self.bring_back(outputs, ex, order, r.gate)
        self.aux_loss = aux_loss(r.probs, total)
        self.tokens_per_expert, self.local_tokens_per_expert, self.received = total, counts, per_expert
        self.capacity, self.dropped = cap, dropped_slots(total, cap)
        self.dropped_here = sum(max(0, n - cap) for n in per_expert)
        return out.view(B, T, C)

    def run_experts(self, grouped: torch.Tensor, per_expert: list[int], cap: int) -> torch.Tensor:
        """Each local expert on the first ``cap`` rows of its group (the global priority order); the rows
        beyond are dropped: zero outputs, which still travel back (the sender expects one row per slot).

        The zeros are ``rows * 0``, not fresh zeros: the output must stay a function of ``grouped`` even
        when every row is dropped or none arrived, or autograd would leave this rank's part of the backward
        exchanges out of the graph -- and the other ranks would wait in those all-to-alls forever (a router
        that sends nothing to a rank's experts is enough; the lab's training runs reach such steps, and
        ``tests/lessons/test_experts.py`` runs them)."""
        pieces, start = [grouped[:0] * 0], 0
        for n, mlp in zip(per_expert, self.experts.values()):
            kept = min(n, cap)
            if kept:
                pieces.append(mlp(grouped[start:start + kept]))
            if n > kept:
                pieces.append(grouped[start + kept:start + n] * 0)
            start += n
        return torch.cat(pieces)


# --- the model and its loss -----------------------------------------------------------------------------------


# --- the model, its loss and its gradient rule ---------------------------------------------------------------


def relative_error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """|a - b| / |b| in float64; a missing gradient counts as zeros (0 when both are missing)."""
    if a is None and b is None:
        return 0.0
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    den = b.double().norm()
    return float((a.double() - b.double()).norm() / den) if den > 0 else float(a.double().norm())


def moe_layers(model: nn.Module) -> list[MoE | ExpertParallelLayer]:
    """The model's mixture-of-experts layers, block by block."""
    return [m for m in model.modules() if isinstance(m, (MoE, ExpertParallelLayer))]


def moe_gpt(*, n_experts: int = 4, top_k: int = 2, capacity_factor: float = 1.25, seed: int = 0,
            block_size: int = 32, n_layer: int = 2, n_head: int = 2, n_embd: int = 32,
            vocab_size: int = VOCAB) -> MiniGPT:
    """A seeded MiniGPT whose blocks' ``mlp`` is a :class:`MoE`, initialised as MiniGPT initialises its MLP
    (normal 0.02, zero biases, the residual projections scaled by 1/sqrt(2L)); the router too (normal
    0.02: near-uniform routing at the start)."""
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    with seeded(seed):
        model = MiniGPT(cfg)
        for block in model.blocks:
            block.mlp = MoE(cfg, n_experts, top_k, capacity_factor)
            block.mlp.apply(MiniGPT._init_weights)
            for name, p in block.mlp.named_parameters():
                if name.endswith("proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
    return model


def moe_loss(model: MiniGPT, x: torch.Tensor, y: torch.Tensor, aux_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, cross_entropy)``: the mean cross-entropy over the tokens of (x, y) plus ``aux_coef`` times
    the sum of the blocks' auxiliary losses. The cross-entropy is taken in the logits' dtype (MiniGPT's own
    loss casts to float32, which would hide a float64 comparison)."""
    logits = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    aux = torch.stack([m.aux_loss for m in moe_layers(model)]).sum()
    return ce + aux_coef * aux, ce


def expert_parameters(model: nn.Module) -> set[int]:
    """``id`` of each parameter that lives on one rank only (the experts of an :class:`ExpertParallelLayer`)."""
    return {id(p) for m in model.modules() if isinstance(m, ExpertParallelLayer) for p in m.experts.parameters()}
