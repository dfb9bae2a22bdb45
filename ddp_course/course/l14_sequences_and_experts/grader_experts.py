"""Grader of exercise 14's second part (``lessons/exercises/14_expert_dispatch.py``): expert parallelism's
dispatch, combine and gradient sync, by hand, on 4 ranks.

Runs the script with torchrun on 4 processes. Every rank runs one step of the learner's expert-parallel
MiniGPT beside one process and reports (``experts_harness.run_side_by_side``): the rows each of its
experts received, whether they are the rows the routers sent it in priority order, the slots dropped,
its own loss and the global one, and the norm and relative error of every gradient it holds. In its own
process the grader plays the 4 ranks of the expert-parallel layer (:func:`simulate`: each rank's slots,
the exchanges, the capacity, the way back) right and with each classic mistake, and judges:

- the rows: each expert receives as many rows as the routers sent it -- else the receive splits were
  not learned from the other ranks (the counts exchanged first); and the rows themselves, in the global
  priority order -- else the arrivals were not regrouped by expert;
- the loss of every rank, against the simulations: rows brought home but not put back at their tokens'
  positions (no un-sort, or the sort applied again), the regroup not undone;
- the gradients: of each expert against one process's, ``p`` times it (the 1/p left out), and the sum of
  the same-numbered experts of every rank (expert gradients all-reduced like replicated ones); of the
  replicated parameters against one process's, ``p`` times it, each rank's own (not all-reduced), and
  what is left when the dispatch's exchange carries no gradient; a gradient that never reached an
  expert (the combine's exchange carries none);

each mistake named by the explanation nearest to what the job measured, by ``check.MARGIN``
(``check.nearest``). Any correct spelling passes: the judgement is on numbers, not on code.

A job that fails names its mistake too: the harness checks the splits of every ``all_to_all_single``
before it runs (``experts_harness.CheckedExchanges``: which rank's input and output splits disagree, and
by how many rows) and names a combine that sends nothing back (``ExerciseMoE.bring_back``); :func:`hint`
explains PyTorch's and gloo's own words when a call escaped the check.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ddp_course.check import Verdict, judged, nearest, run_exercise

EXERCISE = "14_expert_dispatch.py"  # the script this grades: lessons/exercises/14_expert_dispatch.py
NPROC = 4
_L14 = "ddp_course.course.l14_sequences_and_experts"
# The course's own versions of the three answers (the lesson's expert-parallel layer): an answer that calls
# them is refused (check.delegation).
DELEGATES = (f"{_L14}.experts.dispatch", f"{_L14}.experts.combine", f"{_L14}.experts.sync_gradients",
             f"{_L14}.experts.expert_parallel", f"{_L14}.experts.ExpertParallelMoE.send_out",
             f"{_L14}.experts.ExpertParallelMoE.bring_back")
# What would state the answers before the exercise is graded: the gradient rule, and the answer's own lines.
GIVEAWAYS = ("not all-reduced", "never all-reduce", "divided by p", "divide it by p", "divide them by p",
             "divided by the number of ranks and nothing else", "divide by the world size only",
             "divided by the world size and never", "1/p forgotten", "all_to_all_single(incoming, counts",
             "argsort(which, stable=True)", "index_copy(0, order", "index_copy(0, ex.regroup")
EXPERTS = ".mlp.experts."  # in the names of the expert parameters
EXPERT_PARAMS = ("fc.weight", "fc.bias", "proj.weight", "proj.bias")

WHY_COUNTS = ("all_to_all_single with uneven splits needs on every rank how many rows arrive from each rank "
              "(output_split_sizes), and only the senders know it. Exchange the per-expert counts first: a "
              "dist.all_to_all_single of the (E,) counts gives each rank the (p, E/p) counts of the rows coming to "
              "each of its experts from each rank; the receive splits are its row sums.")
COUNTS_NOT_EXCHANGED = "The classic mistake: the receive splits were not exchanged first. " + WHY_COUNTS

# name -> (the simulation's options, what the verdict says); the loss explanations
LOSS_MISTAKES = {
    "no un-sort": ({"unsort": "none"},
                   "the combine brings the rows home but leaves them in expert order, not at their tokens' "
                   "positions: every token gets some other slot's output. The rows come back in the order dispatch "
                   "sent them, sorted by expert: row i belongs to token-slot order[i]. Undo the sort (index_copy "
                   "or scatter to order, or index with its inverse) before the gates."),
    "sorted again": ({"unsort": "order"},
                     "the combine applies the sort a second time (rows[order]) instead of undoing it: row i belongs "
                     "to token-slot order[i], so it must go to position order[i] (index_copy or scatter to order, "
                     "or index with the inverse permutation)."),
    "regroup not undone": ({"undo_regroup": False},
                           "the combine sends the experts' outputs back in the grouped order (by local expert), but "
                           "the senders expect them in the order they arrived (by source rank): undo dispatch's "
                           "regroup before the reverse exchange."),
    "no regroup": ({"regroup": False},
                   "the rows reach the right rank, but each local expert takes a slice of them in arrival order "
                   "(by source rank first), not its own rows. Regroup the arrivals by local expert (a stable "
                   "sort of each row's local expert keeps the source ranks in order inside a group), and undo it "
                   "in combine."),
}
LABELS = {"right": "a right dispatch and combine", **{k: k for k in LOSS_MISTAKES},
          "one process": "one process's gradients", "times p": "one process's times p",
          "all-reduced": "the experts' gradients all-reduced and averaged over the ranks",
          "all-reduced, summed": "all-reduced and summed", "own rank": "each rank's own gradient",
          "no gradient through dispatch": "no gradient through the dispatch's exchange"}


# --- the expert-parallel layer played by one process ----------------------------------------------------------

def _simulated(moe, p: int, regroup: bool = True, undo_regroup: bool = True, unsort: str = "inverse",
               detach_dispatch: bool = False):
    """An nn.Module playing the ``p`` ranks of ``experts.ExpertParallelMoE`` around the one-process ``moe``,
    with one mistake or none: ``regroup`` (experts take their rows grouped, or in arrival order),
    ``undo_regroup`` (before the way back), ``unsort`` ("inverse": the rows back at their slots; "none"; "order":
    the sort applied again), ``detach_dispatch`` (the first exchange carries no gradient). It keeps
    ``aux_terms``, each rank's auxiliary loss."""
    import torch
    import torch.nn as nn

    from ddp_course.course.l14_sequences_and_experts import experts

    class Simulated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.experts = moe.router, moe.experts  # the one-process names, "mlp.experts.<e>..."
            self.aux_terms: list = []

        def forward(self, x):
            B, T, C = x.shape
            h, k, E = x.reshape(B * T, C), moe.top_k, moe.n_experts
            L, n = E // p, B * T // p  # experts per rank, tokens per rank
            r = experts.route(moe.router, h, k)
            total = torch.bincount(r.expert.reshape(-1), minlength=E)
            cap = experts.capacity(B * T, k, E, moe.capacity_factor)
            orders, counts, sent = [], [], []
            for s in range(p):  # each rank sorts its slots by expert and splits them by destination
                chosen = r.expert[s * n:(s + 1) * n].reshape(-1)
                order = torch.sort(chosen, stable=True).indices
                rows = h[s * n:(s + 1) * n][order // k]
                c = torch.bincount(chosen, minlength=E)
                orders.append(order)
                counts.append(c)
                sent.append((rows.detach() if detach_dispatch else rows).split(c.view(p, L).sum(1).tolist()))
            back = [[None] * p for _ in range(p)]
            for q in range(p):  # each rank's experts on what arrived
                from_rank = torch.stack([c[q * L:(q + 1) * L] for c in counts])
                which = torch.arange(L).repeat(p).repeat_interleave(from_rank.flatten())
                perm = torch.sort(which, stable=True).indices if regroup else torch.arange(which.numel())
                grouped = torch.cat([sent[s][q] for s in range(p)])[perm]
                pieces, start = [grouped[:0]], 0
                for j, rows_j in enumerate(from_rank.sum(0).tolist()):
                    kept = min(rows_j, cap)
                    pieces += [moe.experts[q * L + j](grouped[start:start + kept]),
                               grouped[start + kept:start + rows_j] * 0]
                    start += rows_j
                outputs = torch.cat(pieces)
                arrivals = outputs[experts.inverse(perm)] if undo_regroup else outputs
                for s, piece in enumerate(arrivals.split(from_rank.sum(1).tolist())):
                    back[s][q] = piece
            outs = []
            for s in range(p):  # each rank puts its rows back and mixes them
                mine = torch.cat(back[s])
                mine = {"inverse": mine[experts.inverse(orders[s])], "order": mine[orders[s]], "none": mine}[unsort]
                outs.append((mine.view(n, k, C) * r.gate[s * n:(s + 1) * n].unsqueeze(-1)).sum(1))
            self.aux_terms = [experts.aux_loss(r.probs[s * n:(s + 1) * n], total) for s in range(p)]
            return torch.cat(outs).view(B, T, C)

    return Simulated()


def simulate(constants: dict[str, Any], p: int = NPROC, **mistake) -> tuple[Any, list]:
    """The exercise's model with its mixtures played by :func:`_simulated` (``mistake`` its options), run on the
    global batch: (the model, each rank's loss as a tensor, as the rank computes it: its tokens'
    cross-entropy plus ``AUX_COEF`` times its auxiliary terms)."""
    import torch.nn.functional as F

    from ddp_course.course.l14_sequences_and_experts.experts_harness import build, global_batch

    shape = constants["SHAPE"]
    model = build(shape, constants["N_EXPERTS"], constants["TOP_K"], constants["CAPACITY_FACTOR"], constants["SEED"])
    layers = []
    for block in model.blocks:
        block.mlp = _simulated(block.mlp, p, **mistake)
        layers.append(block.mlp)
    x, y = global_batch(shape["block_size"], constants["BATCH_SIZE"], constants["SEED"])
    logits = model(x)
    b = constants["BATCH_SIZE"] // p
    losses = [F.cross_entropy(logits[s * b:(s + 1) * b].flatten(0, 1), y[s * b:(s + 1) * b].flatten())
              + constants["AUX_COEF"] * sum(m.aux_terms[s] for m in layers) for s in range(p)]
    return model, losses


def _gradient_norms(model, n_layer: int, n_experts: int) -> tuple[list[float], float]:
    """Each expert's gradient norm (its four tensors together), block by block, and the replicated
    parameters' together, of a model whose backward has run."""
    import torch

    params = dict(model.named_parameters())

    def norm(tensors) -> float:
        return float(torch.cat([t.reshape(-1) for t in tensors]).norm())

    per_expert = [norm([params[f"blocks.{layer}{EXPERTS}{e}.{w}"].grad for w in EXPERT_PARAMS])
                  for layer in range(n_layer) for e in range(n_experts)]
    return per_expert, norm([w.grad for n, w in params.items() if EXPERTS not in n])


def references(path: str | Path) -> dict[str, Any]:
    """What the grader compares the job with, for the script's constants (``LOSS_MISTAKES`` and ``LABELS``
    name them): each explanation's per-rank losses, gradient norm of every expert (block by block) and
    gradient norm of the replicated parameters on each rank."""
    import torch

    from ddp_course.check.reference import harness_constants

    c = harness_constants(path)
    p, n_experts, n_layer = NPROC, c["N_EXPERTS"], c["SHAPE"]["n_layer"]
    model, losses = simulate(c)
    params = dict(model.named_parameters())
    shared = [w for n, w in params.items() if EXPERTS not in n]
    own = [float(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, shared, retain_graph=True)]).norm())
           for loss in losses]  # each rank's own gradient of the replicated parameters
    torch.stack(losses).mean().backward()  # the global loss: the mean of the ranks'
    right, shared_right = _gradient_norms(model, n_layer, n_experts)
    local = n_experts // p
    # all-reduced over the ranks, averaged: the j-th expert of every rank holds the sum of the p j-th experts'
    # one-process gradients (each was p times it before the average)
    mixed = []
    for layer in range(n_layer):
        for e in range(n_experts):
            same = [[params[f"blocks.{layer}{EXPERTS}{q * local + e % local}.{w}"].grad for w in EXPERT_PARAMS]
                    for q in range(p)]
            mixed.append(float(torch.cat([sum(g).reshape(-1) for g in zip(*same)]).norm()))
    detached, detached_losses = simulate(c, detach_dispatch=True)
    torch.stack(detached_losses).mean().backward()
    detached_experts, detached_shared = _gradient_norms(detached, n_layer, n_experts)
    with torch.no_grad():  # the combine's and the regroup's mistakes: their losses tell them apart
        wrong = {k: [x.item() for x in simulate(c, **opts)[1]] for k, (opts, _) in LOSS_MISTAKES.items()}
    return {
        "losses": {"right": [x.item() for x in losses], **wrong},
        "experts": {"one process": right, "times p": [p * x for x in right], "all-reduced": mixed,
                    "all-reduced, summed": [p * x for x in mixed], "no gradient through dispatch": detached_experts},
        "shared": {"one process": [shared_right] * p, "times p": [p * shared_right] * p, "own rank": own,
                   "no gradient through dispatch": [detached_shared] * p},
        "n_experts": n_experts, "n_layer": n_layer,
    }


