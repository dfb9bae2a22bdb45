"""Exercise 09's second part (ZeRO-1 by hand): the grader accepts the solution and rejects each classic
mistake, saying which one it is; the memory calculator's ``zero1`` rows match what the job measured.

Every wrong attempt is the answered solution with ONE function body replaced (what a learner would
have written there), run for real on 2 ranks. Further mistakes are checked on the solution's own
RESULT rows, altered the way those mistakes alter them (no job).
"""

from __future__ import annotations

import notebook_runs
import pytest
from harness import answered_exercise, exercise_attempt, grade_in_pairs

from ddp_course.course.l09_fsdp import grader_zero1 as grader
from ddp_course.course.l09_fsdp import memory

NAME = "09_zero1.py"


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The answered solution graded once: (verdict, its RESULT rows, the grader's references, its path)."""
    path = tmp_path_factory.mktemp("zero1") / NAME
    path.write_text(answered_exercise(NAME), encoding="utf-8")
    verdict = notebook_runs.grade("09", path, timeout=180)  # lesson 09's grading cell's, when it graded these bytes
    return verdict, verdict.records, grader.references(path), path


@pytest.mark.timeout(240)
def test_solution_passes_and_holds_half_of_adamw(solution):
    verdict, records, refs, path = solution
    assert verdict.ok, verdict.message
    assert "exactly one rank" in verdict.message and "one-process reference" in verdict.message
    rows = sorted(records, key=lambda r: r["rank"])
    # the calculator's zero1 rows are the same greedy partition as the solution's, so they agree to the byte
    predicted = memory.predict("zero1", 2, {"vocab_size": 65, **grader.harness_constants(path)["SHAPE"]})
    assert [r["optimizer_bytes"] for r in rows] == [p["optimizer"] for p in predicted]
    assert sum(r["optimizer_bytes"] for r in rows) == refs["unsharded"] == rows[0]["ddp_optimizer_bytes"]
    assert all(p["params"] == predicted[0]["params"] and p["grads"] == p["params"] for p in predicted)  # replicated


MISTAKES = {
    # (a) no sharding: every rank's AdamW over every parameter -- DDP's memory, and the same training
    "full optimizer on every rank": ("shard_optimizer", "    return torch.optim.AdamW(params, lr=LR)\n",
                                     ("every rank's optimizer steps all 28 parameters", "2.0x", "shards[rank]")),
    # (b) the owners step, nobody shares: each rank keeps its own parameters updated, the others at init
    "no broadcast of the updates": ("share_updates", "    pass\n",
                                    ("ranks hold different parameters", "broadcast every parameter from its owner")),
    # (c) the sum over the ranks, never divided (AdamW's normalisation nearly hides it in the parameters)
    "gradients summed, not averaged": ("average_gradients",
                                       "    for owner, mine in enumerate(shards):\n"
                                       "        for i in mine:\n"
                                       "            dist.reduce(params[i].grad, dst=owner, op=dist.ReduceOp.SUM)\n",
                                       ("2.00 times the averaged gradient", "divide the sum by the number of ranks")),
    # (d) a split by running size that keeps only the parameters entirely inside a rank's half: the
    # one straddling the middle belongs to no rank and never trains
    "a parameter on no rank": ("partition",
                               "    share = sum(sizes) / world_size\n"
                               "    starts = [sum(sizes[:i]) for i in range(len(sizes))]\n"
                               "    return [[i for i in range(len(sizes)) if r * share <= starts[i] and starts[i] + sizes[i]"
                               " <= (r + 1) * share]\n"
                               "            for r in range(world_size)]\n",
                               ("stepped on no rank", "blocks.0.mlp.proj.weight", "exactly one rank")),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict on the attempt with that mistake}, graded two at a time."""
    attempts = {m: exercise_attempt(tmp_path_factory.mktemp("attempt"), NAME, function, body)
                for m, (function, body, _) in MISTAKES.items()}
    return grade_in_pairs(lambda path: grader.grade(path, timeout=180), attempts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    _, _, phrases = MISTAKES[mistake]
    verdict = verdicts[mistake]
    assert not verdict.ok
    assert all(p in verdict.message for p in phrases), verdict.message


def _rows(records: list[dict], **changes) -> list[dict]:
    """The solution's rows, rank by rank, with ``changes[rank]`` (a dict) applied."""
    return [{**r, **changes.get(f"r{r['rank']}", {})} for r in sorted(records, key=lambda r: r["rank"])]


def test_diagnosis_names_the_other_mistakes_without_a_job(solution):
    _, records, refs, _ = solution
    ok = grader.diagnose(_rows(records), **refs)
    assert ok.ok, ok.message
    r0, r1 = sorted(records, key=lambda r: r["rank"])
    # a parameter of rank 1's given to rank 0 as well: overlap
    both = _rows(records, r0={"stepped": r0["stepped"] + r1["stepped"][:1]})
    assert "stepped on 2 ranks" in grader.diagnose(both, **refs).message
    # a complete partition that ignores size (e.g. round-robin by index): one rank holds most of the state
    lopsided = _rows(records, r0={"optimizer_bytes": 214_584}, r1={"optimizer_bytes": 14_136})
    v = grader.diagnose(lopsided, **refs)
    assert not v.ok and "unbalanced" in v.message and "largest first" in v.message
    # no reduction at all: each owner steps with its own batch's gradient; or that gradient / N
    for factor, phrase in ((1.0, "its own batch alone"), (0.5, "divided by 2")):
        own = {f"r{r['rank']}": {"grad_norms": {n: factor * refs["reference"][r["rank"]][n] for n in r["grad_norms"]}}
               for r in (r0, r1)}
        assert phrase in grader.diagnose(_rows(records, **own), **refs).message
    # the updates broadcast from the wrong rank: identical everywhere, but not DDP's
    stale = _rows(records, r0={"max_abs_diff_vs_ddp": 4e-3}, r1={"max_abs_diff_vs_ddp": 4e-3})
    assert "from the rank that stepped it" in grader.diagnose(stale, **refs).message


def test_calculator_zero1_shards_only_the_optimizer():
    shape = {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
    ddp, fsdp = memory.predict("ddp", 4, shape)[0], memory.predict("fsdp", 4, shape)
    rows = memory.predict("zero1", 4, shape)
    assert sum(r["optimizer"] for r in rows) == ddp["optimizer"]  # every state exactly once, nothing padded
    assert all(r["params"] == ddp["params"] and r["grads"] == ddp["grads"] for r in rows)
    largest = max(t.numel for t in memory.parameter_table(shape))
    for r in rows:  # within (N-1)/N of the largest tensor's moments (+ step counters) of 1/N: greedy's bound
        assert abs(r["optimizer"] - ddp["optimizer"] / 4) <= 3 / 4 * 8 * largest + 4 * len(memory.parameter_table(shape))
        assert fsdp[r["rank"]]["states"] < r["states"] < ddp["states"]
    assert sorted(i for s in memory.zero1_partition([5, 3, 3, 1], 2) for i in s) == [0, 1, 2, 3]
    assert memory.zero1_partition([5, 3, 3, 1], 2) == [[0, 3], [1, 2]]  # 5 + 1 against 3 + 3
