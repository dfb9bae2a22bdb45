"""Grader of exercise 06 (``lessons/exercises/06_no_sync.py``): accumulation with no_sync under DDP.

Runs the script with torchrun on 2 processes. Every rank reports, for each case (K = 4 with and
without no_sync, a leftover step of 3 with no_sync), which micro-steps all-reduced (counted by a
DDP communication hook) and its gradient. The grader checks

- the all-reduce count: only the last micro-step with no_sync (1 per optimizer step), every one of
  the K micro-steps without;
- the gradient: equal to one big batch's, against the script's own comparison *and* against a
  reference the grader computes itself (per-parameter gradient norms, in this process);

and, when something is off, names the mistake that produces exactly that measurement.
"""

from __future__ import annotations

from pathlib import Path

from ddp_course.check import Verdict, run_exercise

EXERCISE = "06_no_sync.py"  # the script this grades: lessons/exercises/06_no_sync.py

# The course's own accumulation loops (the lab's, the correct one among them): an accumulate() that calls
# it is refused. Its arguments differ from the exercise's (ddp, batches, variant, k), so it is named here.
DELEGATES = ("ddp_course.course.l06_grad_accumulation.no_sync_lab.accumulate",)
# What would state the answer -- where no_sync() must go -- before the exercise is graded.
GIVEAWAYS = ("forward included", "forward of every non-final micro-step", "enclose the *forward*",
             "enclose the forward", "forward and backward inside", "forward *and* backward inside")

NPROC = 2
# what the exercise's harness runs: (name, micro-batch indices, use_no_sync), and its data
EXPECTED_CASES = [("K=4 with no_sync", [0, 1, 2, 3], True), ("K=4 without no_sync", [0, 1, 2, 3], False),
                  ("leftover of 3 with no_sync", [4, 5, 6], True)]
DATA = {"micro_batch_size": 4, "block_size": 32, "seed": 0}
GRAD_RTOL = 1e-5  # |g - g_ref| / |g_ref|: summation order alone gives ~1e-7 (see ddp_course.course.l06_grad_accumulation.no_sync_lab)
NORM_RTOL = 1e-4  # per-parameter gradient norms, grader's reference vs the script's (same reasoning, per tensor)

WHY_FORWARD = ("DDP decides during the *forward* whether the coming backward will all-reduce: the forward reads "
               "model.require_backward_grad_sync and, if it is True, prepares the reducer, whose hooks then "
               "all-reduce in backward whatever context the backward runs in. ")


def _reference_norms(world_size: int) -> list[dict[str, float]]:
    """Per-parameter gradient norms of one big batch for each case, computed here, in one process."""
    from ddp_course.course.l06_grad_accumulation.grad_check import reference_gradient, tiny_model

    model = tiny_model(DATA["seed"], block_size=DATA["block_size"])
    out = []
    for _, indices, _ in EXPECTED_CASES:
        g = reference_gradient(model, indices, world_size, **DATA)
        out.append({n: t.norm().item() for n, t in g.items()})
    return out


def _count_problem(case: dict, n_buckets: int) -> str | None:
    """Explain a wrong all-reduce pattern, or None if the pattern is right."""
    k, synced, no_sync = case["micro_batches"], case["synced_micro_steps"], case["use_no_sync"]
    every = list(range(k))
    rounds = case["bucket_all_reduces"] / max(1, n_buckets)
    if case["forwards"] != k:
        return (f"{case['name']}: your code ran {case['forwards']} forward pass(es) for {k} micro-batches; "
                "run exactly one forward and one backward per micro-batch.")
    if not no_sync:
        if synced == every:
            return None
        return (f"{case['name']}: with use_no_sync=False every micro-step should all-reduce (DDP's default), "
                f"but only micro-step(s) {synced} did. Enter model.no_sync() only when use_no_sync is True.")
    if synced == [k - 1]:
        return None
    if synced == every:
        return (f"{case['name']}: every one of the {k} micro-steps all-reduced ({rounds:.0f} all-reduces for one "
                f"optimizer step instead of 1), so no_sync saved nothing -- the classic silent bug: the gradient "
                "comes out right, only the traffic is K times too much. " + WHY_FORWARD +
                "Entering model.no_sync() only around loss.backward(), or setting require_backward_grad_sync "
                "after the forward, comes too late. Put the forward AND the backward of every non-final "
                "micro-step inside `with model.no_sync():`.")
    if not synced:
        return (f"{case['name']}: no micro-step all-reduced at all, so each rank kept its own local gradient. "
                + WHY_FORWARD + "Your last micro-step's forward ran inside model.no_sync() (leaving the context "
                "before the backward does not undo that decision). Run the last micro-step's forward and "
                "backward outside no_sync().")
    if synced == [0]:
        return (f"{case['name']}: only the FIRST micro-step all-reduced, not the last. That is what setting "
                "model.require_backward_grad_sync between the forward and the backward does: " + WHY_FORWARD +
                "So the flag you set at micro-step i only takes effect at micro-step i+1: the first micro-step "
                "syncs (the flag is still True from before), the last one does not, and the gradients of the "
                "other micro-steps never leave their rank. Use `with model.no_sync():` around the forward and "
                "backward of the non-final micro-steps (or set the flag before the forward).")
    return (f"{case['name']}: micro-step(s) {synced} all-reduced; with no_sync only the last one ({k - 1}) "
            "should. " + WHY_FORWARD + "Run forward and backward of every micro-step except the last inside "
            "`with model.no_sync():`, and the last one outside it.")