# --- what the job measured, against the explanations ---------------------------------------------------------

def measured_losses(found: list[dict[str, Any]]) -> list[float]:
    """Each rank's own loss, in rank order."""
    return [r["local_loss"] for r in sorted(found, key=lambda r: r["rank"])]


def measured_expert_norms(found: list[dict[str, Any]], n_layer: int, n_experts: int) -> list[float | None]:
    """Each expert's gradient norm (its four tensors together), block by block, read on the rank that holds
    it; None for an expert whose gradient never arrived."""
    from ddp_course.course.l14_sequences_and_experts.experts_harness import gradient_norm

    holder = {e: r for r in found for e in r["experts"]}
    out = []
    for layer in range(n_layer):
        for e in range(n_experts):
            names = [f"blocks.{layer}{EXPERTS}{e}.{w}" for w in EXPERT_PARAMS]
            grads = holder[e]["grads"] if e in holder else {}
            arrived = all(grads.get(n, {}).get("norm") is not None for n in names)
            out.append(gradient_norm(grads, names) if arrived else None)
    return out


def measured_shared_norms(found: list[dict[str, Any]]) -> list[float]:
    """Each rank's gradient norm of the replicated parameters (every parameter but the experts)."""
    from ddp_course.course.l14_sequences_and_experts.experts_harness import gradient_norm

    return [gradient_norm(r["grads"], [n for n in r["grads"] if EXPERTS not in n])
            for r in sorted(found, key=lambda r: r["rank"])]


