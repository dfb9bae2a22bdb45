"""Grader of exercise 11 (``lessons/exercises/11_tensor_parallel.py``): MiniGPT's MLP, tensor-parallel by hand.

Runs the script with torchrun on 2 processes. Every rank reports its shards' shapes (or the shape
that was wrong), whether each shard holds the rank's block of the full weights, the loss of one
forward on the exercise's batch, the norm of the gradient of each of its parameters (a shard's for
the MLP's), and the losses of a few SGD steps. The grader computes all of these itself, in this
process, on one unsplit model built from the same seed (``biased.biased_model``) and the same
batches, and compares. When they differ, it names the mistake by what it measured:

- a shard of the wrong shape: the weight sliced along the wrong dimension (rows vs columns);
- the ranks' losses are nearest (``check.nearest``, by a clear margin) to those of a model, simulated
  in this process, whose MLP gives only that rank's partial output (no all-reduce in g), or adds
  proj's bias N times (added before the sum), or runs fc on N times its input (an all-reduce in f's
  forward); losses between two explanations name none;
- the forward right, the last MLP's own gradients right, but those of what comes before it wrong:
  no all-reduce of the input's gradient in f's backward;
- the MLP's gradients N times too large: an all-reduce in g's backward.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ddp_course.check import Nearest, Verdict, nearest, run_exercise

EXERCISE = "11_tensor_parallel.py"
# The course's own version of the shards: the lab's slice of a rank's hidden units (tp_lab re-exports it).
DELEGATES = ("ddp_course.parallel._tensor_parallel.hidden_block",)
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): which direction of f
# and of g communicates (the table after the grading cell), and the shards' lines.
GIVEAWAYS = ("all-reduce of the gradient of x", "all-reduce the input's gradient", "all-reduce (sum) of the input's gradient",
             "identity in forward", "identity in backward", "f's backward sums", "every rank already holds the whole input",
             "every rank already holds the whole gradient", "every rank already has the whole gradient",
             "chunk(world_size, dim=0)", "chunk(world_size, dim=1)", "w.chunk(2, dim=0)", "w.chunk(2, dim=1)")
NPROC = 2
# One process and 2 ranks add the same float32 terms in another grouping (each rank sums over its
# hidden units, the all-reduce adds the ranks). Measured, relative to the grader's own values: the
# solution's loss 0, gradient norms up to 8e-7, SGD losses 0. Each classic mistake: the first loss
# off by 3e-4 (no all-reduce in g), 5e-4 (proj's bias on every rank), 6e-4 (an all-reduce in f's
# forward), or, where the forward is right, a gradient norm off by 0.37 (no all-reduce in f's
# backward) or 1.0 (an all-reduce in g's backward). 1e-5 sits between: 12x above the solution's
# worst, 30x below the smallest mistake. Which forward mistake it is goes by the nearest simulation
# (``forward_explanation``): the simulations are 1.0e-4 to 2.9e-4 apart, and each mistake's job
# reported first losses equal to its simulation in all 6 decimals a verdict shows.
RTOL = 1e-5
MLP = (".mlp.fc.weight", ".mlp.fc.bias", ".mlp.proj.weight", ".mlp.proj.bias")
WHAT_TO_DO = {
    "partial": ("no all-reduce after the row-parallel proj: each rank's loss is that of its own partial output "
                "(its hidden units' share of the sum), so the ranks disagree and both are wrong. g's forward must "
                "all-reduce (sum) the partial outputs, so that every rank holds the total."),
    "bias": ("proj's bias is added on every rank before the sum, so the all-reduce adds it {n} times. Compute the "
             "partial output with proj's weight alone, all-reduce it (g), and add proj's bias once, after g."),
    "f_forward": ("there is an all-reduce in the forward of the column-parallel side too: fc sees {n} times its input "
                  "(every rank already holds the whole input, so summing it over the ranks multiplies it). f's "
                  "forward must return its input unchanged; its all-reduce belongs in its backward."),
}


def harness_constants(path: str | Path) -> dict:
    """SHAPE, BATCH, STEPS, LR, SEED as the script sets them (read, not run)."""
    from ddp_course.check.reference import harness_constants as read

    return read(path)


def _setup(constants: dict):
    from ddp_course.course.l11_beyond_data_parallel.biased import biased_model
    from ddp_course.course.tiny import micro_batch

    shape, batch, seed = constants["SHAPE"], constants["BATCH"], constants["SEED"]

    def data(i: int):
        return micro_batch(i, 0, micro_batch_size=batch, block_size=shape["block_size"], seed=seed)

    return biased_model(seed, **shape), data


def _slice(name: str, full, rank: int):
    from ddp_course.course.l11_beyond_data_parallel.tp_lab import hidden_block

    if ".mlp.fc." in name:
        return full[hidden_block(full.shape[0], rank, NPROC)]
    if name.endswith(".mlp.proj.weight"):
        return full[:, hidden_block(full.shape[1], rank, NPROC)]
    return full


@functools.lru_cache(maxsize=4)
def _reference(key: str) -> dict:
    """One process: the first loss, each rank's gradient norms (of its slices), the SGD losses."""
    import torch

    constants = json.loads(key)
    model, data = _setup(constants)
    _, loss = model(*data(0))
    loss.backward()
    norms = [{n: _slice(n, p.grad, r).norm().item() for n, p in model.named_parameters()} for r in range(NPROC)]
    losses = []
    for step in range(constants["STEPS"]):  # the script's order: a step, then the next batch's loss
        with torch.no_grad():
            for p in model.parameters():  # plain SGD, as the script's harness steps
                p -= constants["LR"] * p.grad
                p.grad = None
        _, later = model(*data(step + 1))
        later.backward()
        losses.append(later.item())
    return {"loss": loss.item(), "norms": norms, "losses": losses}


