"""Exercise 09's second part (ZeRO-1 by hand): the grader accepts the solution and rejects each classic
mistake, saying which one it is; the memory calculator's ``zero1`` rows match what the job measured.

Every wrong attempt is the answered solution with ONE function body replaced (what a learner would
have written there), run for real on 2 ranks -- except a ``partition`` that is right on those 2 ranks
only, which the grader rejects before any job, having called it on other world sizes in its own
process. Further mistakes are checked on the solution's own RESULT rows, altered the way those
mistakes alter them, and on partitions called in this process (no job).
"""

from __future__ import annotations

import pytest
from harness import answered_exercise, exercise_attempt, grade_in_pairs, graded_solution, rejected_and_named

from ddp_course.course.l09_fsdp import grader_zero1 as grader
from ddp_course.course.l09_fsdp import memory

NAME = "09_zero1.py"


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return graded_solution(tmp_path_factory.mktemp("zero1"), "09", NAME, grader, timeout=180)


@pytest.mark.timeout(240)
def test_solution_passes_and_holds_half_of_adamw(solution):
    verdict, rows, refs, path = solution
    assert verdict.ok, verdict.message
    assert "exactly one rank" in verdict.message and "one-process reference" in verdict.message
    # the calculator's zero1 rows are the same greedy partition as the solution's, so they agree to the byte
    predicted = memory.predict("zero1", 2, {"vocab_size": 65, **grader.harness_constants(path)["SHAPE"]})
    assert [r["optimizer_bytes"] for r in rows] == [p["optimizer"] for p in predicted]
    assert sum(r["optimizer_bytes"] for r in rows) == refs["unsharded"] == rows[0]["ddp_optimizer_bytes"]
    assert all(p["params"] == predicted[0]["params"] and p["grads"] == p["params"] for p in predicted)  # replicated


DROPS_THE_REMAINDER = ("    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])\n"
                       "    shards = [[] for _ in range(world_size)]\n"
                       "    for row in range(len(sizes) // world_size):\n"
                       "        ranks = range(world_size) if row % 2 == 0 else reversed(range(world_size))\n"
                       "        for k, r in enumerate(ranks):\n"
                       "            shards[r].append(order[row * world_size + k])\n"
                       "    return shards\n")