def _named(measured: list, candidates: dict[str, list[float]], right: str) -> tuple[str | None, str]:
    """The explanation ``measured`` is clearly nearest to (None when it is ``right`` or none is clear), and
    the margin in words."""
    found = nearest(measured, candidates)
    if not found.clear() or found.name == right:
        return None, ""
    return found.name, f" ({found.shown(LABELS)})"


def rows_problem(found: list[dict[str, Any]], refs: dict[str, Any]) -> str | None:
    """The dispatch's rows in the first block against the routers' choices: how many each expert received,
    then which (a later block's rows come from the blocks before it, which a wrong combine changes)."""
    ranks = sorted(found, key=lambda r: r["rank"])
    got = [n for r in ranks for n in r["received"][0]]
    want = [n for r in ranks for n in r["reference_received"][0]]
    if got != want:
        return (f"the experts received the wrong numbers of rows: in the first block experts 0..{len(want) - 1} got "
                f"{got}, the routers sent them {want}: the receive splits (from_rank) disagree with what the "
                f"other ranks send. They must be the counts the other ranks send you, exchanged first -- not "
                f"guessed, nor the received counts laid out in another shape. {WHY_COUNTS}")
    bad = [(r["rank"], r["rows"][0]) for r in ranks if not r["rows"][0]["ok"]]
    if not bad:
        return None
    rank, rows = bad[0]
    what = (f"{rows['misplaced']} of the {rows['rows']} rows rank {rank}'s experts received in the first block are not "
            "the rows one process gives them at those places")
    name, shown = _named(measured_losses(found), refs["losses"], "right")
    if name == "no regroup":
        return f"{what}: {LOSS_MISTAKES[name][1]}{shown}"
    return (f"{what}: each local expert must receive the rows routed to it, grouped by expert and inside a group by "
            "source rank (rank 0's first), each source's rows in their own order (a sort that is not stable may "
            "shuffle them).")


