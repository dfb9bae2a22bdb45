"""Exercise 04's grader accepts the solution and rejects each classic mistake of the DDP conversion,
saying which one it is.

Every wrong attempt is the answered solution with ONE function body replaced (what a learner would
have written there), and the data order's (no DistributedSampler) with the solution's own lines
changed. The answered solution is the
file lesson 04's grading cell grades in ``make test``: its verdict is read from there when that cell
graded the same file in this session (``notebook_runs.grade``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import ROOT, exercise_attempt, grade_in_pairs, graded_answer, rejected_and_named

from ddp_course.course.l04_ddp import grader

SOLUTION = ROOT / "solutions" / "exercises" / "04_ddp_convert.py"

NAME = "04_ddp_convert.py"


@pytest.mark.timeout(300)
def test_solution_passes_and_logs_the_one_process_loss(tmp_path):
    _, verdict = graded_answer(tmp_path, "04", NAME, timeout=180)
    assert verdict.ok, verdict.message
    assert "logged the one-process loss" in verdict.message
    assert "tolerance" in verdict.message  # the verdict states what it compared against


# Graded by real jobs. Of the loss mistakes, one runs for real (the sum only rank 0 receives): the path
# from a rank's logged losses to the verdict is the same for the other two, whose rows are exactly
# predictable (every rank twice the truth; each rank its own half-batch's loss), and the diagnosis of
# each is checked on such rows in test_loss_check_names_each_mistake_without_a_job.
MISTAKES = {
    # dist.reduce: only rank 0 receives the sum; rank 1 logs whatever its buffer holds
    "mean on rank 0 only": ("mean_over_ranks", "    t = loss.detach().clone()\n"
                                               "    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)\n"
                                               "    return (t / world_size).item()\n",
                            ("rank(s) [1] did not", "all_reduce")),
    "no set_epoch": ("start_epoch", "    pass\n", ("set_epoch",)),
    # the DDP wrapper's state dict: every key starts with 'module.', which one process cannot load
    "saving the wrapper": ("save", "    if rank == 0:\n"
                                   "        torch.save(model.state_dict(), path)\n"
                                   "    dist.barrier()\n", ("'module.'",)),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict on the attempt with that mistake}. The first is graded alone (it
    trains the session's cached reference, unless lesson 04's grading cell did), the others two at a
    time (``harness.grade_in_pairs``)."""
    attempts = {m: exercise_attempt(tmp_path_factory.mktemp("attempt"), NAME, function, body)
                for m, (function, body, _) in MISTAKES.items()}
    return grade_in_pairs(lambda path: grader.grade(path, timeout=180), attempts, alone=1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


def test_loss_check_names_each_mistake_without_a_job():
    # The diagnosis itself, on RESULT rows: fast, and exact about which message each mistake gets.
    ref = [4.0, 3.5, 3.0]
    halves = ([4.1, 3.4, 3.05], [3.9, 3.6, 2.95])  # two ranks' own losses; their mean is ref
    rows = lambda a, b: [{"rank": 0, "losses": a}, {"rank": 1, "losses": b}]  # noqa: E731
    assert grader._loss_problem(rows(ref, ref), ref) is None
    summed = grader._loss_problem(rows([2 * v for v in ref], [2 * v for v in ref]), ref)  # summed, never divided
    assert "2.00 times" in summed and "divide by the world size" in summed, summed
    assert "0.50 times" in grader._loss_problem(rows([v / 2 for v in ref], [v / 2 for v in ref]), ref)
    own = grader._loss_problem(rows(*halves), ref)  # each rank its own loss, no all_reduce
    assert "its own batch" in own and "all_reduce" in own, own
    assert "rank(s) [1] did not" in grader._loss_problem(rows(ref, [v / 2 for v in halves[1]]), ref)
    assert "carry no losses" in grader._loss_problem([{"rank": 0}, {"rank": 1}], ref)


@pytest.mark.timeout(300)
def test_grader_fails_without_the_sampler_and_says_why(tmp_path):
    from ddp_course.course.l04_ddp.grader import grade

    path = _broken(tmp_path,
                   "    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, "
                   "drop_last=True)\n    return DataLoader(ds, batch_size=MICRO_BATCH, sampler=sampler, drop_last=True), "
                   "sampler\n",
                   "    return DataLoader(ds, batch_size=MICRO_BATCH, shuffle=True, drop_last=True), None\n",
                   "no_sampler.py")
    path.write_text(path.read_text().replace("    sampler.set_epoch(epoch)\n", "    pass\n"))
    verdict = grade(path, timeout=180)
    assert not verdict.ok
    assert "same windows" in verdict.message and "DistributedSampler" in verdict.message
    assert "final parameters differ" in verdict.message  # the measured gap is reported too


def _broken(tmp_path: Path, old: str, new: str, name: str) -> Path:
    src = SOLUTION.read_text()
    assert src.count(old) == 1, f"the solution no longer contains {old!r}"
    path = tmp_path / name
    path.write_text(src.replace(old, new))
    return path


@pytest.mark.parametrize("function, body, course", [
    ("mean_over_ranks", "    from ddp_course.course.l04_ddp.ddp_recipe import mean_over_ranks as m\n"
                        "    return m(loss, world_size)\n", "ddp_course.course.l04_ddp.ddp_recipe.mean_over_ranks"),
    ("setup", "    from ddp_course.dist import setup as s\n    return s()\n", "ddp_course.dist.setup"),
])
def test_an_answer_that_calls_the_course_version_is_refused_before_any_job(function, body, course, tmp_path):
    """The recipe's mean_over_ranks and the course's setup are the course's versions of two TODOs (the
    grader's DELEGATES): a script complete but for one of them calling it is refused before a job starts,
    and the verdict names it. The script no longer imports the module that holds them (convert_kit
    instead of ddp_recipe and ddp_course.dist)."""
    from ddp_course import check

    verdict = check.grade("04", exercise_attempt(tmp_path, NAME, function, body))
    assert not verdict.ok and f"{function}() hands its work to the course's own version, {course}" in verdict.message
    shipped = (ROOT / "lessons" / "exercises" / NAME).read_text()
    assert "ddp_recipe" not in shipped and "ddp_course.dist" not in shipped and "convert_kit import" in shipped
