"""Exercise 11's second part (1F1B by hand): the grader accepts the solution and another spelling of it,
and rejects each classic mistake, saying which one it is.

The mistakes that only a run can show are the answered solution with ``one_f_one_b_step``'s body
replaced (what a learner would have written), run for real: a graph kept alive after its backward
(seen in the bytes held), a
warm-up that ignores m < p (a crash on 4 ranks), blocking sends that wait for each other (a deadlock,
answered at the collective timeout with each rank's line). The others change numbers the harness reports, so
they are judged on the solution's own RESULT rows, altered the way each mistake alters them.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
from harness import answered_exercise, exercise_attempt, grade_in_pairs, graded_solution, rejected_and_named

from ddp_course.check import replace_function_body
from ddp_course.course.l11_beyond_data_parallel import grader_one_f_one_b as grader
from ddp_course.dist import COLLECTIVE_TIMEOUT_VAR

NAME = "11_one_f_one_b.py"


def _body(source: str) -> str:
    """The solution's body of one_f_one_b_step, as a learner who completed it has it."""
    start = source.index("    rank, p, m = dist.get_rank()")
    return source[start:source.index("\ndef rel_err")].rstrip() + "\n"


def _variant(old: str, new: str) -> str:
    body = _body(answered_exercise(NAME))
    assert old in body, old
    return body.replace(old, new)


