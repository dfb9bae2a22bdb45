"""What exercise 14's expert dispatch measures of a learner's ``dispatch``, ``combine`` and ``sync_gradients``,
against one process.

:func:`run_side_by_side` builds the seeded mixture-of-experts MiniGPT of ``experts.moe_gpt`` in float64, a
copy whose layers are :class:`ExerciseMoE` (``experts.ExpertParallelMoE`` with the learner's exchanges in
place of the lesson's), runs one forward and backward of this rank's share of a global batch through it,
calls the learner's gradient sync, and compares with one process on the whole batch: the loss, the
gradient of every parameter this rank holds, the rows each local expert received and whether they are
the rows the routers sent it in priority order, and the slots dropped. :func:`report` prints one line per
rank. The grader (``grader_experts``) reads the same numbers from the ``RESULT`` line.

Float64, not float32: the expert-parallel layer adds the same numbers as one process in other groupings,
which float32 rounds to ~1e-7 relative (the lab's float32 parity) and float64 to ~1e-15, so that any row
sent to a wrong expert or brought back to a wrong token stands out by many orders of magnitude.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.course.l14_sequences_and_experts import experts
from ddp_course.course.tiny import VOCAB
from ddp_course.dist import log
from ddp_course.model import MiniGPT

# float64: one process and the ranks differ by rounding, ~1e-15 relative (the lab's float64 parity stays
# under 1e-12); a row processed by another expert, or brought home to another token, moves the loss by
# ~1e-6 and the gradients by far more
LOSS_RTOL, GRAD_RTOL, ROWS_RTOL = 1e-10, 1e-10, 1e-10


def build(shape: dict[str, int], n_experts: int, top_k: int, capacity_factor: float, seed: int) -> MiniGPT:
    """The exercise's one-process model: ``experts.moe_gpt`` (seeded: the same in every process and
    thread), in float64."""
    return experts.moe_gpt(n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor, seed=seed,
                           vocab_size=VOCAB, **shape).double()


def global_batch(block_size: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (x, y) of random tokens, the same in every process (its own seeded generator)."""
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(VOCAB, (batch_size, block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class ExerciseMoE(experts.ExpertParallelMoE):
    """The lesson's expert-parallel layer with the exchanges given: ``dispatch(slots, counts, group)`` returns
    ``(grouped, Exchange)`` and ``combine(outputs, ex, order, gate, group)`` the tokens' outputs; routing,
    capacity and the experts are the lesson's. After each forward it holds, besides the parent's records,
    ``grouped`` (the rows the local experts received, detached)."""

    def __init__(self, moe: experts.MoE, dispatch: Callable, combine: Callable,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(moe, group)
        self._dispatch, self._combine = dispatch, combine
        self.grouped = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(B * T, C)
        r = experts.route(self.router, h, self.top_k)
        expert = r.expert.reshape(-1)
        order = torch.sort(expert, stable=True).indices  # slots by expert, slot order inside an expert
        counts = torch.bincount(expert, minlength=self.n_experts)
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        cap = experts.capacity(int(total.sum()) // self.top_k, self.top_k, self.n_experts, self.capacity_factor)
        got = self._dispatch(h[order // self.top_k], counts, self.group)
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], experts.Exchange)):
            raise TypeError(f"dispatch must return (grouped, Exchange), not {type(got).__name__}")
        grouped, ex = got
        per_expert = [int(n) for n in ex.per_expert]
        if grouped.shape[0] != sum(per_expert):
            raise ValueError(f"dispatch returned {grouped.shape[0]} rows, but its Exchange's from_rank counts "
                             f"{sum(per_expert)} ({per_expert} for the local experts): they must agree")
        outputs = self.run_experts(grouped, per_expert, cap)
        out = self._combine(outputs, ex, order, r.gate, self.group)
        self.aux_loss = experts.aux_loss(r.probs, total)
        self.tokens_per_expert, self.local_tokens_per_expert, self.received = total, counts, per_expert
        self.capacity, self.dropped = cap, experts.dropped_slots(total, cap)
        self.dropped_here = sum(max(0, n - cap) for n in per_expert)
        self.grouped = grouped.detach()
        return out.view(B, T, C)


def exercise_model(model: MiniGPT, dispatch: Callable, combine: Callable) -> MiniGPT:
    """A copy of the one-process ``model`` whose mixtures of experts are :class:`ExerciseMoE`: this rank
    keeps its experts only, under the same names."""
    ep = copy.deepcopy(model)
    for block in ep.blocks:
        block.mlp = ExerciseMoE(block.mlp, dispatch, combine)
    return ep


def expected_rows(h: torch.Tensor, router: nn.Linear, top_k: int, local: range) -> torch.Tensor:
    """The rows the experts ``local`` must receive from the whole batch ``h`` (N, C), grouped by expert,
    each group in global priority (slot) order: what one process hands each of them."""
    expert = experts.route(router, h, top_k).expert.reshape(-1)
    token = torch.arange(h.shape[0]).repeat_interleave(top_k)
    return torch.cat([h[token[expert == e]] for e in local])


def _rows_check(ep_layer: ExerciseMoE, want: torch.Tensor) -> dict[str, Any]:
    """Whether a layer's received rows are ``want``, row by row (same count and order, to rounding)."""
    got = ep_layer.grouped
    if got.shape != want.shape:
        return {"ok": False, "rows": got.shape[0], "expected_rows": want.shape[0], "misplaced": None}
    scale = float(want.abs().max()) or 1.0
    wrong = ((got - want).abs().amax(dim=1) > ROWS_RTOL * scale).sum()
    return {"ok": int(wrong) == 0, "rows": got.shape[0], "expected_rows": want.shape[0], "misplaced": int(wrong)}


def run_side_by_side(dispatch: Callable, combine: Callable, sync_gradients: Callable, info, *, shape: dict[str, int],
                     n_experts: int, top_k: int, capacity_factor: float, aux_coef: float, batch_size: int,
                     seed: int) -> dict[str, Any]:
    """One step of the learner's expert-parallel model on this rank's rows beside one process on the whole
    global batch; this rank's figures (the module docstring)."""
    p, rank = info.world_size, info.rank
    ref = build(shape, n_experts, top_k, capacity_factor, seed)
    ep = exercise_model(ref, dispatch, combine)  # before the reference runs: the same weights, no gradients
    x, y = global_batch(shape["block_size"], batch_size, seed)
    inputs: list[torch.Tensor] = []  # each mixture's input in the one-process forward
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().flatten(0, 1)))
             for m in experts.moe_layers(ref)]
    loss_ref, _ = experts.moe_loss(ref, x, y, aux_coef)
    loss_ref.backward()
    for hook in hooks:
        hook.remove()

    n = batch_size // p
    xs, ys = x[rank * n:(rank + 1) * n].clone(), y[rank * n:(rank + 1) * n].clone()
    loss, _ = experts.moe_loss(ep, xs, ys, aux_coef)
    loss.backward()
    sync_gradients(ep, None)

    glob = loss.detach().clone()
    dist.all_reduce(glob)  # the global loss: the mean of the ranks' (equal batches)
    layers, ref_layers = experts.moe_layers(ep), experts.moe_layers(ref)
    dropped = torch.tensor([m.dropped_here for m in layers])
    dist.all_reduce(dropped)
    mine = [int(e) for e in layers[0].experts]
    ref_params = dict(ref.named_parameters())
    grads = {name: {"rel": experts.relative_error(w.grad, ref_params[name].grad),
                    "norm": None if w.grad is None else float(w.grad.norm())} for name, w in ep.named_parameters()}
    rows = [_rows_check(m, expected_rows(h, r.router, top_k, range(mine[0], mine[-1] + 1)))
            for m, r, h in zip(layers, ref_layers, inputs)]
    out = {
        "rank": rank, "world_size": p, "experts": mine,
        "loss": float(glob) / p, "local_loss": float(loss.detach()), "reference_loss": float(loss_ref.detach()),
        "received": [m.received for m in layers],
        "reference_received": [[int(r.tokens_per_expert[e]) for e in mine] for r in ref_layers],
        "dropped": dropped.tolist(), "reference_dropped": [r.dropped for r in ref_layers],
        "capacity": [m.capacity for m in layers], "rows": rows, "grads": grads,
        "missing_grads": [name for name, w in ep.named_parameters() if w.grad is None],
    }
    out["loss_rel_diff"] = abs(out["loss"] - out["reference_loss"]) / abs(out["reference_loss"])
    worst = max(grads, key=lambda k: grads[k]["rel"])
    out["grad_rel_err"], out["worst_grad"] = grads[worst]["rel"], worst
    ok = (out["loss_rel_diff"] <= LOSS_RTOL and out["grad_rel_err"] <= GRAD_RTOL and all(r["ok"] for r in rows)
          and out["received"] == out["reference_received"] and out["dropped"] == out["reference_dropped"])
    every = torch.tensor(int(ok))
    dist.all_reduce(every, op=dist.ReduceOp.MIN)  # one verdict: every rank's figures right
    out["ok"], out["rank_ok"] = bool(every), ok
    return out


def report(result: dict[str, Any], info) -> bool:
    """One line per rank: the parity figures and PASS or FAIL (every rank's); whether the job passed."""
    rows = "right" if all(r["ok"] for r in result["rows"]) else "WRONG"
    log(f"experts {result['experts']}: rows received {result['received']} (one process "
        f"{result['reference_received']}), {rows}; dropped {result['dropped']} (one process "
        f"{result['reference_dropped']}); loss {result['loss']:.12f} (one process {result['reference_loss']:.12f}, "
        f"{result['loss_rel_diff']:.1e}); first gradients {result['grad_rel_err']:.1e} relative (worst "
        f"{result['worst_grad']}) -> {'PASS' if result['ok'] else 'FAIL'}", all_ranks=True)
    return bool(result["ok"])


def gradient_norm(grads: dict[str, dict[str, Any]], names: list[str]) -> float:
    """The norm of the gradients of ``names`` together, from their norms (a missing one counts 0)."""
    return math.sqrt(sum((grads[n]["norm"] or 0.0) ** 2 for n in names))