def loss_problem(losses: list[float], refs: dict[str, Any]) -> str | None:
    """The ranks' own losses against one process's and the simulations of the combine's mistakes."""
    from ddp_course.course.l14_sequences_and_experts.experts_harness import LOSS_RTOL

    name, shown = _named(losses, refs["losses"], "right")
    if name is not None:
        return f"The classic mistake: {LOSS_MISTAKES[name][1]}{shown}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, refs["losses"]["right"]))
    if worst > LOSS_RTOL:
        return (f"a rank's loss differs from one process's by {worst:.1e} (relative) although every expert received "
                "its rows: the combine does not bring each output back to its token's slot, weighted by its gate. "
                "Undo the regroup, send the rows back with the splits swapped, put row i at slot order[i], weight by "
                "the gates and add each token's k slots.")
    return None


def expert_gradient_problem(norms: list[float | None], refs: dict[str, Any]) -> str | None:
    """Each expert's gradient norm after the learner's sync (block by block; None: no gradient), against one
    process's and the explanations."""
    missing = [i for i, g in enumerate(norms) if g is None]
    if missing:
        layer, e = divmod(missing[0], refs["n_experts"])
        return (f"no gradient reached {len(missing)} expert(s) (blocks.{layer}.mlp.experts.{e} first): the combine's "
                "exchange carries no gradient back to them. dist.all_to_all_single writes into a buffer autograd does "
                "not track; use an exchange with a backward (AllToAll.apply, or "
                "torch.distributed.nn.functional.all_to_all_single).")
    name, shown = _named(norms, refs["experts"], "one process")
    if name in ("all-reduced", "all-reduced, summed"):
        return ("The classic mistake: the expert gradients were all-reduced over the ranks. Expert j of rank 0 and "
                "expert j of rank 1 are different experts that only share a shape, so all_reduce adds up different "
                "parameters' gradients. Each expert lives on one rank and the all-to-all's backward has already "
                f"brought it every rank's contribution: divide it by the world size ({NPROC}), and all-reduce only "
                "the replicated parameters." + shown)
    if name == "times p":
        return (f"The classic mistake: the expert gradients are {NPROC} times one process's: the 1/p is missing. Each "
                "expert's gradient holds the sum over the ranks of their losses' gradients (the all-to-all's backward "
                f"brought every rank's tokens' share), but the loss is their mean: divide it by the world size "
                f"({NPROC}), as the all-reduce's average does for the replicated parameters." + shown)
    return DETACHED + shown if name == "no gradient through dispatch" else None