def reference(constants: dict) -> dict:
    return _reference(json.dumps(constants, sort_keys=True))


def mistaken_losses(constants: dict) -> dict[str, list[float]]:
    """The first loss of each forward mistake, per rank, computed in this process (no ranks needed)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from ddp_course.course.l11_beyond_data_parallel.tp_lab import hidden_block

    class Mistaken(nn.Module):
        def __init__(self, mlp: nn.Module, kind: str, rank: int) -> None:
            super().__init__()
            self.mlp, self.kind, self.rank = mlp, kind, rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fc, proj = self.mlp.fc, self.mlp.proj
            if self.kind == "f_forward":
                return proj(F.gelu(fc(NPROC * x)))
            if self.kind == "bias":
                return proj(F.gelu(fc(x))) + (NPROC - 1) * proj.bias
            block = hidden_block(fc.out_features, self.rank, NPROC)  # "partial": this rank's share, bias once
            return F.linear(F.gelu(F.linear(x, fc.weight[block], fc.bias[block])), proj.weight[:, block], proj.bias)

    out = {}
    with torch.no_grad():
        for kind in WHAT_TO_DO:
            out[kind] = []
            for rank in range(NPROC if kind == "partial" else 1):
                model, data = _setup(constants)
                for block in model.blocks:
                    block.mlp = Mistaken(block.mlp, kind, rank)
                out[kind].append(model(*data(0))[1].item())
    return out


EXPLANATIONS = {"right": "the one-process reference", "partial": "no all-reduce in g's forward",
                "bias": "proj's bias added on every rank", "f_forward": "an all-reduce in f's forward"}


def forward_explanation(losses: list[float | None], constants: dict) -> Nearest:
    """Which explanation of the ranks' first losses is nearest: the right forward (the grader's
    one-process loss on every rank) or one of the forward mistakes, simulated in this process."""
    candidates = {"right": [reference(constants)["loss"]] * NPROC}
    for kind, per_rank in mistaken_losses(constants).items():
        candidates[kind] = per_rank if len(per_rank) == NPROC else per_rank * NPROC
    return nearest(losses, candidates)


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) <= RTOL * abs(b)


def _shard_problem(error: dict) -> str:
    what, got, want = error["what"], tuple(error["got"]), tuple(error["want"])
    layer, shown = ("fc", "column_shard") if what.startswith("column") else ("proj", "row_shard")
    if what.endswith("weight") and sorted(got) != sorted(want) and len(got) == 2:
        if layer == "fc":
            return (f"{shown} sliced fc.weight along the wrong dimension: it returned shape {got}, but this rank's "
                    f"column-parallel shard is {want}. nn.Linear stores its weight as (out_features, in_features); a "
                    "column-parallel layer splits its OUTPUT features, so take this rank's block of rows (dim 0), "
                    "every input column.")
        return (f"{shown} sliced proj.weight along the wrong dimension: it returned shape {got}, but this rank's "
                f"row-parallel shard is {want}. nn.Linear stores its weight as (out_features, in_features); a "
                "row-parallel layer splits its INPUT features (the hidden units), so take this rank's block of "
                "columns (dim 1), every output row.")
    if what.endswith("bias"):
        how = ("its entries of fc.bias, one per hidden unit it holds" if layer == "fc" else
               "proj.bias whole: the bias of the summed output, added once")
        return f"{shown} returned a bias of shape {got}, but it must be {want}: {how}."
    return f"{what} has shape {got}, but this rank's shard must be {want}: return this rank's block (torch.chunk order)."


def _gradient_problem(ranks: dict[int, dict], ref: dict) -> str | None:
    missing = {rank: sorted(n for n, g in r["grads"].items() if g["norm"] is None) for rank, r in ranks.items()}
    some = sorted({n for names in missing.values() for n in names} - set.intersection(*map(set, missing.values())))
    if some:  # used on some ranks only: e.g. proj's bias added inside `if rank == 0:`
        without = sorted(rank for rank, names in missing.items() if some[0] in names)
        return (f"the parameter(s) {some[:4]} got a gradient on some ranks but none on rank(s) {without}: "
                "those ranks never used them. Every rank holds proj.bias whole and must use it the same way: add "
                "it once, after g, on every rank (not inside `if rank == 0:`, which gives the same forward but "
                "leaves the other ranks' copy untrained).")
    everywhere = sorted({n for names in missing.values() for n in names})
    if everywhere:
        return (f"the parameter(s) {everywhere[:4]} got no gradient: compute with the module's own parameters "
                "(self.fc, self.proj), not with copies of them.")
    bad = {rank: [n for n, g in r["grads"].items() if not _close(g["norm"], ref["norms"][rank][n])]
           for rank, r in ranks.items()}
    worst = max(bad, key=lambda rank: len(bad[rank]))
    if not bad[worst]:
        return None
    r, names = ranks[worst], bad[worst]
    last = max(int(n.split(".")[1]) for n in r["grads"] if n.startswith("blocks."))
    last_mlp = [f"blocks.{last}{s}" for s in MLP]
    ratio = {n: r["grads"][n]["norm"] / ref["norms"][worst][n] for n in names if ref["norms"][worst][n] > 0}
    if not any(n in names for n in last_mlp) and f"blocks.{last}.ln2.weight" in names:
        return ("the forward is right, and so are the gradients of the last block's MLP, but the gradients of what "
                f"comes before an MLP are wrong (e.g. {', '.join(names[:3])}): no all-reduce of the input's "
                "gradient in f's backward. Each rank's fc gives only the share of the input's gradient that flows "
                "through its own hidden units; f's backward must all-reduce (sum) it, so that the LayerNorm, the "
                "attention and the embeddings get the whole gradient, the same on every rank.")
    if all(n in names and abs(ratio.get(n, 0) - NPROC) < 0.01 * NPROC for n in last_mlp[:3]):
        return (f"the forward is right, but the gradients of the MLP's parameters are {NPROC} times too large: "
                "an all-reduce in g's backward. The gradient of g's output is already whole on every rank; g's "
                "backward must return it unchanged.")
    shown = ", ".join(f"{n} ({ratio[n]:.3g}x)" if n in ratio else n for n in names[:4])
    return (f"the forward is right, but rank {worst}'s gradients of {shown} differ from the grader's one-process "
            f"reference (relative tolerance {RTOL:.0e}). Check f's backward (all-reduce the input's gradient) and "
            "g's backward (the gradient unchanged).")


def diagnose(found: list[dict], constants: dict) -> Verdict:
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    errors = [r["shard_error"] for r in ranks.values() if r.get("shard_error")]
    if errors:
        return Verdict(False, _shard_problem(errors[0]))
    for rank, r in sorted(ranks.items()):
        wrong = [n for n, same in r["shards_match"].items() if not same]
        if wrong:
            return Verdict(False, f"rank {rank}'s shards of {', '.join(wrong[:3])} have the right shapes but not the "
                                  f"rank's block: rank r holds hidden units r*H/N to (r+1)*H/N - 1 (torch.chunk's "
                                  "blocks): those rows of fc.weight and entries of fc.bias, those columns of "
                                  "proj.weight, and proj.bias whole.")
    ref = reference(constants)
    if not all(_close(r["loss"], ref["loss"]) for r in ranks.values()):
        found = forward_explanation([ranks[rank]["loss"] for rank in range(NPROC)], constants)
        if found.name in WHAT_TO_DO and found.clear():
            return Verdict(False, WHAT_TO_DO[found.name].format(n=NPROC)
                           + _losses_shown(ranks, ref, found.shown(EXPLANATIONS)))
        return Verdict(False, "the forward differs from one process: " + _losses_shown(ranks, ref).strip()
                       + " Check TensorParallelMLP.forward: f, fc and GELU on this rank's hidden units, proj's "
                         "weight alone, g (an all-reduce), then proj's bias once.")
    problem = _gradient_problem(ranks, ref)
    if problem:
        return Verdict(False, problem)
    for rank, r in sorted(ranks.items()):
        if not all(_close(a, b) for a, b in zip(r["losses"]["tp"], ref["losses"])):
            return Verdict(False, f"one forward and backward are right, but after SGD steps rank {rank}'s losses "
                                  f"{[round(v, 6) for v in r['losses']['tp']]} differ from one process's "
                                  f"{[round(v, 6) for v in ref['losses']]}. Keep the shards as parameters of the "
                                  "module (the harness steps them) and compute with them.")
    worst_grad = max(g["rel_diff"] for r in ranks.values() for g in r["grads"].values())
    return Verdict(True, f"every rank's loss equals one process's ({ref['loss']:.6f}), its logits within "
                         f"{max(r['logits_rel_diff'] for r in ranks.values()):.1e} and its gradients (each shard "
                         f"against its slice) within {worst_grad:.1e} of their size; after {constants['STEPS']} SGD "
                         f"steps the losses still equal the grader's one-process reference (relative tolerance "
                         f"{RTOL:.0e}).")


def _losses_shown(ranks: dict[int, dict], ref: dict, then: str = "") -> str:
    shown = ", ".join(f"rank {rank} {r['loss']:.6f}" for rank, r in sorted(ranks.items()))
    return f" (losses: {shown}; one process {ref['loss']:.6f}{'; ' + then if then else ''}.)"


def collect(path: str | Path, timeout: float = 120) -> list[dict] | Verdict:
    """Run the script on 2 ranks: its RESULT lines, or a failing verdict saying why there are none."""
    return run_exercise(path, NPROC, "the TODOs", timeout)


def grade(path: str | Path, timeout: float = 120) -> Verdict:
    """Run the script on 2 ranks, then compare with the grader's own one-process reference."""
    found = collect(path, timeout)
    if isinstance(found, Verdict):
        return found
    return diagnose(found, harness_constants(path))
