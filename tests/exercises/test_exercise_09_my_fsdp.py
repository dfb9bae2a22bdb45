"""Exercise 09's third part (FSDP by hand): the grader accepts the solution, and another correct answer
spelled otherwise, and rejects each classic mistake, saying which one it is. The solution's verdict is
the one lesson 09's grading cell got for the same file in this session, when it ran (``notebook_runs``).

Every wrong attempt is the answered solution with ONE function body replaced (what a learner would
have written there), run for real on 2 ranks two at a time -- except the uneven shards, which the
grader finds before any job by calling ``shard_of`` in its own process, and the mistakes whose rows are
exactly predictable (a gradient in the unsharded shape, replicated gradients summed or never reduced, an
all-gather that is not asynchronous), judged on the solution's own rows altered the way those mistakes
alter them.
"""

from __future__ import annotations

import notebook_runs
import pytest
from harness import answered_exercise, exercise_attempt, grade_in_pairs, rejected_and_named

from ddp_course.check import replace_function_body
from ddp_course.course.l09_fsdp import grader_my_fsdp as grader

NAME = "09_my_fsdp.py"


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """(verdict, its RESULT rows by rank, the grader's references, the path) of the answered solution: the
    job lesson 09's grading cell ran on the same file in this session, when it did (``notebook_runs``)."""
    path = tmp_path_factory.mktemp("my_fsdp") / NAME
    path.write_text(answered_exercise(NAME), encoding="utf-8")
    verdict = notebook_runs.grade("09", path, timeout=180)
    return verdict, sorted(getattr(verdict, "records", []), key=lambda r: r["rank"]), grader.references(path), path


@pytest.mark.timeout(240)
def test_solution_passes_bit_for_bit_and_at_the_predicted_peak(solution):
    verdict, rows, refs, _ = solution
    assert verdict.ok, verdict.message
    for row in rows:
        runs = {(r["kind"], r["optimizer"], r["dtype"]): r for r in row["runs"]}
        assert all(r["bitwise"] and r["max_abs_diff"] == 0 for k, r in runs.items() if k[2] == "float32")
        for (kind, _, dtype), r in runs.items():
            if kind == "gpt":  # the calculator's table: shards + replicated + root + (1 + prefetch) blocks
                want = grader.predicted_peak(refs["shape"], row["rank"], r["prefetch"], 2 if dtype == "bfloat16" else 4)
                assert r["peak_param_bytes"] == want["peak"], (kind, dtype, r["prefetch"])
        odd = runs["odd", "adamw", "float32"]
        assert any(n % 2 for n in odd["weight_numels"]) and odd["shard_numels_summed"] == odd["weight_numels"]


MISTAKES = {
    # after forward nothing is freed: the numbers are right, the memory is every unit gathered at once
    "full weights kept after forward": ("after_forward", "    pass\n",
                                        ("full weights are kept after forward", "169,664", "120,512", "after_forward")),
    # freed after forward, never gathered again: autograd would read freed storage
    "no gather before backward": ("before_backward", "    pass\n",
                                  ("No gather before backward", "compute its backward with its weights sharded",
                                   "before_backward")),
    "gradients summed, not averaged": ("reduce_gradient",
                                       "    flat = full_grad.reshape(-1)\n"
                                       "    chunk = -(-flat.numel() // world_size)\n"
                                       "    padded = torch.zeros(world_size * chunk, dtype=flat.dtype)\n"
                                       "    padded[:flat.numel()] = flat\n"
                                       "    mine = torch.empty(chunk, dtype=flat.dtype)\n"
                                       "    dist.reduce_scatter_tensor(mine, padded)\n"
                                       "    return mine[:shard_numel].float()\n",
                                       ("gradients summed, not averaged", "2.00 times", "reduce_gradient")),
    "gradients left in the compute dtype": ("reduce_gradient",
                                            "    flat = full_grad.reshape(-1)\n"
                                            "    chunk = -(-flat.numel() // world_size)\n"
                                            "    padded = torch.zeros(world_size * chunk, dtype=flat.dtype)\n"
                                            "    padded[:flat.numel()] = flat\n"
                                            "    mine = torch.empty(chunk, dtype=flat.dtype)\n"
                                            "    dist.reduce_scatter_tensor(mine, padded)\n"
                                            "    return mine[:shard_numel] / world_size\n",
                                            ("gradients left in the compute dtype", "bfloat16", "fp32")),
    # every unit started at once, prefetch or not: the numbers are right, the peak is every unit gathered
    "every unit started at once": ("before_forward",
                                   "    for unit in units[i:]:\n"
                                   "        if unit.state == 'sharded':\n"
                                   "            unit.start()\n"
                                   "    units[i].wait()\n",
                                   ("every unit is gathered at once", "169,664", "before_forward", "units[i]")),
    # every all-gather waited for as soon as it is started: no overlap in forward
    "prefetch that waits at once": ("before_forward",
                                    "    for unit in units[i:i + 1 + prefetch]:\n"
                                    "        if unit.state == 'sharded':\n"
                                    "            unit.start()\n"
                                    "        unit.wait()\n",
                                    ("prefetch that waits at once", "forward", "in flight", "wait only for units[i]")),
}

