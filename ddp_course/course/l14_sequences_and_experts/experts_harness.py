"""What exercise 14's expert dispatch measures of a learner's ``dispatch``, ``combine`` and ``sync_gradients``,
against one process.

:func:`run_side_by_side` builds the seeded mixture-of-experts MiniGPT of ``experts_base.moe_gpt`` in float64,
a copy whose layers are :class:`ExerciseMoE` (``experts_base.ExpertParallelLayer`` with the learner's
exchanges), runs one forward and backward of this rank's share of a global batch through it,
calls the learner's gradient sync, and compares with one process on the whole batch: the loss, the
gradient of every parameter this rank holds, the rows each local expert received and whether they are
the rows the routers sent it in priority order, and the slots dropped. :func:`report` prints one line per
rank. The grader (``grader_experts``) reads the same numbers from the ``RESULT`` line.

While it runs, every ``dist.all_to_all_single`` is checked before it starts (:class:`CheckedExchanges`):
the ranks compare the splits they pass, and when they disagree -- a split list that does not add up to its
tensor's rows, or a rank expecting another number of rows than its peer sends -- every rank raises the same
error, which says which splits disagree and by how much, instead of gloo aborting the job ("Received data
size doesn't match expected size") or PyTorch's "Split sizes doesn't match total dim 0 size". A combine
that sends nothing back is named the same way (:meth:`ExerciseMoE.bring_back`).

Float64, not float32: the expert-parallel layer adds the same numbers as one process in other groupings,
which float32 rounds to ~1e-7 relative (the lab's float32 parity) and float64 to ~1e-15, so that any row
sent to a wrong expert or brought back to a wrong token stands out by many orders of magnitude.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.course.l14_sequences_and_experts import experts_base
from ddp_course.course.tiny import VOCAB
from ddp_course.dist import log
from ddp_course.model import MiniGPT

# float64: one process and the ranks differ by rounding, ~1e-15 relative (the lab's float64 parity stays
# under 1e-12); a row processed by another expert, or brought home to another token, moves the loss by
# ~1e-6 and the gradients by far more
LOSS_RTOL, GRAD_RTOL, ROWS_RTOL = 1e-10, 1e-10, 1e-10


def build(shape: dict[str, int], n_experts: int, top_k: int, capacity_factor: float, seed: int) -> MiniGPT:
    """The exercise's one-process model: ``experts_base.moe_gpt`` (seeded: the same in every process and
    thread), in float64."""
    return experts_base.moe_gpt(n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor, seed=seed,
                           vocab_size=VOCAB, **shape).double()


def global_batch(block_size: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (x, y) of random tokens, the same in every process (its own seeded generator)."""
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(VOCAB, (batch_size, block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class CheckedExchanges:
    """While active (``with``), every ``dist.all_to_all_single`` -- the learner's own, ``AllToAll``'s and
    ``torch.distributed.nn.functional``'s, which all look it up on ``torch.distributed`` -- first shares the
    splits every rank passes (one small ``all_gather``) and checks them: each split list has one entry per
    rank and adds up to its tensor's rows, and what rank s sends to rank r (its ``input_split_sizes[r]``) is
    what r expects from s (its ``output_split_sizes[s]``). Every rank sees the same splits, so when they
    disagree every rank raises the same ``ValueError``, naming the splits, instead of one rank failing alone
    and its peers waiting. ``phase`` (set by the caller: "dispatch", "combine", "backward") names where the
    call came from; ``calls`` counts the calls per phase."""

    def __init__(self) -> None:
        self.phase = "dispatch"
        self.calls: dict[str, int] = {}
        self._real: Callable | None = None

    def __enter__(self) -> CheckedExchanges:
        self._real = dist.all_to_all_single
        dist.all_to_all_single = self._checked
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_to_all_single = self._real

    def _checked(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        self.calls[self.phase] = self.calls.get(self.phase, 0) + 1
        p = dist.get_world_size(group)
        mine = [output.shape[0], input.shape[0]]
        for given, rows in ((output_split_sizes, output.shape[0]), (input_split_sizes, input.shape[0])):
            splits = [int(n) for n in given] if given is not None and len(given) else [rows // p] * p
            mine += [len(splits), *(splits + [0] * p)[:p]]
        every = [torch.empty(2 * p + 4, dtype=torch.long) for _ in range(p)]
        dist.all_gather(every, torch.tensor(mine, dtype=torch.long), group=group)
        problem = split_problem([t.tolist() for t in every], p)
        if problem:
            raise ValueError(f"all_to_all_single in {self.phase} (its call {self.calls[self.phase]} there): {problem}")
        return self._real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def split_problem(every: list[list[int]], p: int) -> str | None:
    """What is wrong with the splits the ranks pass to one ``all_to_all_single`` (``every[r]``: rank r's output
    rows, input rows, then for its output splits and its input splits each: their length, then p entries),
    or None when they agree. Short (a verdict shows the first 400 characters of an error), and the same on
    every rank; ``grader_experts.hint`` explains it."""
    out_rows, in_rows = [e[0] for e in every], [e[1] for e in every]
    out_len, outs = [e[2] for e in every], [e[3:3 + p] for e in every]
    in_len, ins = [e[3 + p] for e in every], [e[4 + p:4 + 2 * p] for e in every]
    for r in range(p):
        for name, n in (("output_split_sizes", out_len[r]), ("input_split_sizes", in_len[r])):
            if n != p:
                return f"rank {r} passed {name} with {n} entries; it takes one per rank ({p})."
    for r in range(p):
        for name, splits, rows, tensor in (("output_split_sizes", outs[r], out_rows[r], "output"),
                                           ("input_split_sizes", ins[r], in_rows[r], "input")):
            if sum(splits) != rows:
                return (f"rank {r}'s {name} {splits} add up to {sum(splits)} rows, but its {tensor} tensor has "
                        f"{rows}: all_to_all_single(output, input, output_split_sizes, input_split_sizes) takes the "
                        f"rows a rank receives from each rank, then the rows it sends to each.")
    wrong = [(s, r) for s in range(p) for r in range(p) if ins[s][r] != outs[r][s]]
    if wrong:
        shown = "; ".join(f"rank {s} sends {ins[s][r]} rows to rank {r}, which expects {outs[r][s]} from it"
                          for s, r in wrong[:3])
        return (f"the ranks' splits disagree: {shown}{' (and more)' if len(wrong) > 3 else ''}. Rank r's "
                f"output_split_sizes[s] must be rank s's input_split_sizes[r].")
    return None


def _mentions_an_exchange(fn: Callable) -> bool:
    """Whether the source of ``fn`` names an all-to-all (False when it has none to read)."""
    try:
        return bool(re.search(r"all_to_all|alltoall|AllToAll", inspect.getsource(fn), re.IGNORECASE))
    except (OSError, TypeError):
        return False


class ExerciseMoE(experts_base.ExpertParallelLayer):
    """The lesson's expert-parallel layer with the learner's exchanges: ``dispatch(slots, counts, group)``
    returns ``(grouped, Exchange)`` and ``combine(outputs, ex, order, gate, group)`` the tokens' outputs; the
    routing, the capacity and the experts are the lesson's. After each forward it holds, besides the frame's
    records, ``grouped`` (the rows the local experts received, detached). ``checked`` is the
    :class:`CheckedExchanges` the job runs under (None: unchecked)."""

    def __init__(self, moe: experts_base.MoE, dispatch: Callable, combine: Callable,
                 group: dist.ProcessGroup | None = None, checked: CheckedExchanges | None = None) -> None:
        super().__init__(moe, group)
        self._dispatch, self._combine, self.checked = dispatch, combine, checked
        self.grouped = torch.empty(0)

    def send_out(self, slots: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, experts_base.Exchange]:
        if self.checked is not None:
            self.checked.phase = "dispatch"
        got = self._dispatch(slots, counts, self.group)
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], experts_base.Exchange)):
            raise TypeError(f"dispatch must return (grouped, Exchange), not {type(got).__name__}")
        grouped, ex = got
        per_expert = [int(n) for n in ex.per_expert]
        if grouped.shape[0] != sum(per_expert):
            raise ValueError(f"dispatch returned {grouped.shape[0]} rows, but its Exchange's from_rank counts "
                             f"{sum(per_expert)} ({per_expert} for the local experts): they must agree")
        self.grouped = grouped.detach()
        return grouped, ex

    def bring_back(self, outputs: torch.Tensor, ex: experts_base.Exchange, order: torch.Tensor, gate: torch.Tensor
                   ) -> torch.Tensor:
        checked = self.checked
        before = None if checked is None else checked.calls.get("combine", 0)
        if checked is not None:
            checked.phase = "combine"
        failed: Exception | None = None
        try:
            out = self._combine(outputs, ex, order, gate, self.group)
        except (IndexError, RuntimeError, ValueError) as exc:
            failed = exc
        # whether combine sent anything: known only when the checker saw the dispatch's calls (a learner may
        # call all_to_all_single by a name bound before the job, which no checker sees); a combine that failed
        # before its exchange is not blamed when its code has one
        sent = checked is None or not checked.calls.get("dispatch", 0) or checked.calls.get("combine", 0) > before
        if not sent and (failed is None or not _mentions_an_exchange(self._combine)):
            raise ValueError(
                "combine sent nothing back: it made no all_to_all_single, so the rows it holds are the ones the other "
                "ranks sent here, not this rank's token-slots"
                + (f" (hence its {type(failed).__name__})" if failed is not None else "")
                + ". Return every row to the rank it came from first, with a second all_to_all (the dispatch's "
                "splits swapped).") from failed
        if failed is not None:
            raise failed
        return out


def exercise_model(model: MiniGPT, dispatch: Callable, combine: Callable, checked: CheckedExchanges | None = None
                   ) -> MiniGPT:
    """A copy of the one-process ``model`` whose mixtures of experts are :class:`ExerciseMoE`: this rank
    keeps its experts only, under the same names."""
    ep = copy.deepcopy(model)
    for block in ep.blocks:
        block.mlp = ExerciseMoE(block.mlp, dispatch, combine, checked=checked)
    return ep


def expected_rows(h: torch.Tensor, router: nn.Linear, top_k: int, local: range) -> torch.Tensor:
    """The rows the experts ``local`` must receive from the whole batch ``h`` (N, C), grouped by expert,
    each group in global priority (slot) order: what one process hands each of them."""
    expert = experts_base.route(router, h, top_k).expert.reshape(-1)
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
    checked = CheckedExchanges()
    ep = exercise_model(ref, dispatch, combine, checked)  # before the reference runs: the same weights, no gradients
    x, y = global_batch(shape["block_size"], batch_size, seed)
    inputs: list[torch.Tensor] = []  # each mixture's input in the one-process forward
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().flatten(0, 1)))
             for m in experts_base.moe_layers(ref)]
    loss_ref, _ = experts_base.moe_loss(ref, x, y, aux_coef)
    loss_ref.backward()
    for hook in hooks:
        hook.remove()

    n = batch_size // p
    xs, ys = x[rank * n:(rank + 1) * n].clone(), y[rank * n:(rank + 1) * n].clone()
    with checked:
        loss, _ = experts_base.moe_loss(ep, xs, ys, aux_coef)
        checked.phase = "backward (the exchanges' gradients)"
        loss.backward()
        checked.phase = "sync_gradients"
        sync_gradients(ep, None)

    glob = loss.detach().clone()
    dist.all_reduce(glob)  # the global loss: the mean of the ranks' (equal batches)
    layers, ref_layers = experts_base.moe_layers(ep), experts_base.moe_layers(ref)
    dropped = torch.tensor([m.dropped_here for m in layers])
    dist.all_reduce(dropped)
    mine = [int(e) for e in layers[0].experts]
    ref_params = dict(ref.named_parameters())
    grads = {name: {"rel": experts_base.relative_error(w.grad, ref_params[name].grad),
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