MISTAKES = {
    # (a) no sharding: every rank's AdamW over every parameter -- DDP's memory, and the same training
    "full optimizer on every rank": ("shard_optimizer", "    return optimizer_class(params, **{'lr': LR, **defaults})\n",
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
    # (e) the parameters, largest first, dealt out in rows of world_size (snaking), the last incomplete
    # row dropped: MiniGPT's 28 tensors fill every row on the job's 2 ranks; on 3, ln_f.bias has no owner
    "a partition that drops the remainder": ("partition", DROPS_THE_REMAINDER,
                                             ("without an owner", "on 3 ranks", "ln_f.bias", "exactly one rank")),
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
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


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


def test_an_optimizer_over_every_parameter_is_named_by_the_state_it_kept(solution):
    """An optimizer over all the parameters that steps only the owned ones (average_gradients sets the
    others' .grad to None, and an optimizer skips those) keeps only its share of AdamW's state: the
    verdict says so, with its numbers, and what is wrong -- not that each rank keeps the full state."""
    _, records, refs, _ = solution
    r0, r1 = sorted(records, key=lambda r: r["rank"])
    everything = list(r0["param_norms"])
    held = _rows(records, r0={"stepped": everything}, r1={"stepped": everything})  # state and gradients: the solution's
    v = grader.diagnose(held, **refs)
    share = r0["ddp_optimizer_bytes"] / 2
    assert not v.ok
    for phrase in ("holds all 28 parameters", f"{r0['optimizer_bytes']:,} bytes of AdamW state on rank 0",
                   f"{r0['optimizer_bytes'] / share:.1f}x its 1/2 share", "sharded all the same",
                   f"only {len(r0['grad_norms'])} of them had a gradient", "shards[rank]"):
        assert phrase in v.message, v.message
    assert "full AdamW state" not in v.message, v.message
    # the same optimizer given every gradient steps every parameter: the full state, said as such
    full = {"optimizer_bytes": r0["ddp_optimizer_bytes"], "stepped": everything}
    v = grader.diagnose(_rows(records, r0=full, r1=full), **refs)
    assert not v.ok and "full AdamW state" in v.message and "2.0x its 1/2 share" in v.message, v.message


def _contiguous(sizes: list[int], world_size: int) -> list[list[int]]:
    """Runs of consecutive parameters, cut where the running size crosses each 1/N of the total."""
    total, start, shards = sum(sizes), 0, [[] for _ in range(world_size)]
    for i, size in enumerate(sizes):
        shards[min(world_size - 1, start * world_size // total)].append(i)
        start += size
    return shards


def _in_order(sizes: list[int], world_size: int) -> tuple:
    """Greedy without sorting, as tuples of sets: each parameter, in order, to the least loaded rank."""
    shards, owned = [set() for _ in range(world_size)], [0] * world_size
    for i, size in enumerate(sizes):
        r = owned.index(min(owned))
        shards[r].add(i)
        owned[r] += size
    return tuple(shards)


def _defined(body: str):
    """``partition`` with ``body``, as a learner's file would define it."""
    scope: dict = {}
    exec("def partition(sizes, world_size):\n" + body, scope)
    return scope["partition"]


GREEDY_FOR_TWO = ("    shards, owned = [[], []], [0, 0]\n"
                  "    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):\n"
                  "        r = owned.index(min(owned))\n"
                  "        shards[r].append(i)\n"
                  "        owned[r] += sizes[i]\n"
                  "    return shards\n")


def test_partition_is_checked_on_other_world_sizes_without_a_job():
    from ddp_course.course.tiny import tiny_model

    shape = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}  # the exercise's SHAPE
    named = [(n, p.numel()) for n, p in tiny_model(0, **shape).named_parameters()]
    names, sizes = [n for n, _ in named], [s for _, s in named]
    # every correct partition passes, however it balances and whatever sequences it returns
    for correct in (memory.zero1_partition, _contiguous, _in_order):
        assert grader.partition_problem(correct, sizes, names) is None, correct.__name__
    # each mistake below keeps the contract on the job's own case (2 ranks, MiniGPT's 28 tensors) and breaks it elsewhere
    problem = grader.partition_problem(_defined(DROPS_THE_REMAINDER), sizes, names)
    assert all(p in problem for p in ("without an owner", "on 3 ranks", "ln_f.bias", "28 = 9 x 3 + 1")), problem
    problem = grader.partition_problem(_defined(GREEDY_FOR_TWO), sizes, names)  # world_size ignored
    assert "returns 2 shards" in problem and "on 1 rank" in problem, problem
    everywhere = DROPS_THE_REMAINDER.replace("    return shards\n", "    for i in order[len(sizes) // world_size * world_size:]:\n"
                                                                     "        for shard in shards:\n"
                                                                     "            shard.append(i)\n"
                                                                     "    return shards\n")
    problem = grader.partition_problem(_defined(everywhere), sizes, names)  # the remainder on every rank
    assert "more than one rank" in problem and "ln_f.bias" in problem and "on 3 ranks" in problem, problem
    problem = grader.partition_problem(_defined("    if world_size != 2:\n"
                                                "        raise ValueError('two ranks only')\n" + GREEDY_FOR_TWO),
                                       sizes, names)
    assert "raised ValueError: two ranks only" in problem and ", 1)" in problem, problem
    pairs = ("    shards, owned = [[] for _ in range(world_size)], [0] * world_size\n"
             "    for k in range(0, len(sizes), 2):  # two parameters at a time: fine while there is an even number\n"
             "        r = owned.index(min(owned))\n"
             "        shards[r] += [k, k + 1]\n"
             "        owned[r] += sum(sizes[k:k + 2])\n"
             "    return shards\n")
    problem = grader.partition_problem(_defined(pairs), sizes, names)
    assert "not the index of a parameter" in problem and "[7, 5, 3, 3, 1]" in problem, problem


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


def test_shard_optimizer_takes_another_optimizer_class_and_refuses_parameter_groups(tmp_path):
    """A drop-in for ZeroRedundancyOptimizer's arguments: the grader calls the learner's shard_optimizer
    with SGD and its options before any job; an answer that always builds AdamW is named."""
    import torch

    from ddp_course.course.l09_fsdp import grader_zero1

    solution = tmp_path / "solution" / NAME
    solution.parent.mkdir()
    solution.write_text(answered_exercise(NAME))
    assert grader_zero1.learner_optimizer_problem(solution) is None
    always_adamw = exercise_attempt(tmp_path, NAME, "shard_optimizer",
                                    "    return torch.optim.AdamW([params[i] for i in shards[rank]], lr=LR)\n")
    problem = grader_zero1.learner_optimizer_problem(always_adamw)
    assert problem and "returned an optimizer of class AdamW" in problem and "optimizer_class" in problem, problem
    ignores_options = exercise_attempt(tmp_path, NAME, "shard_optimizer",
                                       "    return optimizer_class([params[i] for i in shards[rank]], lr=LR)\n")
    assert "pass the caller's keyword arguments" in grader_zero1.learner_optimizer_problem(ignores_options)
    script = grader_zero1._load_script(solution)
    with pytest.raises(TypeError, match="not parameter groups"):
        script.shard_optimizer([{"params": [torch.nn.Parameter(torch.zeros(2))]}], [[0]], 0)


def test_a_partition_that_calls_the_calculators_is_refused_without_a_job(tmp_path):
    """The lesson's calculator keeps the same greedy partition (memory.zero1_partition, imported by the
    notebook's first cells): the grader lists it in DELEGATES and refuses a partition() that hands its work
    to it, before any job."""
    from ddp_course.check import grade

    body = ("    from ddp_course.course.l09_fsdp import memory\n"
            "    return memory.zero1_partition(sizes, world_size)\n")
    verdict = grade("09_zero1", exercise_attempt(tmp_path, "09_zero1.py", "partition", body))
    assert not verdict.ok and "ddp_course.course.l09_fsdp.memory.zero1_partition" in verdict.message