def _grad_problem(case: dict, ranks: list[dict], ref_norms: dict[str, float], index: int) -> str | None:
    """Explain a wrong accumulated gradient, or None if it matches one big batch."""
    k = case["micro_batches"]
    errs = [r["cases"][index]["rel_err"] for r in ranks]
    off = {n: (v, ref_norms[n]) for n, v in case["param_grad_norms"].items()
           if n in ref_norms and abs(v - ref_norms[n]) > NORM_RTOL * max(ref_norms[n], 1e-12)}
    if max(errs) <= GRAD_RTOL and not off and set(case["param_grad_norms"]) == set(ref_norms):
        return None
    ratio = case["norm_ratio"]
    spread = max(r["cases"][index]["replica_max_diff"] for r in ranks)
    head = (f"{case['name']}: the accumulated gradient is not the big batch's (relative error {max(errs):.2g}, "
            f"norm {ratio:.3f} x the big batch's). ")
    if abs(ratio - k) < 0.02 * k:
        return head + (f"It is {k} times too large: divide each micro-batch's loss by the number of micro-batches "
                       f"({k}), so the {k} backward passes add up to the gradient of the mean.")
    if index == 2 and abs(ratio - 3 / 4) < 0.02:
        return head + ("The leftover step has 3 micro-batches, and its gradient is 3/4 of the mean: you divided "
                       "by a fixed K = 4. Divide by the number of micro-batches in *this* step, len(micro_batches).")
    if abs(ratio - 1 / k) < 0.02 / k:
        return head + f"It is {k} times too small: the loss was divided by {k} twice (or by {k}**2)."
    if spread > 0:
        return head + (f"The replicas disagree (by up to {spread:.2g} per element): a micro-step's gradient stayed "
                       "on its rank. Check that the last micro-step all-reduces.")
    names = ", ".join(list(off)[:3])
    return head + (f"Parameters off: {names or '(see the relative error)'}. Each micro-batch needs one forward "
                   "and one backward of loss / len(micro_batches), nothing else.")


def diagnose(found: list[dict]) -> Verdict:
    """The verdict from the RESULT lines of every rank."""
    ranks = sorted(found, key=lambda r: r["rank"])
    first = ranks[0]
    cases = first["cases"]
    got = [(c["name"], c["indices"], c["use_no_sync"]) for c in cases]
    if got != EXPECTED_CASES or first.get("data") != DATA:
        return Verdict(False, f"the script ran the cases {got} on data {first.get('data')}, not {EXPECTED_CASES} "
                              f"on {DATA}: the harness below "
                              "accumulate() was changed. Restore it from lessons/exercises/06_no_sync.py and change "
                              "only the body of accumulate().")
    ref = _reference_norms(first["world_size"])
    for r in ranks:  # counts: the hook runs on every rank, and every rank must agree
        for c in r["cases"]:
            problem = _count_problem(c, r["n_buckets"])
            if problem:
                return Verdict(False, problem)
    for i, c in enumerate(cases):
        problem = _grad_problem(c, ranks, ref[i], i)
        if problem:
            return Verdict(False, problem)
    worst = max(c["rel_err"] for r in ranks for c in r["cases"])
    b = first["n_buckets"]
    return Verdict(True, f"with no_sync only the last micro-step all-reduced ({b} bucket all-reduce(s) per optimizer "
                         f"step, against {4 * b} for K = 4 without no_sync), and the accumulated gradient equals one "
                         f"big batch's on every rank (relative error at most {worst:.1e}), also for the leftover step "
                         f"of 3 micro-batches.")


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """Run the script on 2 processes and grade what it measured."""
    found = run_exercise(path, NPROC, "accumulate()", timeout)
    if isinstance(found, Verdict):
        return found
    return diagnose(found)