MISTAKES = {
    # every micro-batch's output kept after its backward, its graph with it (retain_graph=True, added where
    # a "backward through the graph a second time" error once appeared): GPipe's memory
    "graphs kept alive": (lambda: _variant("inp, out = inputs.pop(i), outputs.pop(i)", "inp, out = inputs[i], outputs[i]")
                          .replace("out.backward()", "out.backward(retain_graph=True)")
                          .replace("out.backward(grad)", "out.backward(grad, retain_graph=True)"),
                          ("rank 0 held", "kept alive", "retain_graph")),
    # blocking sends: in the steady phase stage 0 sends an activation while stage 1 sends a gradient,
    # each waiting for the other to receive. Both sends time out after the same collective timeout: at the
    # same moment (each rank raises "Timed out") or one first (its peer then waits, or loses it). Either
    # way the verdict shows each rank's own send line, the two lines named below.
    "blocking sends that cross": (lambda: _variant("            sends.append(dist.isend(out.detach(), dst=rank + 1))",
                                                   "            dist.send(out.detach(), dst=rank + 1)")
                                  .replace("            sends.append(dist.isend(inp.grad, dst=rank - 1))",
                                           "            dist.send(inp.grad, dst=rank - 1)"),
                                  ("on 2 ranks", "Timed out", "dist.send(out.detach(), dst=rank + 1)",
                                   "dist.send(inp.grad, dst=rank - 1)", "wait to receive from the other")),
    # the warm-up's length without its cap at m: on 4 ranks with m = 2, stage 0 asks for a third micro-batch
    "a warm-up longer than m": (lambda: _variant("warmup = min(p - 1 - rank, m)", "warmup = p - 1 - rank"),
                                ("on 4 ranks", "IndexError", "fewer than the stages", "cannot be longer than m")),
}


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return graded_solution(tmp_path_factory.mktemp("one_f_one_b"), "11", NAME, grader, timeout=180)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict}, two jobs at a time, with a short collective timeout for the hang."""
    attempts = {}
    for mistake, (body, _) in MISTAKES.items():
        attempts[mistake] = exercise_attempt(tmp_path_factory.mktemp("attempt"), NAME, "one_f_one_b_step", body())
    saved = os.environ.get(COLLECTIVE_TIMEOUT_VAR)
    os.environ[COLLECTIVE_TIMEOUT_VAR] = "8"
    try:
        return grade_in_pairs(lambda path: grader.grade(path, timeout=180), attempts)
    finally:
        if saved is None:
            os.environ.pop(COLLECTIVE_TIMEOUT_VAR)
        else:
            os.environ[COLLECTIVE_TIMEOUT_VAR] = saved


@pytest.mark.timeout(300)
def test_solution_passes_and_holds_p_minus_s_micro_batches(solution):
    verdict, records, refs, _ = solution
    assert verdict.ok, verdict.message
    assert "1F1B's order on every rank" in verdict.message and "one-process loss" in verdict.message
    assert [r["world_size"] for r in records] == [4] * 4  # the verdict keeps the 4-rank run's rows
    for r in records:
        big = next(run for run in r["runs"] if run["m"] >= 4)
        assert big["order"] == grader.expected_order(big["m"], 4, r["rank"])
        assert big["held"] == pytest.approx(4 - r["rank"], abs=grader.HELD_SLACK)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


def _rows(records: list[dict], change) -> list[dict]:
    rows = copy.deepcopy(sorted(records, key=lambda r: r["rank"]))
    for r in rows:
        for run in r["runs"]:
            change(r["rank"], run)
    return rows


def test_the_other_mistakes_are_named_from_the_rows(solution):
    _, records, _, path = solution
    constants, p = grader.harness_constants(path), 4
    assert grader.diagnose(_rows(records, lambda rank, run: None), constants, p).ok

    def scaled(factor):
        def change(rank, run):
            f = run["m"] if factor == "m" else 1 / run["m"]
            run["grad_norm"] *= f
            if run["loss"] is not None:
                run["loss"] *= f
        return change
    v = grader.diagnose(_rows(records, scaled("m")), constants, p)
    assert not v.ok and "not divided by m" in v.message, v.message
    v = grader.diagnose(_rows(records, scaled("1/m")), constants, p)
    assert not v.ok and "divided by m twice" in v.message, v.message

    def gpipe(rank, run):
        run["order"], run["held"] = "F" * run["m"] + "B" * run["m"], float(run["m"])
    v = grader.diagnose(_rows(records, gpipe), constants, p)
    assert not v.ok and "GPipe's order" in v.message, v.message

    def one_more(rank, run):  # a warm-up one forward too long (p - s instead of p - 1 - s)
        if rank == 1 and run["m"] >= p:
            run["order"] = "FFFFBFBFBFBFBBBB"
    v = grader.diagnose(_rows(records, one_more), constants, p)
    assert not v.ok and "off by 1" in v.message and "rank 1 ran 4 forward(s)" in v.message, v.message

    def unreceived(rank, run):  # rank 0 ran its backwards from a gradient it never received (zeros)
        if rank == 0:
            run["grad_norm"], run["grad_rel_err"] = 0.0, 1.0
    v = grader.diagnose(_rows(records, unreceived), constants, p)
    assert not v.ok and "had not arrived" in v.message, v.message

    def extra_forward(rank, run):
        if rank == 2:
            run["order"] += "F"
    v = grader.diagnose(_rows(records, extra_forward), constants, p)
    assert not v.ok and re.search(r"rank 2 ran \d+ forward", v.message), v.message


def test_another_spelling_passes(tmp_path):
    """The same schedule written as one loop over a precomputed order, with irecv().wait(), other buffers,
    torch.autograd.backward and a loss multiplied by 1/m."""
    body = '''    rank, p, m = dist.get_rank(), dist.get_world_size(), len(xs)
    first = min(m, p - rank - 1)
    steps = ["f"] * first
    for k in range(m - first):
        steps += ["f", "b"]
    steps += ["b"] * first
    saved, loss_sum, nf, nb, pending = {}, 0.0, 0, 0, []
    for step in steps:
        if step == "f":
            if rank == 0:
                a = xs[nf]
            else:
                a = torch.zeros(act_shape)
                dist.irecv(a, src=rank - 1).wait()
                a.requires_grad = True
            if rank == p - 1:
                z = stage(a, ys[nf]) * (1.0 / m)
                loss_sum = loss_sum + float(z)
            else:
                z = stage(a)
                pending.append(dist.isend(z.detach().contiguous(), rank + 1))
            saved[nf] = (a, z)
            nf += 1
        else:
            a, z = saved.pop(nb)
            if rank == p - 1:
                z.backward()
            else:
                g = torch.zeros(z.shape)
                dist.recv(g, rank + 1)
                torch.autograd.backward(z, g)
            if rank > 0:
                pending.append(dist.isend(a.grad, rank - 1))
            nb += 1
    for w in pending:
        w.wait()
    return loss_sum if rank == p - 1 else None
'''
    path = tmp_path / NAME
    path.write_text(replace_function_body(answered_exercise(NAME), "one_f_one_b_step", body), encoding="utf-8")
    verdict = grader.grade(path, timeout=180)
    assert verdict.ok, verdict.message
