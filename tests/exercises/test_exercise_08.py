"""Exercise 08's grader accepts the solution and rejects each classic mistake of saving and loading,
saying which one it is.

Every wrong attempt is the answered solution with ONE function body replaced. The diagnosis of the
resumed run's RESULT rows (each part of the state left out) is also checked without a job in
``tests/core/test_checkpoint.py::test_grader_diagnoses_each_missing_part``. The answered solution is the
file lesson 08's grading cell grades in ``make test``: its verdict is read from there when that cell
graded the same file in this session (``notebook_runs.grade``).
"""

from __future__ import annotations

from pathlib import Path

import notebook_runs
import pytest
from harness import ROOT, answered_exercise, exercise_attempt, grade_in_pairs

from ddp_course.course.l08_checkpointing import grader

SOLUTION = ROOT / "solutions" / "exercises" / "08_save_load.py"


GATHER = ("    rng = [None] * info.world_size if info.rank == 0 else None\n"
          "    dist.gather_object(torch.get_rng_state(), rng, dst=0)\n")
STATE = ('        state = {"step": step, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(), '
         '"rng": rng}\n')


def answered() -> str:
    return answered_exercise(SOLUTION.name)


def attempt(tmp_path: Path, function: str, body: str) -> Path:
    return exercise_attempt(tmp_path, SOLUTION.name, function, body)


@pytest.mark.timeout(400)
def test_solution_passes_both_crashes(tmp_path):
    path = tmp_path / "08_answered.py"
    path.write_text(answered())
    verdict = notebook_runs.grade("08", path, timeout=180)
    assert verdict.ok, verdict.message
    assert "resumed at step" in verdict.message and "the save is atomic" in verdict.message


STRAIGHT = (GATHER + "    if info.rank == 0:\n" + STATE +
            "        torch.save(state, path)\n"
            "    dist.barrier()\n")
REMOVE_FIRST = (GATHER + "    if info.rank == 0:\n" + STATE +
                "        tmp = path.with_name(path.name + '.tmp')\n"
                "        path.unlink(missing_ok=True)\n"
                "        torch.save(state, tmp)\n"
                "        os.rename(tmp, path)\n"
                "    dist.barrier()\n")
RANK0_RNG = ("    if info.rank == 0:\n"
             '        state = {"step": step, "model": model.module.state_dict(), '
             '"optimizer": optimizer.state_dict(),\n'
             '                 "rng": [torch.get_rng_state()] * info.world_size}\n'
             "        tmp = path.with_name(path.name + '.tmp')\n"
             "        torch.save(state, tmp)\n"
             "        os.replace(tmp, path)\n"
             "    dist.barrier()\n")


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> dict:
    """{mistake: verdict}, graded two jobs at a time (``harness.grade_in_pairs``). "straight" goes through
    the whole grader (the exact resume, then the kill during a save); the others run only the part of it
    that tells them apart: "remove first" the kill-during-save job, "rank 0 rng" the crash-and-restart job
    (the grader runs the kill job beside it and reads it only when the resume is exact)."""
    tmp = tmp_path_factory.mktemp("ex08")
    attempts = {}
    for name, body in (("straight", STRAIGHT), ("remove first", REMOVE_FIRST), ("rank 0 rng", RANK0_RNG)):
        folder = tmp / name.replace(" ", "_")  # one folder each: the grader writes its runs beside the script
        folder.mkdir()
        attempts[name] = attempt(folder, "save_checkpoint", body)

    def grade(path: Path):
        if path == attempts["remove first"]:
            return grader._kill_during_save(path, path.parent / "scratch", timeout=120)
        if path == attempts["rank 0 rng"]:
            return grader._crash_and_restart(path, path.parent / "crash", timeout=180)
        return grader.grade(path, timeout=180)

    return grade_in_pairs(grade, attempts)


@pytest.mark.timeout(600)
def test_save_straight_onto_the_path_is_rejected(mistakes):
    # The classic: torch.save(state, path). The restart after a crash long after the save resumes
    # exactly; only a kill during the write shows the truncated file.
    verdict = mistakes["straight"]
    assert not verdict.ok
    assert "the resume is exact, but" in verdict.message, verdict.message
    assert "truncated file" in verdict.message and "straight onto path" in verdict.message, verdict.message
    assert "temporary file in the same folder" in verdict.message and "os.replace" in verdict.message


@pytest.mark.timeout(600)
def test_removing_the_old_checkpoint_before_writing_is_rejected(mistakes):
    # A temporary file, but the old checkpoint deleted first: a kill in between leaves nothing at all.
    verdict = mistakes["remove first"]
    assert not verdict.ok
    assert "no checkpoint at path" in verdict.message and "os.replace" in verdict.message, verdict.message


@pytest.mark.timeout(600)
def test_only_rank_0s_rng_state_saved_is_rejected(mistakes):
    # Rank 0 saves its own generator: rank 1 resumes with rank 0's dropout masks.
    verdict = mistakes["rank 0 rng"]
    assert not verdict.ok
    assert "got rank 0's RNG state" in verdict.message, verdict.message


def test_kill_diagnosis_names_each_outcome():
    previous = {"model": "m", "optimizer": "o", "rng": "r"}
    row = {"attempt": 1, "killed": True, "path": "checkpoint.pt", "writing": "checkpoint.pt.tmp", "exists": True,
           "previous": previous, "step": 1, "loaded": previous}
    assert grader.diagnose_kill(row).ok
    v = grader.diagnose_kill({**row, "writing": "checkpoint.pt", "error": "RuntimeError: failed finding central"})
    assert not v.ok and "truncated file" in v.message and "straight onto path" in v.message
    v = grader.diagnose_kill({**row, "exists": False})
    assert not v.ok and "no checkpoint at path" in v.message and "os.replace" in v.message
    v = grader.diagnose_kill({"attempt": 0, "killed": False})
    assert not v.ok and "never called torch.save" in v.message
    v = grader.diagnose_kill({**row, "step": 2})
    assert not v.ok and "not the complete checkpoint of step 1" in v.message


def _results(loaded: dict[int, dict] | None = None, start: int = grader.CKPT_STEP) -> list[dict]:
    """RESULT rows as the exercise prints them after a restart: the resumed run, then its reference."""
    out = []
    for r in range(2):
        ref = {"at_ckpt": {"model": "m", "optimizer": "o", "rng": f"rng{r}"}, "final": "f",
               "losses": {str(s): float(s) for s in range(1, grader.MAX_STEPS + 1)}}
        out.append({"rank": r, "attempt": 1, "start": start,
                    "loaded": {**ref["at_ckpt"], **(loaded or {}).get(r, {})}, "at_ckpt": None, "final": "f",
                    "losses": {k: v for k, v in ref["losses"].items() if int(k) > start}, "reference": ref})
    return out


def test_grader_diagnoses_each_missing_part():
    assert grader.diagnose(_results()).ok
    v = grader.diagnose(_results({1: {"rng": "rng0"}}))
    assert not v.ok and "got rank 0's RNG state" in v.message
    v = grader.diagnose(_results({0: {"optimizer": "x"}, 1: {"optimizer": "x"}}))
    assert not v.ok and "optimizer" in v.message and "[0, 1]" in v.message
    v = grader.diagnose(_results(start=0))
    assert not v.ok and "started again from step 0" in v.message
    v = grader.diagnose([{**row, "final": "g"} for row in _results()])
    assert not v.ok and "in the final parameters" in v.message