# A correct answer spelled otherwise: shards by narrow, the average by an all-reduce then a slice (more
# bytes, the same sums), the schedule written as a loop over what is missing.
ANOTHER_SPELLING = {
    "shard_of": ("    n = full.numel()\n"
                 "    c = (n + world_size - 1) // world_size\n"
                 "    start = min(n, rank * c)\n"
                 "    return full.detach().flatten().narrow(0, start, min(c, n - start)).clone()\n"),
    "reduce_gradient": ("    summed = full_grad.detach().flatten().clone()\n"
                        "    dist.all_reduce(summed)\n"
                        "    c = (summed.numel() + world_size - 1) // world_size\n"
                        "    rank = dist.get_rank()\n"
                        "    return (summed[rank * c:rank * c + shard_numel] / world_size).to(torch.float32)\n"),
    "before_backward": ("    wanted = units[i:min(len(units), i + prefetch + 1)]\n"
                        "    for u in [u for u in wanted if u.state == 'sharded']:\n"
                        "        u.start()\n"
                        "    wanted[0].wait()\n"),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict on the attempt with that mistake}, graded two at a time."""
    attempts = {m: exercise_attempt(tmp_path_factory.mktemp("attempt"), NAME, function, body)
                for m, (function, body, _) in MISTAKES.items()}
    source = answered_exercise(NAME)
    for function, body in ANOTHER_SPELLING.items():
        source = replace_function_body(source, function, body)
    other = tmp_path_factory.mktemp("other") / NAME
    other.write_text(source, encoding="utf-8")
    attempts["another spelling"] = other
    return grade_in_pairs(lambda path: grader.grade(path, timeout=180), attempts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


@pytest.mark.timeout(300)
def test_a_correct_answer_spelled_otherwise_passes(verdicts):
    assert verdicts["another spelling"].ok, verdicts["another spelling"].message


def _rows(records: list[dict], change) -> list[dict]:
    """The solution's rows with ``change(run)`` applied to a copy of every run of every rank."""
    import copy

    rows = copy.deepcopy(records)
    for row in rows:
        for run in row["runs"]:
            change(run)
    return rows


def test_diagnosis_names_the_mistakes_whose_rows_are_predictable(solution):
    _, records, refs, _ = solution
    assert grader.diagnose(records, **refs).ok
    # the whole weight's averaged gradient handed over, unsharded: the harness reports its shape
    def unsharded(run):
        if run["kind"] == "gpt":
            run["grad_problems"] = ["the gradient of blocks.0.attn.qkv.weight is float32 of shape (96, 32), its "
                                    "parameter fp32 of shape (1536,)"]
    v = grader.diagnose(_rows(records, unsharded), **refs)
    assert not v.ok and "unsharded shape" in v.message and "shard_numel" in v.message, v.message
    # replicated gradients summed over the ranks and never divided: exactly 2 times the reference's
    def summed(run):
        run["grad_ratio"]["replicated"] = 2.0
    v = grader.diagnose(_rows(records, summed), **refs)
    for phrase in ("replicated parameters' gradients summed, not averaged", "2.00 times", "average_replicated"):
        assert phrase in v.message and not v.ok, v.message
    # replicated gradients never reduced: each rank's own batch; neither the average nor the sum
    def own(run):
        run["grad_ratio"]["replicated"] = 1.31
    v = grader.diagnose(_rows(records, own), **refs)
    assert not v.ok and "not averaged over the ranks" in v.message and "own batch" in v.message, v.message
    # a shard that keeps the padding: the ranks' shards hold more than the weight
    def padded(run):
        run["shard_numels_summed"] = [n + n % 2 + 1 for n in run["weight_numels"]]
    v = grader.diagnose(_rows(records, padded), **refs)
    assert not v.ok and "uneven shards" in v.message and "padding" in v.message, v.message
    # an all-gather that is not asynchronous (start_gather returns no handle): nothing is ever in flight
    def synchronous(run):
        run["synchronous_gathers"] = 12
        for c in run["computes"]:
            c["in_flight"] = []
    v = grader.diagnose(_rows(records, synchronous), **refs)
    assert not v.ok and "prefetch that waits at once" in v.message and "async_op=True" in v.message, v.message
    # not bit for bit although everything else is right
    def off(run):
        if run["optimizer"] == "sgd":
            run["bitwise"], run["max_abs_diff"] = False, 3e-8
    v = grader.diagnose(_rows(records, off), **refs)
    assert not v.ok and "bit for bit" in v.message and "3.0e-08" in v.message, v.message


PADS = ("    flat = full.detach().reshape(-1)\n"
        "    chunk = -(-flat.numel() // world_size)\n"
        "    flat = torch.nn.functional.pad(flat, (0, world_size * chunk - flat.numel()))\n"
        "    return flat[rank * chunk:(rank + 1) * chunk].clone()\n")
DROPS = ("    flat = full.detach().reshape(-1)\n"
         "    chunk = flat.numel() // world_size\n"
         "    return flat[rank * chunk:(rank + 1) * chunk].clone()\n")


def _defined(body: str):
    import torch

    scope: dict = {"torch": torch}
    exec("def shard_of(full, rank, world_size):\n" + body, scope)
    return scope["shard_of"]


def test_uneven_shards_are_named_without_a_job(tmp_path):
    import torch

    def by_chunk(full, rank, world_size):  # torch.chunk: the same c, but fewer chunks than ranks when tiny
        parts = torch.chunk(full.detach().reshape(-1), world_size)
        return parts[rank].clone() if rank < len(parts) else full.new_empty(0)

    assert grader.shard_problem(by_chunk) is None
    problem = grader.shard_problem(_defined(PADS))
    assert "uneven shards" in problem and "padding is in the shards" in problem and "(7,)" in problem, problem
    problem = grader.shard_problem(_defined(DROPS))
    assert "uneven shards" in problem and "fewer than the weight has" in problem, problem
    verdict = grader.grade(exercise_attempt(tmp_path, NAME, "shard_of", PADS))  # refused before any job
    assert not verdict.ok and "before any job" in verdict.message and "padding" in verdict.message
