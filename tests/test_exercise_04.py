"""Exercise 04's grader accepts the solution and rejects each classic mistake of the DDP conversion,
saying which one it is.

Every wrong attempt is the answered solution with ONE function body replaced (what a learner would
have written there). The mistakes of the data order (no DistributedSampler) are also in
``tests/test_ddp_lesson.py``, beside the recipe lab that shows them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from harness import ROOT

from ddp_course.check import replace_function_body
from ddp_course.course.l04_ddp import grader

SOLUTION = ROOT / "solutions" / "exercises" / "04_ddp_convert.py"

_spec = importlib.util.spec_from_file_location("make_lessons", ROOT / "tools" / "make_lessons.py")
make_lessons = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_lessons)


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """The grader caches its one-process reference; an empty cache makes this module train it once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def answered() -> str:
    """The solution as a learner who completed it has it (the marker lines gone)."""
    return make_lessons.answer_source(SOLUTION.read_text(), SOLUTION.name)


def attempt(tmp_path: Path, function: str, body: str) -> Path:
    path = tmp_path / f"04_{function}.py"
    path.write_text(replace_function_body(answered(), function, body))
    return path


@pytest.mark.timeout(300)
def test_solution_passes_and_logs_the_one_process_loss(fresh_cache, tmp_path):
    path = tmp_path / "04_answered.py"
    path.write_text(answered())
    verdict = grader.grade(path, timeout=180)
    assert verdict.ok, verdict.message
    assert "logged the one-process loss" in verdict.message
    assert "tolerance" in verdict.message  # the verdict states what it compared against


@pytest.mark.timeout(300)
def test_loss_summed_over_ranks_and_never_divided_is_rejected(fresh_cache, tmp_path):
    path = attempt(tmp_path, "mean_over_ranks", "    t = loss.detach().clone()\n"
                                                "    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n"
                                                "    return t.item()\n")
    verdict = grader.grade(path, timeout=180)
    assert not verdict.ok
    assert "2.00 times" in verdict.message and "divide by the world size" in verdict.message, verdict.message


@pytest.mark.timeout(300)
def test_each_rank_logging_its_own_loss_is_rejected(fresh_cache, tmp_path):
    # no all_reduce at all: rank 0's log shows the loss of half the batch
    path = attempt(tmp_path, "mean_over_ranks", "    return loss.item()\n")
    verdict = grader.grade(path, timeout=180)
    assert not verdict.ok
    assert "its own batch" in verdict.message and "all_reduce" in verdict.message, verdict.message


@pytest.mark.timeout(300)
def test_mean_reduced_to_rank_0_only_is_rejected(fresh_cache, tmp_path):
    # dist.reduce: only rank 0 receives the sum; rank 1 logs whatever its buffer holds
    path = attempt(tmp_path, "mean_over_ranks", "    t = loss.detach().clone()\n"
                                                "    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)\n"
                                                "    return (t / world_size).item()\n")
    verdict = grader.grade(path, timeout=180)
    assert not verdict.ok
    assert "rank(s) [1] did not" in verdict.message and "all_reduce" in verdict.message, verdict.message


@pytest.mark.timeout(300)
def test_without_set_epoch_is_rejected(fresh_cache, tmp_path):
    path = attempt(tmp_path, "start_epoch", "    pass\n")
    verdict = grader.grade(path, timeout=180)
    assert not verdict.ok
    assert "set_epoch" in verdict.message, verdict.message


@pytest.mark.timeout(300)
def test_saving_the_wrapper_is_rejected(fresh_cache, tmp_path):
    path = attempt(tmp_path, "save", "    if rank == 0:\n"
                                     "        torch.save(model.state_dict(), path)\n"
                                     "    dist.barrier()\n")
    verdict = grader.grade(path, timeout=180)
    assert not verdict.ok
    assert "'module.'" in verdict.message, verdict.message


def test_loss_check_names_each_mistake_without_a_job():
    # The diagnosis itself, on RESULT rows: fast, and exact about which message each mistake gets.
    ref = [4.0, 3.5, 3.0]
    halves = ([4.1, 3.4, 3.05], [3.9, 3.6, 2.95])  # two ranks' own losses; their mean is ref
    rows = lambda a, b: [{"rank": 0, "losses": a}, {"rank": 1, "losses": b}]  # noqa: E731
    assert grader._loss_problem(rows(ref, ref), ref) is None
    assert "2.00 times" in grader._loss_problem(rows([2 * v for v in ref], [2 * v for v in ref]), ref)
    assert "0.50 times" in grader._loss_problem(rows([v / 2 for v in ref], [v / 2 for v in ref]), ref)
    assert "its own batch" in grader._loss_problem(rows(*halves), ref)
    assert "rank(s) [1] did not" in grader._loss_problem(rows(ref, [v / 2 for v in halves[1]]), ref)
    assert "carry no losses" in grader._loss_problem([{"rank": 0}, {"rank": 1}], ref)
