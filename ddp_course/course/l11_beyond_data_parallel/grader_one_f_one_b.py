"""Grader of exercise 11's second part (``lessons/exercises/11_one_f_one_b.py``): 1F1B written by hand.

Runs the script with torchrun on 2 processes, then (if that passes) on 4. Every rank reports, for
each m of the script's ``MICRO_BATCHES`` (one of them smaller than 4): the order in which its stage
ran forwards (F) and backwards (B), the most activations autograd held for backward at once (in
micro-batches, counted by the harness), the norm of its stage's gradients, their relative error from
the harness's one-process reference, and on the last stage the loss. The grader computes the loss
and every stage's gradient norm itself, in this process, on one unsplit model built from the same
seed and batch, and checks, naming the mistake behind what it measured:

- every rank finishes (a crash shows the learner's line; a hang, where each rank was waiting, with
  the usual cause of a pipeline's: a receive that waits for a send its peer makes only later);
- each micro-batch has one forward and one backward on every stage;
- the gradients are the whole batch's: nearest (``check.nearest``, by a clear margin) to the
  right scale, to m times it (micro-batch losses not divided by m) or to 1/m of it (divided twice);
  else some stage's gradients are wrong (a backward that ran with a gradient that had not arrived);
- the last stage's loss is the batch's mean loss;
- each rank's order is 1F1B's (``schedules_lab.one_f_one_b_order``): GPipe's order, and a warm-up
  one forward too long or too short, are named;
- each rank held at most as many micro-batches as its order needs (a stage that keeps every
  micro-batch's graph alive holds GPipe's memory in 1F1B's order).

The verdict carries the jobs' RESULT rows (``verdict.records``, the 4-rank run's when it ran).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ddp_course.check import GradedRun, Verdict, nearest, run_exercise

EXERCISE = "11_one_f_one_b.py"
# The course's own versions of the answer: the lab's runner of any order, its 1F1B order, GPipe by hand.
DELEGATES = ("ddp_course.course.l11_beyond_data_parallel.schedules_lab.hand_step",
             "ddp_course.course.l11_beyond_data_parallel.schedules_lab.one_f_one_b_order")
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): the warm-up's
# length, the lesson's listing of the orders.
GIVEAWAYS = ("p - 1 - rank", "p − 1 − s", "p - 1 - s", "world_size - 1 - rank", "p − 1 − rank",
             "F F F F B F B", "holds at most p")
SIZES = (2, 4)
# A stage may hold a few percent more than its count of micro-batches: one micro-batch's bytes differ
# a little between the first stage (token ids in) and the others (activations in). Measured on the
# solution: at most 0.02 above the count. Keeping one more micro-batch is +1.
HELD_SLACK = 0.25
HANG_HINT = ("\nA pipeline step waits for ever when two neighbouring stages each wait to receive from the other: "
             "dist.send can wait until its peer receives (gloo's does, for the activations here), so two stages "
             "sending to each other at once (an activation forward, a gradient back) both wait; and a receive waits for a send its peer "
             "makes only later. Start sends with dist.isend and wait for them at the end of the step; receive "
             "where the value is needed.")


def harness_constants(path: str | Path) -> dict:
    """SHAPE, BATCH, SEED, MICRO_BATCHES, TOLERANCE as the script sets them (read, not run)."""
    from ddp_course.check.reference import harness_constants as read

    return read(path)


@functools.lru_cache(maxsize=4)
def _reference(key: str) -> dict:
    """One process, the whole model on the whole batch: the loss and, for each p of SIZES, each stage's
    gradient norm (the tied matrix's whole gradient on both ends)."""
    from ddp_course.course.l11_beyond_data_parallel.pp_lab import Stage
    from ddp_course.course.tiny import micro_batch, tiny_model

    c = json.loads(key)
    model = tiny_model(c["SEED"], **c["SHAPE"])
    x, y = micro_batch(0, 0, micro_batch_size=c["BATCH"], block_size=c["SHAPE"]["block_size"], seed=c["SEED"])
    _, loss = model(x, y)
    loss.backward()
    norms = {}
    for p in SIZES:
        norms[str(p)] = [float(sum(q.grad.double().pow(2).sum() for q in Stage(model, s, p).parameters()) ** 0.5)
                         for s in range(p)]
    return {"loss": loss.item(), "norms": norms}


def references(path: str | Path) -> dict:
    return _reference(json.dumps(harness_constants(path), sort_keys=True))


def expected_order(m: int, p: int, rank: int) -> str:
    from ddp_course.course.l11_beyond_data_parallel.schedules_lab import one_f_one_b_order

    return "".join(one_f_one_b_order(m, p, rank))


def _held_needed(order: str) -> int:
    live = most = 0
    for op in order:
        live += 1 if op == "F" else -1
        most = max(most, live)
    return most


def _scale_problem(ranks: dict[int, dict], ref: dict, p: int) -> str | None:
    """The gradients' scale against the whole batch's: m times (not divided), 1/m (twice), or right."""
    measured, right, big, small = [], [], [], []
    for rank, r in sorted(ranks.items()):
        for run in r["runs"]:
            want = ref["norms"][str(p)][rank]
            measured.append(run["grad_norm"])
            right.append(want)
            big.append(want * run["m"])
            small.append(want / run["m"])
    found = nearest(measured, {"right": right, "not_divided": big, "twice": small})
    if found.name == "right" or not found.clear():
        return None
    ms = sorted({run["m"] for r in ranks.values() for run in r["runs"]})
    if found.name == "not_divided":
        return (f"every stage's gradients are m times the whole batch's (with m = {', '.join(map(str, ms))}): the "
                "micro-batch losses were not divided by m. Each micro-batch's backward adds its gradient to .grad; "
                "for the sum over m micro-batches to be the gradient of the batch's MEAN loss, divide each "
                f"micro-batch's loss by m before its backward ({found.shown()}).")
    return (f"every stage's gradients are 1/m of the whole batch's (with m = {', '.join(map(str, ms))}): the loss was "
            "divided by m twice (e.g. the micro-batch's loss divided by m, and the gradient or the loss divided "
            f"again). Divide each micro-batch's loss by m once, before its backward ({found.shown()}).")


def diagnose(found: list[dict], constants: dict, p: int) -> Verdict:
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(p)):
        return Verdict(False, f"on {p} ranks only ranks {sorted(ranks)} reported; every rank must finish.")
    ref = _reference(json.dumps(constants, sort_keys=True))
    tol = constants["TOLERANCE"]
    for rank, r in sorted(ranks.items()):
        for run in r["runs"]:
            f, b = run["order"].count("F"), run["order"].count("B")
            if f != run["m"] or b != run["m"]:
                return Verdict(False, f"on {p} ranks with m = {run['m']} micro-batches, rank {rank} ran {f} forward(s) "
                                      f"and {b} backward(s) (order {run['order']}): every micro-batch needs exactly "
                                      "one forward and one backward on every stage, whatever m is"
                                      + (" -- and m may be smaller than the number of stages: then the warm-up "
                                         "cannot be longer than m." if run["m"] < p else "."))
            if run["missing_grads"]:
                return Verdict(False, f"on {p} ranks, rank {rank}'s parameters {run['missing_grads'][:3]} got no "
                                      "gradient: run each micro-batch's backward through the stage's own output.")
    scale = _scale_problem(ranks, ref, p)
    if scale:
        return Verdict(False, f"on {p} ranks, " + scale)
    for rank, r in sorted(ranks.items()):
        for run in r["runs"]:
            want = ref["norms"][str(p)][rank]
            err = run["grad_rel_err"]
            if err is None or err > tol or abs(run["grad_norm"] - want) > tol * want:
                shown = "of the wrong shape" if err is None else f"{err:.2e} (relative) from one process's"
                return Verdict(False, f"on {p} ranks with m = {run['m']}, rank {rank}'s gradients are {shown}, "
                                      f"though their scale is right: a backward ran with a gradient that had not "
                                      "arrived (an output gradient used before its receive completed, or never "
                                      "received), or was sent to or taken from the wrong micro-batch. Receive the "
                                      "gradient of micro-batch i's output, then run micro-batch i's backward with "
                                      "it; backwards go in the same order as forwards.")
    last = ranks[p - 1]
    for run in last["runs"]:
        if run["loss"] is None or abs(run["loss"] - ref["loss"]) > tol * ref["loss"]:
            return Verdict(False, f"on {p} ranks with m = {run['m']}, the last stage returned the loss {run['loss']} "
                                  f"but the batch's mean loss is {ref['loss']:.6f} (the grader's one-process "
                                  "reference): return the sum of the micro-batches' losses, each divided by m (a "
                                  "float, e.g. with .item()).")
    for rank, r in sorted(ranks.items()):
        for run in r["runs"]:
            want = expected_order(run["m"], p, rank)
            if run["order"] == want:
                continue
            gpipe = "F" * run["m"] + "B" * run["m"]
            if run["order"] == gpipe and gpipe != want:
                return Verdict(False, f"on {p} ranks with m = {run['m']}, rank {rank} ran every forward before any "
                                      f"backward ({run['order']}): that is GPipe's order, which holds all m micro-"
                                      "batches' activations. In 1F1B a stage starts backwards as soon as the first "
                                      f"gradient can reach it: here {want}.")
            first_b, first_b_want = run["order"].index("B"), want.index("B")
            if first_b != first_b_want:
                return Verdict(False, f"on {p} ranks with m = {run['m']}, rank {rank} ran {first_b} forward(s) before "
                                      f"its first backward, 1F1B runs {first_b_want}: the warm-up is off by "
                                      f"{abs(first_b - first_b_want)}. Stage s of p can run p - 1 - s forwards before "
                                      "the gradient of its first micro-batch comes back (never more than m), then "
                                      "one forward and one backward in turn. Its order here: "
                                      f"{want}; yours: {run['order']}.")
            return Verdict(False, f"on {p} ranks with m = {run['m']}, rank {rank}'s order {run['order']} is not "
                                  f"1F1B's {want}: after the warm-up, one forward then one backward in turn, then the "
                                  "backwards still owed.")
    for rank, r in sorted(ranks.items()):
        for run in r["runs"]:
            need = _held_needed(run["order"])
            if run["held"] > need + HELD_SLACK:
                return Verdict(False, f"on {p} ranks with m = {run['m']}, rank {rank} held {run['held']:.2f} micro-"
                                      f"batches' activations at once, though 1F1B's order lets it hold {need}: every "
                                      "micro-batch's graph was kept alive (GPipe's memory in 1F1B's order). After a "
                                      "micro-batch's backward, let autograd free what it saved: no retain_graph=True "
                                      "(a backward without it frees the graph's saved tensors), and no reference left "
                                      "to a micro-batch's output or input in your lists or dicts once its backward "
                                      "has run.")
    return Verdict(True, "")