DETACHED = ("the gradient stops at the dispatch's exchange: the rows were sent with a collective autograd does not "
            "track (dist.all_to_all_single writes into a fresh buffer), so the attention and the embeddings never "
            "learn through the experts. Send them with an exchange that has a backward (AllToAll.apply, or "
            "torch.distributed.nn.functional.all_to_all_single).")


def shared_gradient_problem(norms: list[float], refs: dict[str, Any]) -> str | None:
    """Each rank's gradient norm of the replicated parameters, against one process's and the explanations."""
    name, shown = _named(norms, refs["shared"], "one process")
    if name == "times p":
        return ("the replicated parameters' gradients are summed over the ranks, not averaged: divide them by the "
                f"world size ({NPROC}) after the all_reduce." + shown)
    if name == "own rank":
        return ("the replicated parameters' gradients were not all-reduced: each rank holds its own tokens' gradient, "
                "and the ranks' copies of the router, the attention and the embeddings would drift apart. "
                "All-reduce them and divide by the world size." + shown)
    return DETACHED + shown if name == "no gradient through dispatch" else None


def diagnose(found: list[dict[str, Any]], refs: dict[str, Any]) -> Verdict:
    """The verdict on the job's RESULT records, one per rank."""
    ranks = sorted(r["rank"] for r in found)
    if ranks != list(range(NPROC)):
        return Verdict(False, f"only ranks {ranks} reported; every rank must finish.")
    for problem in (rows_problem(found, refs), loss_problem(measured_losses(found), refs),
                    expert_gradient_problem(measured_expert_norms(found, refs["n_layer"], refs["n_experts"]), refs),
                    shared_gradient_problem(measured_shared_norms(found), refs)):
        if problem:
            return Verdict(False, problem[0].upper() + problem[1:])
    if not all(r["ok"] for r in found):
        worst = max(found, key=lambda r: r["grad_rel_err"])
        return Verdict(False, f"the gradients differ from one process's: {worst['worst_grad']} on rank "
                              f"{worst['rank']} by {worst['grad_rel_err']:.1e} (relative). Replicated parameters: "
                              "all-reduce and divide by the world size; experts: divide by the world size only.")
    return Verdict(True, f"every expert received its rows ({sum(sum(r['received'][0]) for r in found)} in the first "
                         f"block) in priority order, {sum(found[0]['dropped'])} slots dropped as in one process, and "
                         f"one step matches one process: loss {max(r['loss_rel_diff'] for r in found):.1e}, every "
                         f"gradient {max(r['grad_rel_err'] for r in found):.1e} (relative, float64).")


