"""Exercise 14's second part (expert dispatch): the grader accepts the solution, and a right answer written
another way, and rejects the classic mistakes of expert parallelism by hand, naming each.

Every wrong attempt is the answered solution with one function's body replaced by what a learner would
write. Real 4-rank jobs: the answered solution (lesson 14's grading cell's verdict when it graded the same
bytes), and, two at a time, the receive splits taken equal to the send splits and the splits passed in each
other's place (the harness checks every all_to_all_single's splits across the ranks before it runs and
names which disagree, by how many rows), a combine that never sends the rows back (named by the harness,
where PyTorch says only "index_copy_(): Number of indices ..."), a combine without the un-sort (named by
the grader's simulation of the 4 ranks nearest to the losses the job measured), and the three functions
written another way (accepted). The other mistakes are judged on what real jobs of those attempts
measured, kept below (``RECORDED``), or on the solution's own records changed exactly as the mistake
changes them (a gradient times 4 is exact in floating point).
"""

from __future__ import annotations

import copy

import pytest
from harness import answered_exercise, exercise_attempt, grade_in_pairs, graded_solution

from ddp_course import check
from ddp_course.course.l14_sequences_and_experts import grader_experts as grader
from ddp_course.course.l14_sequences_and_experts.experts_harness import split_problem

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
COMBINE_NOT_SENT_BACK = '''    arrivals = torch.zeros_like(outputs).index_copy(0, ex.regroup, outputs)
    by_slot = torch.zeros(order.numel(), outputs.shape[1], dtype=outputs.dtype).index_copy(0, order, arrivals)
    n_tokens, k = gate.shape
    return (by_slot.view(n_tokens, k, -1) * gate.unsqueeze(-1)).sum(1)
'''
MISTAKES = {
    # (a) the receive splits taken equal to the send splits: the ranks' splits disagree (gloo would abort)
    "splits not exchanged": ("dispatch", DISPATCH_WITHOUT_COUNTS,
                             ("all_to_all_single in dispatch (its call 1 there): the ranks' splits disagree: rank 0 "
                              "sends", "which expects", "Exchange the per-expert counts first", "Its row sums, one per source rank")),
    # (c) the rows come home in expert order and stay so: every token gets another slot's output
    "no un-sort": ("combine", COMBINE_WITHOUT_UNSORT,
                   ("leaves them in expert order, not at their tokens' positions",
                    "row i belongs to token-slot order[i]", "from the grader's simulation of this mistake")),
    # (d) the experts' outputs put at this rank's slots without the reverse exchange: index_copy_ fails
    "not sent back": ("combine", COMBINE_NOT_SENT_BACK,
                      ("ranks 0, 1, 2 and 3 raised ValueError: combine sent nothing back: it made no "
                       "all_to_all_single", "(hence its IndexError)",
                       "with a second all_to_all (the dispatch's splits swapped)", "in the order it sent them")),
}
# the three functions written another way: torch.distributed.nn.functional's exchange, argsort for the
# inverse permutations, einsum for the gates, one flat all-reduce for the replicated gradients
ANOTHER_WAY = {
    "dispatch": '''    import torch.distributed.nn.functional as dnn

    p = dist.get_world_size(group)
    per_rank = counts.numel() // p
    incoming = counts.new_empty(counts.shape)
    dist.all_to_all_single(incoming, counts, group=group)
    from_rank = incoming.reshape(p, per_rank)
    send = [int(n) for n in counts.reshape(p, per_rank).sum(dim=1)]
    recv = [int(n) for n in from_rank.sum(dim=1)]
    arrivals = dnn.all_to_all_single(slots.new_empty(sum(recv), slots.shape[1]), slots, recv, send,
                                     group=group or dist.group.WORLD)
    expert_of = torch.cat([torch.arange(per_rank).repeat_interleave(row) for row in from_rank])
    regroup = torch.sort(expert_of, stable=True).indices
    return arrivals[regroup], Exchange(send, recv, from_rank, regroup)
''',
    "combine": '''    import torch.distributed.nn.functional as dnn

    back = dnn.all_to_all_single(outputs.new_empty(sum(ex.send_splits), outputs.shape[1]),
                                 outputs[torch.argsort(ex.regroup)], ex.send_splits, ex.recv_splits,
                                 group=group or dist.group.WORLD)
    n_tokens, k = gate.shape
    return torch.einsum("nkc,nk->nc", back[torch.argsort(order)].view(n_tokens, k, -1), gate)
''',
    "sync_gradients": '''    p = dist.get_world_size(group)
    local = expert_parameters(model)
    shared = [w for w in model.parameters() if id(w) not in local and w.grad is not None]
    flat = torch.cat([w.grad.flatten() for w in shared])
    dist.all_reduce(flat, group=group)
    for w, g in zip(shared, flat.split([w.numel() for w in shared])):
        w.grad.copy_(g.view_as(w) / p)
    for w in model.parameters():
        if id(w) in local and w.grad is not None:
            w.grad.div_(p)
''',
}


