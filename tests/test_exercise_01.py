"""Exercise 01's grader passes the solution, and fails the learner's copy and a plausible wrong answer.

The answered solution is the file lesson 01's grading cell grades in ``make test``: its verdict is
read from there when that cell graded the same file in this session (``notebook_runs.grade``).
"""

from __future__ import annotations

import notebook_runs
from harness import ROOT, answered_exercise

from ddp_course.check import grade

SOLUTION = ROOT / "solutions" / "exercises" / "01_global_val_loss.py"


def test_solution_passes(tmp_path):
    path = tmp_path / SOLUTION.name
    path.write_text(answered_exercise(SOLUTION.name))
    verdict = notebook_runs.grade("01", path, timeout=120)
    assert verdict.ok, verdict.message


def test_mean_of_means_fails(tmp_path):
    # The classic mistake: average the per-rank means. With uneven shards it is wrong.
    src = SOLUTION.read_text()
    start = src.index("    # BEGIN SOLUTION")
    end = src.index("    # END SOLUTION") + len("    # END SOLUTION")
    wrong = ("    mean = (local_sum / local_count).detach().double()\n"
             "    dist.all_reduce(mean, op=dist.ReduceOp.SUM)\n"
             "    return (mean / dist.get_world_size()).item()")
    broken = tmp_path / "broken.py"
    broken.write_text(src[:start] + wrong + src[end:])
    verdict = grade("01", broken, timeout=120)
    assert not verdict.ok
    assert "per-rank means" in verdict.message


def test_learner_copy_is_not_yet_done():
    verdict = grade("01", ROOT / "lessons" / "exercises" / "01_global_val_loss.py", timeout=120)
    assert not verdict.ok and "TODO" in verdict.message


def test_the_grader_trusts_its_own_mean_not_the_scripts_claims(monkeypatch):
    """A script that says ok and reports its own result as the reference still fails: the grader
    compares every rank's result with the mean it computes itself (no job starts here)."""
    from ddp_course.course.l01_minigpt import grader

    want = grader.reference_mean()
    forged = [{"rank": r, "result": want + 1e-3, "reference": want + 1e-3, "ok": True} for r in range(2)]
    monkeypatch.setattr(grader, "run_exercise", lambda *a, **k: forged)
    verdict = grader.grade("01_global_val_loss.py")
    assert not verdict.ok and f"the mean over all windows is {want:.6f}" in verdict.message
    monkeypatch.setattr(grader, "run_exercise", lambda *a, **k: [dict(x, result=want) for x in forged])
    assert grader.grade("01_global_val_loss.py").ok