SPLITS_DISAGREE = ("\n" + WHY_COUNTS + " (Its row sums, one per source rank; its column sums, one per local expert, "
                   "are not splits.)")
SPLITS_SWAPPED = ("\nEach split list must add up to its own tensor's rows, on every rank: output_split_sizes, the third "
                  "argument of dist.all_to_all_single, to the output's, and input_split_sizes, the fourth, to the "
                  "input's. Passed in each other's place they do not (unless a rank sends as many rows as it "
                  "receives); PyTorch checks it as the call starts (checkSplitSizes in "
                  "torch/csrc/distributed/c10d/Utils.hpp: \"Split sizes doesn't match total dim 0 size\").")
NOT_SENT_BACK = ("\nThe experts' outputs are one row per row this rank's experts received, in dispatch's grouped order: "
                 "the slots of other ranks' tokens. This rank's own token-slots come back only through the reverse "
                 "exchange: undo the regroup, then an all_to_all with the dispatch's splits swapped (what was "
                 "received is sent back, what was sent comes back) returns exactly this rank's slots, in the order it "
                 "sent them; then put each at its slot and gate.")


def hint(output: str) -> str:
    """What a failed job's output says: the harness's check of the splits, or gloo's or PyTorch's words for
    splits that disagree, an index_copy in combine over rows that were never sent back."""
    if "all_to_all_single in dispatch" in output and "the ranks' splits disagree" in output:
        return SPLITS_DISAGREE
    if "all_to_all_single in combine" in output and "the ranks' splits disagree" in output:
        return ("\nThe way back is the dispatch's exchange reversed: every rank sends what it received (its receive "
                "splits become its send splits) and receives what it sent.")
    if "combine sent nothing back" in output:
        return NOT_SENT_BACK
    if "Received data size doesn't match expected size" in output:
        return ("\n" + COUNTS_NOT_EXCHANGED + " Here a rank expected a number of rows from another that is not what "
                "that rank sent (gloo aborts: \"Received data size doesn't match expected size\").")
    if "Split sizes doesn't match total dim 0 size" in output or re.search(r"all_to_all_single in \w+ .*add up to", output):
        return SPLITS_SWAPPED
    if "ProcessGroupGloo::scatter: invalid tensor size" in output and "all_to_all" in output:
        return ("\nNot a mistake of the exchange: gloo's list all_to_all (dist.all_to_all, and "
                "torch.distributed.nn.functional.all_to_all) is a scatter from every rank underneath and carries "
                "tensors of one size only. With uneven splits use all_to_all_single with output_split_sizes and "
                "input_split_sizes (AllToAll.apply, or torch.distributed.nn.functional.all_to_all_single).")
    if re.search(r"IndexError: index_copy_?\(\)", output) and "in combine" in output:
        return "\nLikely cause: combine put the experts' outputs at this rank's slots without sending them back first." + NOT_SENT_BACK
    return ""


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """Run the script on 4 ranks; judge its rows, its losses and its gradients."""
    found = run_exercise(path, NPROC, "dispatch(), combine() and sync_gradients()", timeout, hint=hint)
    return judged(found, lambda rows: diagnose(rows, references(path)))
