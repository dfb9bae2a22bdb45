"""Exercise 14 (ring attention): the grader passes the solution, and right answers written other ways,
and names each classic mistake.

The solution is graded as a learner's file is (lesson 14's grading cell's verdict, when it graded these
bytes). The other answers are not launched one job each: one 4-rank spawn runs the harness's own
``measure`` with each answer's functions -- what the learner's script computes on every rank -- and the
grader's ``diagnose`` judges those rows. A ring step that blocks on every rank never finishes; those
attempts (every rank sending first, every rank receiving first) are graded for real among the hang
attempts of ``test_learner_errors.py``, which run side by side while waiting.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import notebook_runs
import pytest
import torch
import torch.distributed as dist
from harness import answered_exercise, free_port, spawn

from ddp_course import check
from ddp_course.course.l14_sequences_and_experts import grader
from ddp_course.course.l14_sequences_and_experts.ring_harness import LARGE_RTOL, MISTAKES

NAME = "14_ring_attention.py"


@pytest.mark.timeout(240)
def test_solution_passes(tmp_path):
    path = tmp_path / NAME
    path.write_text(answered_exercise(NAME), encoding="utf-8")
    verdict = notebook_runs.grade("14", path)
    assert verdict.ok, verdict.message
    assert "equals one process's attention on rings of 2 and 4 ranks" in verdict.message
    assert "holds in float32 with scores up to" in verdict.message


def _solution_functions():
    """The answer's three functions, from the answered exercise (as the learner's file defines them)."""
    scope: dict = {}
    exec(compile(answered_exercise(NAME).replace('if __name__ == "__main__":', "if False:"), NAME, "exec"), scope)
    return scope["pass_on"], scope["block_scores"], scope["merge"]


# --- what learners write: the classic mistakes, as a learner's functions ------------------------------------------

def _local_mask_scores(q, k, qpos, kpos):
    """The causal mask by position inside the block (every block masked as if it were on the diagonal)."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


def _unmasked_scores(q, k, qpos, kpos):
    """No mask at all (a query also attends to later keys in its own chunk)."""
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


def _summed(out, lse, out_blk, lse_blk):
    """Block outputs added, each normalised by its own block's softmax only."""
    return out + out_blk, torch.logaddexp(lse, lse_blk)


def _averaged(out, lse, out_blk, lse_blk):
    """The running output and the block's averaged, whatever their weights."""
    first = torch.isinf(lse)
    return torch.where(first[..., None], out_blk, (out + out_blk) / 2), torch.logaddexp(lse, lse_blk)


def _merged_by_sums(out, lse, out_blk, lse_blk):
    """The right formula with the sums exponentiated, exp(lse): exact in float64 on small scores."""
    a, b = torch.exp(lse), torch.exp(lse_blk)
    total = a + b
    return (out * a[..., None] + out_blk * b[..., None]) / total[..., None], torch.log(total)


def _lse_by_sums(out, lse, out_blk, lse_blk):
    """The new log-sum-exp as log(exp + exp), the weights then as differences: inf - inf on large scores."""
    new = torch.log(torch.exp(lse) + torch.exp(lse_blk))
    return out * torch.exp(lse - new)[..., None] + out_blk * torch.exp(lse_blk - new)[..., None], new


LEARNER_MISTAKES = {
    "mask by local position": {"scores": _local_mask_scores},
    "no causal mask": {"scores": _unmasked_scores},
    "merge without rescaling (sum)": {"combine": _summed},
    "merge without rescaling (mean)": {"combine": _averaged},
    "merge by the sums (1)": {"combine": _merged_by_sums},
    "merge by the sums (2)": {"combine": _lse_by_sums},
}
assert set(MISTAKES) <= set(LEARNER_MISTAKES)


# --- right answers written other ways --------------------------------------------------------------------------

def _pass_on_even_first(t, send_to, recv_from):
    """Blocking calls, the even ranks sending first and the odd ranks receiving first."""
    received = torch.empty_like(t)
    if dist.get_rank() % 2 == 0:
        dist.send(t.contiguous(), send_to)
        dist.recv(received, recv_from)
    else:
        dist.recv(received, recv_from)
        dist.send(t.contiguous(), send_to)
    return received


def _pass_on_batched(t, send_to, recv_from):
    """Both operations in one batch (dist.batch_isend_irecv)."""
    received = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to), dist.P2POp(dist.irecv, received, recv_from)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _scores_where(q, k, qpos, kpos):
    """torch.where with the mask by position, the scale applied to q first."""
    s = (q / q.shape[-1] ** 0.5) @ k.transpose(-2, -1)
    return torch.where(kpos[None, :] <= qpos[:, None], s, torch.tensor(float("-inf"), dtype=s.dtype))


def _scores_bias(q, k, qpos, kpos):
    """An additive bias: 0 where visible, -inf after the query."""
    bias = torch.zeros(len(qpos), len(kpos), dtype=q.dtype).masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1]) + bias


def _merge_max_first(out, lse, out_blk, lse_blk):
    """The larger log-sum-exp subtracted before exponentiating (the first block: lse is -inf)."""
    m = torch.maximum(lse, lse_blk)
    a, b = torch.exp(lse - m), torch.exp(lse_blk - m)
    return (out * a[..., None] + out_blk * b[..., None]) / (a + b)[..., None], m + torch.log(a + b)


