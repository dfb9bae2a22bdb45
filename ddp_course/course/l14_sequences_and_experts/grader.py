"""Grader of exercise 14 (``lessons/exercises/14_ring_attention.py``): the ring's forward pass by hand.

Runs the script with torchrun on 4 processes. Every rank runs the ring's loop with the learner's
``pass_on``, ``block_scores`` and ``merge`` on rings of 2 and of 4 ranks, in both layouts, in float64,
and reports its output's distance from one process's attention and from what each classic mistake
computes on the same ring (``ring_harness.mistaken``); then once more in float32 with scores in the
hundreds. The grader passes the answer that equals one process everywhere, whatever its spelling, and
otherwise names the mistake whose output the learner's equals: the causal mask by position inside the
block, no mask, blocks merged without rescaling by the log-sum-exp; or a merge right on small scores
whose float32 output is not finite, or far off, on large ones (the exponential of a log-sum-exp past
88.7 overflows float32).

A ring step that blocks on every rank never finishes, whichever call comes first. gloo executes a send
only when the peer has posted its receive (``Pair::send``, gloo's ``transport/tcp/pair.cc``), so when
every rank sends first, every rank waits in its send; when every rank receives first, each waits for a
send its peer never reaches. The job's collective timeout stops it; gloo's message says which call
timed out ("Timed out waiting 20000ms for send" or "... for recv operation to complete"), and
:func:`hint` names the order from it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ddp_course.check import Verdict, judged, run_exercise
from ddp_course.course.l14_sequences_and_experts.ring_harness import LARGE_RTOL, MISTAKES, RTOL

EXERCISE = "14_ring_attention.py"  # the script this grades: lessons/exercises/14_ring_attention.py
NPROC = 4
_L14 = "ddp_course.course.l14_sequences_and_experts"
# The course's own versions of the three answers (the lesson's ring and the send demo): an answer that calls
# them is refused (check.delegation).
DELEGATES = (f"{_L14}.ring.merge", f"{_L14}.ring._block", f"{_L14}.ring.Ring.pass_on", f"{_L14}.ring.ring_forward",
             f"{_L14}.send_first.step")
# What would state the answers before the exercise is graded: the merge's formula, the exchange that
# finishes, the mask's comparison.
GIVEAWAYS = ("logaddexp", "exp(lse_a - lse)", "exp(lse_b - lse)", "exp(lse - new", "exp(lse_blk - new",
             "exp(its lse - the new lse)", "exp(their lse - the new lse)", "subtract the larger",
             "isend/irecv", "isend and irecv", "dist.isend", "even sends first", "even ranks send first",
             "kpos[None, :] > qpos[:, None]", "masked_fill(kpos")

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
OVERFLOW = (
    "merge overflows: it is right on small scores (float64, every ring and layout: largest difference {small:.1e}), "
    "but on the float32 run, whose scores reach {largest:.0f}, its output is {what}. A log-sum-exp of such scores "
    "is in the hundreds, and exp() of anything past 88.7 is beyond float32 (its largest value, 3.4e38, is "
    "e^88.7): exp(lse) is inf, and inf/inf is NaN; below -103 it is 0, and 0/0 is NaN. Flash attention and the "
    "ring never exponentiate a log-sum-exp itself, only a difference with the larger one subtracted first: "
    "exp(lse - new) and exp(lse_blk - new) are at most 1, whatever the scores (torch.logaddexp computes the new "
    "log-sum-exp the same safe way).")
SEND_HANG = re.compile(r"for send operation|unbound_buffer|Timed out waiting|timed out", re.IGNORECASE)
RECV_HANG = re.compile(r"for recv operation", re.IGNORECASE)
WAYS_OUT = ("Post both without waiting (dist.isend and dist.irecv, then wait on both), or let even ranks send "
            "first and odd ranks receive first.")


def hint(output: str) -> str:
    """The order of the blocking calls, from gloo's words for the call that timed out."""
    if RECV_HANG.search(output) and not re.search(r"for send operation", output, re.IGNORECASE):
        return ("\nLikely cause: every rank waited in recv before any rank sent. A blocking dist.recv returns only "
                "when the previous rank's send arrives, and that rank was itself waiting in its own recv, before "
                "its send: a recv before the send on every rank deadlocks the ring. " + WAYS_OUT)
    if SEND_HANG.search(output):
        return ("\nLikely cause: every rank sent before it received. gloo executes a send only when the peer has "
                "posted its receive (Pair::send in gloo's transport/tcp/pair.cc), so when all ranks send first, all "
                "of them wait in their send. " + WAYS_OUT)
    return ""


def _large_problem(found: list[dict[str, Any]], small: float) -> Verdict | None:
    """The verdict on a merge right in float64 that fails the float32 run with large scores, or None."""
    large = [r["large"] for r in found]
    bad = [x for x in large if not x["finite"] or x["error"] > LARGE_RTOL]
    if not bad:
        return None
    worst = max((x["error"] for x in large if x["finite"]), default=None)
    what = ("not finite (inf or NaN) on " + ("every rank" if len(bad) == len(found) else f"{len(bad)} of the ranks")
            if any(not x["finite"] for x in bad) else
            f"{worst:.1e} (relative) from one process's attention, where float32's rounding leaves a right answer "
            f"within {LARGE_RTOL:g}")
    return Verdict(False, OVERFLOW.format(small=small, largest=max(x["largest_score"] for x in large), what=what))


def diagnose(found: list[dict[str, Any]]) -> Verdict:
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    errors = {key: max(r["errors"][key] for r in found) for key in found[0]["errors"]}
    if max(errors.values()) <= RTOL:
        large = _large_problem(found, max(errors.values()))
        if large is not None:
            return large
        return Verdict(True, f"your ring's output equals one process's attention on rings of 2 and 4 ranks, plain "
                             f"and zigzag (largest difference {max(errors.values()):.1e}, float64), and holds in "
                             f"float32 with scores up to {max(r['large']['largest_score'] for r in found):.0f} "
                             f"({max(r['large']['error'] for r in found):.1e}).")
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
