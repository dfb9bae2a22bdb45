"""Grader of exercise 14 (``lessons/exercises/14_ring_attention.py``): the ring's forward pass by hand.

Runs the script with torchrun on 4 processes. Every rank runs the lesson's ring loop with the learner's
``pass_on``, ``block_scores`` and ``merge`` on rings of 2 and of 4 ranks, in both layouts, and reports
its output's distance from one process's attention, and from what the same ring computes with each
classic mistake in place (``ring_harness.MISTAKES``). The grader passes the answer that equals one
process everywhere, whatever its spelling, and otherwise names the mistake whose output the learner's
equals: the causal mask by position inside the block, no mask, blocks merged without rescaling by the
log-sum-exp. A ring step that blocks in a send on every rank never finishes: gloo executes a send only
when the peer has posted its receive (``Pair::send``, gloo's ``transport/tcp/pair.cc``), so every rank
waits in its send; the job's collective timeout stops it and the verdict shows where each rank waited.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ddp_course.check import Verdict, judged, run_exercise
from ddp_course.course.l14_sequences_and_experts.ring_harness import MISTAKES, RTOL

EXERCISE = "14_ring_attention.py"  # the script this grades: lessons/exercises/14_ring_attention.py
NPROC = 4

WHY = {
    "mask by local position": (
        "block_scores masks by the position inside the block: every block is masked as if it were on the "
        "diagonal, so a query loses keys of earlier chunks that it should see. Mask with the positions in the "
        "whole sequence: -inf where kpos[j] > qpos[i]."),
    "no causal mask": (
        "block_scores masks nothing: on the diagonal blocks a query also attends to the keys after it. Put -inf "
        "where kpos[j] > qpos[i]."),
    "merge without rescaling (sum)": (
        "merge adds the block outputs as they are: each was normalised by its own block's softmax sum, so the "
        "sum weighs every block alike. Rescale both by exp(their lse - the new lse) before adding."),
    "merge without rescaling (mean)": (
        "merge averages the running output with the block's: the weights must be each part's share of the "
        "softmax sum, exp(lse - new) and exp(lse_blk - new), not 1/2 each."),
}
SEND_HANG = re.compile(r"unbound_buffer|Timed out waiting|timed out", re.IGNORECASE)


def hint(output: str) -> str:
    if SEND_HANG.search(output):
        return ("\nLikely cause: every rank sent before it received. gloo executes a send only when the peer has "
                "posted its receive (Pair::send in gloo's transport/tcp/pair.cc), so when all ranks send first, all "
                "of them wait in their send. Post "
                "both without waiting (dist.isend and dist.irecv, then wait on both), or let even ranks send first "
                "and odd ranks receive first.")
    return ""


def diagnose(found: list[dict[str, Any]]) -> Verdict:
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    errors = {key: max(r["errors"][key] for r in found) for key in found[0]["errors"]}
    if max(errors.values()) <= RTOL:
        return Verdict(True, f"your ring's output equals one process's attention on rings of 2 and 4 ranks, plain "
                             f"and zigzag (largest difference {max(errors.values()):.1e}, float64).")
    off = ", ".join(f"{k}: {e:.1e}" for k, e in errors.items())
    distance = {name: max(r["mistakes"][key][name] for r in found for key in errors) for name in MISTAKES}
    name = min(distance, key=distance.get)
    if distance[name] <= RTOL:
        return Verdict(False, f"{WHY[name]} Your output equals what that mistake computes on every ring "
                              f"(difference from one process: {off}).")
    return Verdict(False, f"the ring's output differs from one process's ({off}), and from each classic mistake's "
                          "too. Check block_scores (the scores scaled by 1/sqrt(D), -inf where a key comes after "
                          "its query in the whole sequence) and merge (both outputs weighted by exp(their lse - the "
                          "new lse)); a difference only on rings of 4 ranks points at pass_on.")


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """Run the script on 4 ranks; judge its outputs against one process and the classic mistakes."""
    found = run_exercise(path, NPROC, "pass_on(), block_scores() and merge()", timeout, hint=hint)
    return judged(found, diagnose)
