"""Exercise 06 (no_sync): the grader passes the solution and names each classic mistake -- no_sync
around backward only, each all-reduce pattern, each gradient-scale mistake -- from what the job measured.

Lesson 06's grading cells grade the answered solution and the same one-mistake attempt (no_sync around
the backward only): in ``make test`` their verdicts are read from there when those cells graded the same
files in this session (``notebook_runs.grade``).
"""

from __future__ import annotations

import notebook_runs
import pytest
from harness import ROOT, answered_exercise, exercise_attempt

SOLUTION = ROOT / "solutions" / "exercises" / "06_no_sync.py"


BACKWARD_ONLY = '''    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        _, loss = model(x, y)  # forward outside no_sync(): DDP has already decided to all-reduce
        with model.no_sync() if use_no_sync and i < n - 1 else contextlib.nullcontext():
            (loss / n).backward()
'''


@pytest.mark.timeout(150)
def test_grader_passes_the_solution(tmp_path):
    path = tmp_path / SOLUTION.name
    path.write_text(answered_exercise(SOLUTION.name))
    verdict = notebook_runs.grade("06", path, timeout=120)
    assert verdict.ok, verdict.message
    assert "only the last micro-step all-reduced" in verdict.message


@pytest.mark.timeout(150)
def test_grader_detects_no_sync_around_backward_only_and_says_why(tmp_path):
    verdict = notebook_runs.grade("06", exercise_attempt(tmp_path, SOLUTION.name, "accumulate", BACKWARD_ONLY),
                                  timeout=120)
    assert not verdict.ok
    for phrase in ("every one of the 4 micro-steps all-reduced", "classic silent bug", "during the *forward*",
                   "forward AND the backward"):
        assert phrase in verdict.message, (phrase, verdict.message)


@pytest.mark.parametrize("synced, use_no_sync, phrase", [
    ([3], True, None),
    ([0, 1, 2, 3], False, None),
    ([0, 1, 2, 3], True, "classic silent bug"),
    ([], True, "no micro-step all-reduced at all"),
    ([0], True, "only the FIRST micro-step"),
    ([1, 3], True, "should. "),
    ([3], False, "with use_no_sync=False every micro-step should all-reduce"),
])
def test_grader_names_each_all_reduce_pattern(synced, use_no_sync, phrase):
    from ddp_course.course.l06_grad_accumulation.grader import _count_problem

    case = {"name": "K=4", "micro_batches": 4, "use_no_sync": use_no_sync, "synced_micro_steps": synced,
            "bucket_all_reduces": len(synced), "forwards": 4}
    problem = _count_problem(case, n_buckets=1)
    assert (problem is None) if phrase is None else (phrase in problem), problem


@pytest.mark.parametrize("index, k, ratio, phrase", [
    (0, 4, 4.0, "It is 4 times too large: divide each micro-batch's loss"),
    (2, 3, 0.75, "you divided by a fixed K = 4"),
    (0, 4, 1.0, None),
])
def test_grader_names_each_gradient_scale_mistake(index, k, ratio, phrase):
    from ddp_course.course.l06_grad_accumulation.grader import _grad_problem

    ref = {"w": 2.0, "b": 1.0}
    exact = phrase is None
    case = {"name": "case", "micro_batches": k, "norm_ratio": ratio, "rel_err": 1e-7 if exact else abs(ratio - 1),
            "replica_max_diff": 0.0, "param_grad_norms": {n: v * ratio for n, v in ref.items()}}
    ranks = [{"cases": [case] * 3}, {"cases": [case] * 3}]
    problem = _grad_problem(case, ranks, ref, index)
    assert (problem is None) if exact else (phrase in problem), problem
