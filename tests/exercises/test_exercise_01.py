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


def test_each_wrong_value_is_named_by_its_own_mistake(monkeypatch):
    """The grader used to ask "are you averaging per-rank means?" for every wrong value. Now each classic
    mistake, simulated on the grader's own window losses, is named by itself (on every rank and world
    size, with float32 rounding on top), and a value none of them explains is named by none (no job here)."""
    from ddp_course.course.l01_minigpt import grader

    losses = grader.reference_losses()
    for nproc in (2, 3):
        for name, (fn, text) in grader.MISTAKES.items():
            for rank in range(nproc):
                value = fn(losses, rank, nproc)
                said = grader.explain(value * (1 + 1e-7), rank, nproc, losses)
                assert text in said, (name, nproc, rank, said)
                others = [t for n, (_, t) in grader.MISTAKES.items() if n != name]
                assert not any(t in said for t in others), (name, said)
    assert "none of the classic mistakes" in grader.explain(1.234, 0, 2, losses)
    # through grade(), a job whose ranks each return their own mean
    forged = [{"rank": r, "result": losses[r::2].mean().item(), "ok": False} for r in range(2)]
    monkeypatch.setattr(grader, "run_exercise", lambda *a, **k: forged)
    verdict = grader.grade("01_global_val_loss.py")
    assert "each rank returned the mean of its own windows" in verdict.message and "per-rank means" not in verdict.message
