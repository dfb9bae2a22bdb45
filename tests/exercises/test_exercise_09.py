"""Exercise 09 (FSDP2 by hand): the grader passes the solution and explains wrong sharding -- only the
root sharded, no root, blocks sharded as one unit -- from the norms and the all-gathers each forward makes.
"""

from __future__ import annotations

import notebook_runs
import pytest
from harness import answered_exercise, exercise_attempt


@pytest.mark.timeout(240)
def test_grader_passes_the_solution_and_explains_wrong_sharding(tmp_path):
    from ddp_course.course.l09_fsdp import grader

    path = tmp_path / "09_fsdp.py"
    path.write_text(answered_exercise(path.name))
    verdict = notebook_runs.grade("09_fsdp", path, timeout=180)  # lesson 09's grading cell's, when it graded these bytes
    assert verdict.ok, verdict.message
    found = verdict.records  # the RESULT rows of the script's run on 2 ranks
    constants = grader.harness_constants(path)
    reference = grader.reference_norms(constants)
    budget = grader.forward_budget(constants)
    verdict = grader.diagnose(found, reference, constants["LR"], budget)
    assert verdict.ok, verdict.message
    # one unit per block: one all-gather per block plus the root's, the root's and one block's bytes at most
    assert all(f["forward"] == {"all_gathers": 3, "peak_gathered_bytes": budget["peak_gathered_bytes"]} for f in found)
    assert "one forward issued 3 all-gathers" in verdict.message
    # the diagnosis on the solution's own report, altered the way typical mistakes alter it
    only_root = [{**f, "units": {"root": True, "blocks": [False, False]}} for f in found]
    v = grader.diagnose(only_root, reference, constants["LR"])
    assert not v.ok and "before the root" in v.message
    no_root = [{**f, "plain_params": ["tok_emb.weight", "pos_emb.weight"]} for f in found]
    v = grader.diagnose(no_root, reference, constants["LR"])
    assert not v.ok and "fully_shard(model, mesh=mesh) after the blocks" in v.message
    # blocks kept whole after their forward (reshard_after_forward=False): as many all-gathers, a higher peak
    total = found[0]["total_bytes"]
    kept = [{**f, "forward": {"all_gathers": 3, "peak_gathered_bytes": total}} for f in found]
    v = grader.diagnose(kept, reference, constants["LR"], budget)
    assert not v.ok and "reshard_after_forward=False" in v.message and f"{total:,}" in v.message, v.message
    # units smaller than a block (each block's attention and MLP too): more all-gathers, less held at once
    finer = [{**f, "forward": {"all_gathers": 7, "peak_gathered_bytes": budget["peak_gathered_bytes"] - 4_000}}
             for f in found]
    assert grader.diagnose(finer, reference, constants["LR"], budget).ok


BLOCKS_IN_ONE_UNIT = "    fully_shard(list(model.blocks), mesh=mesh)\n    fully_shard(model, mesh=mesh)\n    return model\n"


@pytest.mark.timeout(240)
def test_grader_names_blocks_sharded_as_one_unit_by_what_the_forward_gathers(tmp_path):
    """``fully_shard(list(model.blocks))`` makes every block an FSDP module, as the unit checks see it;
    the grader tells it from one unit per block by the first forward's all-gathers and peak bytes."""
    from ddp_course import check
    from ddp_course.course.l09_fsdp import grader

    path = exercise_attempt(tmp_path, "09_fsdp.py", "shard", BLOCKS_IN_ONE_UNIT)
    verdict = check.grade("09_fsdp", path, timeout=180)
    assert not verdict.ok, verdict.message
    budget = grader.forward_budget(grader.harness_constants(path))
    total = budget["root_bytes"] + budget["n_blocks"] * budget["block_bytes"]
    for phrase in ("all 2 blocks are gathered at once", "2 all-gathers instead of 3",
                   f"up to {total:,} parameter bytes whole at once instead of {budget['peak_gathered_bytes']:,}",
                   "fully_shard(block, mesh=mesh) on each block by itself"):
        assert phrase in verdict.message, verdict.message
    assert all(r["units"] == {"root": True, "blocks": [True, True]} for r in verdict.records)  # what isinstance sees


def test_an_answer_that_calls_the_course_strategy_is_refused_without_a_job(tmp_path):
    """The course's --strategy=fsdp (parallel.fsdp.wrap, printed after the grading cell) is the answer: the
    grader lists it in DELEGATES and refuses a shard() that hands its work to it, before any job."""
    from ddp_course.check import grade

    body = ("    from ddp_course.parallel import fsdp\n"
            "    return fsdp.wrap(model, None, None)\n")
    verdict = grade("09_fsdp", exercise_attempt(tmp_path, "09_fsdp.py", "shard", body))
    assert not verdict.ok and "hands its work to the course's own version, ddp_course.parallel.fsdp.wrap" in verdict.message
