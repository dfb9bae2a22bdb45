"""What graders compute in the test's own process: their references and how they name a mistake.

A grader runs the learner's script as a job, then computes its own one-process reference (and its
simulations of the classic mistakes) here, in the grading process. The tests grade two attempts at
a time, in threads (``harness.grade_in_pairs``), so those computations must give the same numbers in
a thread beside another grader as alone; and a mistake is named by the simulation nearest to what
the job measured, with a margin (``check.nearest``), not by one tolerance tuned on one machine.
"""

from __future__ import annotations

import torch
from harness import at_once

from ddp_course import check
from ddp_course.course.tiny import tiny_model


def test_seeded_models_are_the_same_in_threads_as_alone():
    """Four threads build the same seeded model at the same moment, ten times over: every copy equals
    the one built alone. Without ``dist.seeded``'s lock, threads seeding and drawing from torch's one
    global RNG at once interleave their draws."""
    want = tiny_model(3).state_dict()
    for _ in range(10):
        for got in at_once(lambda: tiny_model(3).state_dict(), 4):
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_nearest_names_an_explanation_only_with_a_margin():
    candidates = {"right": [4.0, 4.0], "a": [4.004, 4.003], "b": [3.996, 3.996]}
    found = check.nearest([4.004001, 4.002999], candidates)
    assert (found.name, found.runner_up) == ("a", "right") and found.clear()
    assert "next nearest explanation (R)" in found.shown({"right": "R"})
    halfway = check.nearest([4.002, 4.0015], candidates)  # as near to "right" as to "a": not clear
    assert not halfway.clear()
    assert not check.nearest([None, 4.0], candidates).clear()  # a rank that measured nothing