@pytest.mark.timeout(420)
def test_mistakes_in_the_exchanges_are_rejected_and_named_and_another_right_answer_passes(tmp_path):
    """Guards the harness's check of every exchange's splits and of a combine that sends nothing back: before
    it, gloo aborted the job on the first pair of ranks that disagreed, PyTorch said only "Split sizes doesn't
    match total dim 0 size", and a combine without its exchange ended in index_copy_'s IndexError -- none of
    them said which splits disagree, nor that the rows must go home first. (The splits passed in each
    other's place meet the same check: its words are tried on their splits below.)"""
    folders = [tmp_path / str(i) for i in range(len(MISTAKES))]
    for folder in folders:
        folder.mkdir()
    attempts = {name: exercise_attempt(folder, NAME, function, body)
                for folder, (name, (function, body, _)) in zip(folders, MISTAKES.items())}
    source = answered_exercise(NAME)
    for function, body in ANOTHER_WAY.items():
        source = check.replace_function_body(source, function, body)
    (tmp_path / "another_way").mkdir()
    attempts["another way"] = tmp_path / "another_way" / NAME
    attempts["another way"].write_text(source, encoding="utf-8")
    verdicts = grade_in_pairs(lambda path: check.grade("14_expert_dispatch", path), attempts)
    for name, (_, _, words) in MISTAKES.items():
        v = verdicts[name]
        assert not v.ok, name
        for w in words:
            assert w in v.message, (name, w, v.message)
    assert verdicts["another way"].ok, verdicts["another way"].message


def test_the_splits_check_names_which_splits_disagree():
    """The harness's check of one all_to_all_single's splits (each rank: output rows, input rows, then the
    length and entries of its output splits and of its input splits), on made-up splits of 2 ranks."""
    def rank(out_rows, in_rows, outs, ins):
        return [out_rows, in_rows, len(outs), *(outs + [0, 0])[:2], len(ins), *(ins + [0, 0])[:2]]

    assert split_problem([rank(5, 4, [2, 3], [2, 2]), rank(4, 5, [2, 2], [3, 2])], 2) is None
    crossed = split_problem([rank(5, 4, [2, 3], [2, 2]), rank(5, 5, [3, 2], [3, 2])], 2)  # rank 1 expects 3, not 2
    assert "the ranks' splits disagree: rank 0 sends 2 rows to rank 1, which expects 3 from it." in crossed
    swapped = split_problem([rank(5, 4, [2, 2], [2, 3]), rank(4, 5, [2, 2], [3, 2])], 2)
    assert "rank 0's output_split_sizes [2, 2] add up to 4 rows, but its output tensor has 5" in swapped
    short = split_problem([rank(5, 4, [2, 3, 0], [2, 2]), rank(4, 5, [2, 2], [3, 2])], 2)
    assert "rank 0 passed output_split_sizes with 3 entries; it takes one per rank (2)" in short


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


def test_gloo_s_and_pytorch_s_words_for_uneven_splits_are_explained():
    """When a call escapes the harness's check (all_to_all_single bound to a name before the job), the hint still
    explains PyTorch's and gloo's words: which split list must add up to which tensor, what gloo's size mismatch
    means, and an index_copy_ in combine over rows that were never sent back."""
    swapped = grader.hint("RuntimeError: Split sizes doesn't match total dim 0 size")
    assert "output_split_sizes, the third argument" in swapped and "input_split_sizes, the fourth" in swapped
    assert "checkSplitSizes in torch/csrc/distributed/c10d/Utils.hpp" in swapped
    assert "receive splits were not exchanged first" in grader.hint(
        "gloo::EnforceNotMet ... 24 vs 16. Received data size doesn't match expected size.")
    never = grader.hint('  File "x.py", line 80, in combine\n    by_slot = z.index_copy(0, order, arrivals)\n'
                        "IndexError: index_copy_(): Number of indices (128) should be equal to source.size(dim) (131)")
    assert "without sending them back first" in never and "an all_to_all with the dispatch's splits swapped" in never
    said = grader.hint("RuntimeError: ProcessGroupGloo::scatter: invalid tensor size at index 1 (expected (36, 32), "
                       "got (31, 32))\n  File \"x.py\", line 66, in dispatch\n    got = dnn.all_to_all(outs, ins)")
    assert "carries tensors of one size only" in said and "all_to_all_single" in said
    assert grader.hint("RuntimeError: something else") == ""


def test_an_answer_that_calls_the_lesson_s_dispatch_is_refused_before_any_job(tmp_path, monkeypatch):
    """The lesson's expert parallelism (``experts.dispatch``, ``combine``, ``sync_gradients``) is not in what the
    exercise imports, but a learner can import it: the grader refuses it, without starting a job."""
    import ddp_course.launch

    monkeypatch.setattr(ddp_course.launch, "run", lambda *a, **k: pytest.fail("a job was started"))
    body = ("    from ddp_course.course.l14_sequences_and_experts import experts\n"
            "    experts.sync_gradients(model, group)\n")
    path = tmp_path / NAME
    path.write_text(check.replace_function_body(answered_exercise(NAME), "sync_gradients", body), encoding="utf-8")
    verdict = check.grade("14_expert_dispatch", path)
    assert not verdict.ok and "sync_gradients() hands its work to the course's own version" in verdict.message
