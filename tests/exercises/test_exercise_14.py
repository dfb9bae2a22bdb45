"""Exercise 14 (ring attention): the grader passes the solution and names each classic mistake.

The solution is graded as a learner's file is (lesson 14's grading cell's verdict, when it graded these
bytes). The wrong answers are not launched one job each: one 4-rank spawn runs the harness's own
``measure`` with each mistake's functions in place of the answer's -- what the learner's script computes
on every rank -- and the grader's ``diagnose`` judges those rows. A ring step that sends first on every
rank never finishes; that attempt is graded for real among the hang attempts of
``test_learner_errors.py``, which run side by side while waiting.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import notebook_runs
import pytest
from harness import answered_exercise, free_port, spawn

from ddp_course.course.l14_sequences_and_experts import grader
from ddp_course.course.l14_sequences_and_experts.ring_harness import MISTAKES

NAME = "14_ring_attention.py"


@pytest.mark.timeout(240)
def test_solution_passes(tmp_path):
    path = tmp_path / NAME
    path.write_text(answered_exercise(NAME), encoding="utf-8")
    verdict = notebook_runs.grade("14", path)
    assert verdict.ok, verdict.message
    assert "equals one process's attention on rings of 2 and 4 ranks" in verdict.message


def _solution_functions():
    """The answer's three functions, from the answered exercise (as the learner's file defines them)."""
    scope: dict = {}
    exec(compile(answered_exercise(NAME).replace('if __name__ == "__main__":', "if False:"), NAME, "exec"), scope)
    return scope["pass_on"], scope["block_scores"], scope["merge"]


def _measure_every_mistake(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from ddp_course.course.l14_sequences_and_experts.ring_harness import measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        pass_on, scores, merge = _solution_functions()
        rows = {}
        for name, swap in MISTAKES.items():
            rows[name] = measure(pass_on, swap.get("scores", scores), swap.get("combine", merge))
        Path(out, f"rank{rank}.json").write_text(json.dumps(rows), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mistaken(tmp_path_factory) -> dict[str, list[dict]]:
    """{mistake: the 4 ranks' RESULT rows of the answer with that mistake in place}."""
    out = tmp_path_factory.mktemp("ring_mistakes")
    spawn(_measure_every_mistake, (free_port(), str(out)), world=4)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {name: [r[name] for r in ranks] for name in MISTAKES}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MISTAKES))
def test_each_classic_mistake_is_named(mistaken, name):
    verdict = grader.diagnose(mistaken[name])
    assert not verdict.ok
    assert verdict.message.startswith(grader.WHY[name]), verdict.message
    others = [w for n, w in grader.WHY.items() if n != name]
    assert not any(w in verdict.message for w in others)


@pytest.mark.timeout(180)
def test_a_wrong_answer_that_is_no_classic_mistake_is_told_where_to_look(mistaken):
    rows = json.loads(json.dumps(mistaken["no causal mask"]))
    for r in rows:  # another error of the same size, equal to none of the simulations
        r["mistakes"] = {k: {n: d + 0.1 for n, d in v.items()} for k, v in r["mistakes"].items()}
    verdict = grader.diagnose(rows)
    assert not verdict.ok and "from each classic mistake's too" in verdict.message
    assert re.search(r"4 ranks, zigzag: \d\.\de-0\d", verdict.message)


def test_the_send_first_hint_names_the_cause():
    assert "every rank sent before it received" in grader.hint("RuntimeError: Timed out waiting 15000ms for send")
    assert grader.hint("ValueError: shapes") == ""