def _passed(runs: dict[int, list[dict]], constants: dict) -> str:
    parts = []
    for p, found in runs.items():
        held = ", ".join(f"{max(run['held'] for run in r['runs'] if run['m'] >= p):.2f}"
                         for r in sorted(found, key=lambda r: r["rank"]))
        err = max(run["grad_rel_err"] for r in found for run in r["runs"])
        parts.append(f"on {p} ranks every stage's gradients within {err:.1e} of one process's and activations "
                     f"held at most {held} micro-batches (stage by stage)")
    ms = ", ".join(map(str, constants["MICRO_BATCHES"]))
    return (f"1F1B's order on every rank, with m = {ms}; " + "; ".join(parts)
            + f"; the last stage's loss is the grader's one-process loss ({_reference(json.dumps(constants, sort_keys=True))['loss']:.6f}).")


def _hint(nproc: int):
    def hint(output: str) -> str:
        if "IndexError" in output and nproc > 2:
            return (f" On {nproc} ranks the harness also runs m = 2 micro-batches, fewer than the stages: the warm-up "
                    "cannot be longer than m.")
        return ""
    return hint


def grade(path: str | Path, timeout: float = 120) -> Verdict:
    """Run the script on 2 ranks, then on 4; compare with the grader's own one-process reference."""
    constants = harness_constants(path)
    runs: dict[int, list[dict]] = {}
    for p in SIZES:
        found = run_exercise(path, p, "one_f_one_b_step", timeout, hint=_hint(p))
        if isinstance(found, Verdict):
            waited = any(w in found.message for w in ("stopped making progress", "did not finish", "Timed out"))
            return Verdict(False, f"on {p} ranks: {found.message}{HANG_HINT if waited else ''}")
        verdict = diagnose(found, constants, p)
        if not verdict.ok:
            return GradedRun(False, verdict.message, found)
        runs[p] = found
    return GradedRun(True, _passed(runs, constants), runs[SIZES[-1]])
