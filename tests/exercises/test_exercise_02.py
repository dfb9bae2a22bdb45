"""Exercise 02 (the ring all-reduce): the grader passes the answered file and names what a broken ring
does -- a missing all-gather, chunks floor-divided so that the remainder never goes round.

The answered file is the one lesson 02's grading cell grades in ``make test``: its verdict is read from
there when that cell graded the same file in this session (``notebook_runs.grade``).
"""

from __future__ import annotations

import notebook_runs
from harness import ROOT, answered_exercise

RING_SOLUTION = ROOT / "solutions" / "exercises" / "02_ring_allreduce.py"


def test_ring_grader_passes_solution_and_explains_a_missing_all_gather(tmp_path):
    from ddp_course.check import grade

    answered = tmp_path / RING_SOLUTION.name
    answered.write_text(answered_exercise(RING_SOLUTION.name))
    verdict = notebook_runs.grade("02", answered)
    assert verdict.ok, verdict.message
    assert "1.00x with 2 ranks" in verdict.message and "1.50x with 4 ranks" in verdict.message

    src = RING_SOLUTION.read_text()
    start, end = src.index("    # all-gather:"), src.index("    # END SOLUTION")
    broken = tmp_path / "02_no_all_gather.py"
    broken.write_text(src[:start] + src[end:])  # reduce-scatter only: one finished chunk per rank
    verdict = grade("02", broken)
    assert not verdict.ok
    assert "all-gather phase is missing" in verdict.message, verdict.message


def test_ring_grader_names_floor_divided_chunks_not_a_missing_all_gather(tmp_path):
    """Chunks of length size // n leave the remainder out of the ring; every rank then holds the same
    one right chunk, which the grader used to read as a missing all-gather."""
    from ddp_course.check import grade

    src = answered_exercise(RING_SOLUTION.name)
    floor = src.replace("chunks = x.tensor_split(n)",
                        "c = x.numel() // n\n    chunks = [x[i * c:(i + 1) * c] for i in range(n)]")
    assert floor != src
    broken = tmp_path / RING_SOLUTION.name
    broken.write_text(floor)
    verdict = grade("02", broken)
    assert not verdict.ok and "never went round the ring" in verdict.message, verdict.message
    assert "all-gather phase is missing" not in verdict.message
