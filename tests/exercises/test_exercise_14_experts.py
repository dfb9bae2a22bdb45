"""Exercise 14's second part (expert dispatch): the grader accepts the solution and rejects the classic
mistakes of expert parallelism by hand, naming each.

Every wrong attempt is the answered solution with one function's body replaced by what a learner would
write. Three real 4-rank jobs: the answered solution (lesson 14's grading cell's verdict when it graded
the same bytes), and, side by side, the receive splits taken equal to the send splits (gloo aborts; the
grader reads its words, which only a job can test) and a combine without the un-sort (named by the grader's
simulation of the 4 ranks nearest to the losses the job measured). The other mistakes are judged on what
real jobs of those attempts measured, kept below (``RECORDED``), or on the solution's own records changed
exactly as the mistake changes them (a gradient times 4 is exact in floating point).
"""

from __future__ import annotations

import copy

import pytest
from harness import exercise_attempt, grade_in_pairs, graded_solution

from ddp_course import check
from ddp_course.course.l14_sequences_and_experts import grader_experts as grader

NAME = "14_expert_dispatch.py"


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    graded = graded_solution(tmp_path_factory.mktemp("experts"), "14", NAME, grader)
    assert check.check_harness("14_expert_dispatch", graded[-1]).ok
    return graded


@pytest.mark.timeout(180)
def test_solution_passes(solution):
    verdict, rows, refs, _ = solution
    assert verdict.ok, verdict.message
    assert "in priority order" in verdict.message and "matches one process" in verdict.message
    assert [r["experts"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(r["received"] == r["reference_received"] and r["dropped"] == r["reference_dropped"] for r in rows)
    assert all(d > 0 for d in rows[0]["dropped"])  # a capacity factor below 1: slots really drop
    assert all(r["missing_grads"] == [] and r["grad_rel_err"] <= 1e-10 for r in rows)


@pytest.mark.timeout(180)
def test_the_grader_plays_the_ranks_as_the_job_runs_them(solution):
    """The grader's one-process simulation of the 4 ranks gives each rank's loss and every gradient norm the
    job measured, to float64's rounding: what its simulations of the mistakes are measured against."""
    _, records, refs, _ = solution
    for measured, want in ((grader.measured_losses(records), refs["losses"]["right"]),
                           (grader.measured_expert_norms(records, 2, 8), refs["experts"]["one process"]),
                           (grader.measured_shared_norms(records), refs["shared"]["one process"])):
        assert max(abs(a - b) / b for a, b in zip(measured, want)) < 1e-12


DISPATCH_WITHOUT_COUNTS = '''    p = dist.get_world_size(group)
    local = counts.numel() // p
    send_splits = counts.view(p, local).sum(1).tolist()
    arrivals = AllToAll.apply(slots, send_splits, send_splits, group, None, "dispatch")
    from_rank = counts.view(p, local)
    which = torch.arange(local).repeat(p).repeat_interleave(from_rank.flatten())
    regroup = torch.argsort(which, stable=True)
    return arrivals[regroup], Exchange(send_splits, send_splits, from_rank, regroup)
'''
COMBINE_WITHOUT_UNSORT = '''    arrivals = torch.zeros_like(outputs).index_copy(0, ex.regroup, outputs)
    mine = AllToAll.apply(arrivals, ex.recv_splits, ex.send_splits, group, None, "combine")
    n_tokens, k = gate.shape
    return (mine.view(n_tokens, k, -1) * gate.unsqueeze(-1)).sum(1)
'''
MISTAKES = {
    # (a) the receive splits taken equal to the send splits: gloo aborts on the first pair that disagrees
    "splits not exchanged": ("dispatch", DISPATCH_WITHOUT_COUNTS,
                             ("the receive splits were not exchanged first", "Exchange the per-expert counts first",
                              "Received data size doesn't match expected size")),
    # (b) the rows come home in expert order and stay so: every token gets another slot's output
    "no un-sort": ("combine", COMBINE_WITHOUT_UNSORT,
                   ("leaves them in expert order, not at their tokens' positions",
                    "row i belongs to token-slot order[i]", "from the grader's simulation of this mistake")),
}


@pytest.mark.timeout(240)
def test_mistakes_in_the_exchanges_are_rejected_and_named(tmp_path):
    folders = [tmp_path / str(i) for i in range(len(MISTAKES))]
    for folder in folders:
        folder.mkdir()
    attempts = {name: exercise_attempt(folder, NAME, function, body)
                for folder, (name, (function, body, _)) in zip(folders, MISTAKES.items())}
    verdicts = grade_in_pairs(lambda path: check.grade("14_expert_dispatch", path), attempts)
    for name, (_, _, words) in MISTAKES.items():
        v = verdicts[name]
        assert not v.ok, name
        for w in words:
            assert w in v.message, (name, w, v.message)


# --- the other mistakes, on what real jobs of them measured ------------------------------------------------------

RECORDED = {
    # sync_gradients all-reducing every gradient, experts' included, then dividing by 4: each expert's gradient
    # norm, block by block (measured_expert_norms of that job's RESULT lines)
    "expert gradients all-reduced": [0.15584826610870128, 0.13431385411081323] * 4 + [0.13091803507866437,
                                                                                      0.1475511611423445] * 4,
    # combine applying the sort again (mine[order]): each rank's loss
    "sorted again": [4.212938674422284, 4.205631595623997, 4.158923660070641, 4.180712273923115],
    # combine sending the grouped rows back without undoing the regroup: each rank's loss
    "regroup not undone": [4.211690417491941, 4.20225340078488, 4.1583234845282915, 4.173917735413773],
    # dispatch without the regroup (each expert takes its slice of the arrivals): each rank's loss, and how many
    # of the first block's rows each rank's experts received at the wrong places
    "no regroup": ([4.214455238438132, 4.2032236636699984, 4.156559876095246, 4.174888795127843],
                   [(136, 107), (133, 99), (132, 99), (111, 82)]),
    # sync_gradients dividing the experts' gradients only, no all-reduce: the replicated gradients' norm per rank
    "replicated not all-reduced": [1.2383177071714206, 1.1272158702137667, 1.295715629790618, 1.1854812723367816],
    # dispatch sending the rows with dist.all_to_all_single into a fresh buffer: the replicated gradients' norm
    "dispatch without a backward": [0.5840249835860517] * 4,
}


@pytest.mark.timeout(60)
def test_expert_gradients_all_reduced_over_the_ranks_are_named(solution):
    problem = grader.expert_gradient_problem(RECORDED["expert gradients all-reduced"], solution[2])
    for w in ("The classic mistake: the expert gradients were all-reduced over the ranks",
              "different experts that only share a shape", "all-reduce only the replicated parameters",
              "from the grader's simulation of this mistake"):
        assert w in (problem or ""), (w, problem)


def _solution_norms(records, times: float) -> list[float]:
    return [n * times for n in grader.measured_expert_norms(records, 2, 8)]


@pytest.mark.timeout(60)
def test_the_missing_one_over_p_is_named(solution):
    _, records, refs, _ = solution
    assert grader.expert_gradient_problem(_solution_norms(records, 1), refs) is None
    problem = grader.expert_gradient_problem(_solution_norms(records, 4), refs)  # what leaving out the /4 does
    for w in ("The classic mistake: the expert gradients are 4 times one process's: the 1/p is missing",
              "divide it by the world size (4)"):
        assert w in (problem or ""), (w, problem)


@pytest.mark.timeout(60)
def test_a_combine_without_a_backward_leaves_the_experts_without_gradient(solution):
    _, records, refs, _ = solution
    norms = _solution_norms(records, 1)
    norms[:8] = [None] * 8  # what a combine through dist.all_to_all_single leaves: no expert has a gradient
    problem = grader.expert_gradient_problem(norms, refs)
    assert "no gradient reached 8 expert(s) (blocks.0.mlp.experts.0 first)" in (problem or "")
    assert "AllToAll.apply" in problem


@pytest.mark.parametrize("name, words", [
    ("sorted again", ("applies the sort a second time", "index_copy or scatter to order")),
    ("regroup not undone", ("undo dispatch's regroup before the reverse exchange",)),
])
def test_combine_mistakes_are_named_from_the_losses(solution, name, words):
    problem = grader.loss_problem(RECORDED[name], solution[2])
    for w in ("The classic mistake", *words):
        assert w in (problem or ""), (name, w, problem)


def test_arrivals_not_regrouped_are_named_from_the_rows_and_the_losses(solution):
    _, records, refs, _ = solution
    losses, rows = RECORDED["no regroup"]
    altered = copy.deepcopy(sorted(records, key=lambda r: r["rank"]))
    for r, loss, (n, wrong) in zip(altered, losses, rows):
        r["local_loss"], r["rows"][0] = loss, {"ok": False, "rows": n, "expected_rows": n, "misplaced": wrong}
    verdict = grader.diagnose(altered, refs)
    assert not verdict.ok
    for w in ("107 of the 136 rows rank 0's experts received in the first block",
              "Regroup the arrivals by local expert"):
        assert w in verdict.message, (w, verdict.message)


@pytest.mark.parametrize("name, words", [
    ("replicated not all-reduced", ("were not all-reduced", "All-reduce them and divide by the world size")),
    ("dispatch without a backward", ("the gradient stops at the dispatch's exchange", "AllToAll.apply")),
])
def test_replicated_gradient_mistakes_are_named(solution, name, words):
    problem = grader.shared_gradient_problem(RECORDED[name], solution[2])
    for w in (*words, "from the grader's simulation of this mistake"):
        assert w in (problem or ""), (name, w, problem)


def test_replicated_gradients_summed_are_named(solution):
    _, records, refs, _ = solution
    summed = [4 * n for n in grader.measured_shared_norms(records)]  # an all_reduce without the division
    assert "summed over the ranks, not averaged" in (grader.shared_gradient_problem(summed, refs) or "")


def test_gloo_s_words_for_uneven_splits_are_explained():
    assert "receive splits were not exchanged first" in grader.hint(
        "RuntimeError: Split sizes doesn't match total dim 0 size")
    said = grader.hint("RuntimeError: ProcessGroupGloo::scatter: invalid tensor size at index 1 (expected (36, 32), "
                       "got (31, 32))\n  File \"x.py\", line 66, in dispatch\n    got = dnn.all_to_all(outs, ins)")
    assert "carries tensors of one size only" in said and "all_to_all_single" in said
    assert grader.hint("RuntimeError: something else") == ""