def _merge_by_sigmoid(out, lse, out_blk, lse_blk):
    """The block's weight as a sigmoid of the difference of the two log-sum-exps."""
    w = torch.sigmoid(lse_blk - lse)
    return out * (1 - w)[..., None] + out_blk * w[..., None], torch.logaddexp(lse, lse_blk)


RIGHT = {
    "even ranks first, where, max first": (_pass_on_even_first, _scores_where, _merge_max_first),
    "batched, a bias, a sigmoid": (_pass_on_batched, _scores_bias, _merge_by_sigmoid),
}


def _measure_every_answer(rank: int, port: int, out: str) -> None:
    from ddp_course.course.l14_sequences_and_experts.ring_harness import measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        pass_on, scores, merge = _solution_functions()
        rows = {"solution": measure(pass_on, scores, merge)}
        for name, swap in LEARNER_MISTAKES.items():
            rows[name] = measure(pass_on, swap.get("scores", scores), swap.get("combine", merge))
        for name, functions in RIGHT.items():
            rows[name] = measure(*functions)
        Path(out, f"rank{rank}.json").write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    """{answer: the 4 ranks' RESULT rows of the solution with that mistake in place, or of a right answer}."""
    out = tmp_path_factory.mktemp("ring_answers")
    spawn(_measure_every_answer, (free_port(), str(out)), world=4)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {name: [r[name] for r in ranks] for name in ranks[0]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["solution", *RIGHT])
def test_right_answers_written_other_ways_pass(measured, name):
    """Any spelling of the answer passes, the float32 run with large scores included, with room: a right answer's
    error there is float32's rounding of the scores, far below the bound."""
    verdict = grader.diagnose(measured[name])
    assert verdict.ok, (name, verdict.message)
    assert all(r["large"]["largest_score"] > 100 for r in measured[name])  # past float32's exp range (88.7)
    assert max(r["large"]["error"] for r in measured[name]) < LARGE_RTOL / 10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_classic_mistake_is_named(measured, name):
    """The harness's one-process account of each mistake (``ring_harness.mistaken``) is what the ring computes
    with that mistake in a learner's function, on every rank, ring and layout."""
    verdict = grader.diagnose(measured[name])
    assert not verdict.ok
    assert verdict.message.startswith(grader.WHY[name]), verdict.message
    others = [w for n, w in grader.WHY.items() if n != name]
    assert not any(w in verdict.message for w in others)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["merge by the sums (1)", "merge by the sums (2)"])
def test_a_merge_that_overflows_on_large_scores_is_named(measured, name):
    """A merge that exponentiates the log-sum-exps themselves is exact on the small float64 scores, which alone
    the harness used to try (it passed); the float32 run with scores in the hundreds makes it inf or NaN, and the
    verdict names the overflow."""
    rows = measured[name]
    assert max(e for r in rows for e in r["errors"].values()) <= grader.RTOL  # right on small scores
    assert not all(r["large"]["finite"] for r in rows)
    verdict = grader.diagnose(rows)
    assert not verdict.ok and verdict.message.startswith("merge overflows"), verdict.message
    for words in ("float32", "not finite", "e^88.7", "exp(lse - new)"):
        assert words in verdict.message, (words, verdict.message)


@pytest.mark.timeout(180)
def test_a_wrong_answer_that_is_no_classic_mistake_is_told_where_to_look(measured):
    rows = json.loads(json.dumps(measured["no causal mask"]))
    for r in rows:  # another error of the same size, equal to none of the simulations
        r["mistakes"] = {k: {n: d + 0.1 for n, d in v.items()} for k, v in r["mistakes"].items()}
    verdict = grader.diagnose(rows)
    assert not verdict.ok and "from each classic mistake's too" in verdict.message
    assert re.search(r"4 ranks, zigzag: \d\.\de-0\d", verdict.message)


def test_the_blocking_order_is_named_from_gloo_s_words():
    """gloo says which call timed out; the hint names the order that deadlocks: sends first, or receives first."""
    sent = grader.hint("RuntimeError: [../unbound_buffer.cc:78] Timed out waiting 15000ms for send operation to complete")
    assert "every rank sent before it received" in sent
    got = grader.hint("RuntimeError: [../unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete")
    assert "every rank waited in recv before any rank sent" in got and "deadlocks the ring" in got
    assert "sent before it received" not in got
    assert grader.hint("ValueError: shapes") == ""


def test_an_answer_that_calls_the_lesson_s_merge_is_refused_before_any_job(tmp_path, monkeypatch):
    """The lesson's ring (``ring.merge``, ``ring._block``) is not what the exercise imports, but a learner can
    import it: the grader refuses it by name (the grader's DELEGATES), without starting a job."""
    import ddp_course.launch

    monkeypatch.setattr(ddp_course.launch, "run", lambda *a, **k: pytest.fail("a job was started"))
    for function, body in (
        ("merge", "    from ddp_course.course.l14_sequences_and_experts import ring\n"
                  "    return ring.merge(out, lse, out_blk, lse_blk)\n"),
        ("block_scores", "    from ddp_course.course.l14_sequences_and_experts.ring import _block\n"
                         "    return _block(q, k, qpos, kpos, q.shape[-1] ** -0.5)\n"),
    ):
        path = tmp_path / function / NAME
        path.parent.mkdir()
        path.write_text(check.replace_function_body(answered_exercise(NAME), function, body), encoding="utf-8")
        verdict = check.grade("14_ring_attention", path)
        assert not verdict.ok and f"{function}() hands its work to the course's own version" in verdict.message, verdict
