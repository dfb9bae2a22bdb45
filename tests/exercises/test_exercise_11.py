"""Exercise 11's grader accepts the solution and rejects each classic mistake of tensor parallelism by
hand (the MLP split Megatron-style), saying which one it is.

Every wrong attempt is the answered solution with ONE body replaced -- a function's, or a method's of
the autograd functions f and g or of ``TensorParallelMLP`` -- by what a learner would have written
there; each is graded by a real 2-rank job. The diagnoses a job would take too long to show one by one
(the other slicing function, an extra all-reduce in g's backward) are checked on RESULT rows built in
this process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from harness import (
    ROOT,
    answered_exercise,
    at_once,
    exercise_attempt,
    grade_in_pairs,
    graded_answer,
    rejected_and_named,
)

from ddp_course import check
from ddp_course.course.l11_beyond_data_parallel import grader

NAME = "11_tensor_parallel.py"


def method_attempt(tmp_path: Path, qualname: str, body: str) -> Path:
    """The answered exercise with the body of method ``Class.method`` replaced by ``body`` (indented)."""
    cls, name = qualname.split(".")
    source = answered_exercise(NAME)
    klass = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    first = fn.body[1] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body[0]
    lines = source.splitlines(keepends=True)
    path = tmp_path / f"11_{cls}_{name}.py"
    path.write_text("".join(lines[:first.lineno - 1]) + body + "".join(lines[fn.end_lineno:]), encoding="utf-8")
    return path


@pytest.mark.timeout(120)
def test_solution_passes(tmp_path):
    path, verdict = graded_answer(tmp_path, "11", NAME, timeout=90)
    assert check.check_harness("11", path).ok  # the answer regions inside classes count as answers too
    assert verdict.ok, verdict.message
    assert "one-process reference" in verdict.message and "tolerance" in verdict.message


MISTAKES = {
    # g's forward hands the partial output on: each rank goes on with its own hidden units' share
    "no all-reduce after the row-parallel layer": (
        "ReduceFromParallelRegion.forward", "        return x\n",
        ("no all-reduce after the row-parallel proj", "g's forward must all-reduce")),
    # proj applied whole (with its bias) to the rank's hidden units: the all-reduce adds the bias N times
    "bias added on every rank": (
        "TensorParallelMLP.forward", "        x = CopyToParallelRegion.apply(x)\n"
                                     "        return self.drop(ReduceFromParallelRegion.apply(self.proj(F.gelu(self.fc(x)))))\n",
        ("added on every rank", "add proj's bias once")),
    # f's backward forgets the sum: the forward is right, the gradients before the MLP are not
    "no all-reduce of the input's gradient": (
        "CopyToParallelRegion.backward", "        return grad\n",
        ("no all-reduce of the input's gradient in f's backward", "LayerNorm")),
    # rows and columns swapped: nn.Linear's weight is (out_features, in_features)
    "weight sliced along the wrong dimension": (
        "column_shard", "    return fc.weight.chunk(world_size, dim=1)[rank], fc.bias.chunk(world_size)[rank]\n",
        ("sliced fc.weight along the wrong dimension", "rows (dim 0)")),
    # f all-reduces in forward as well as in backward: fc sees N times its input
    "an all-reduce in f's forward too": (
        "CopyToParallelRegion.forward", "        total = x.clone()\n"
                                        "        dist.all_reduce(total)\n"
                                        "        return total\n",
        ("all-reduce in the forward of the column-parallel side", "f's forward must return its input unchanged")),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict on the attempt with that mistake}, graded two at a time."""
    def path(where: str, body: str) -> Path:
        folder = tmp_path_factory.mktemp("attempt")
        return method_attempt(folder, where, body) if "." in where else exercise_attempt(folder, NAME, where, body)

    attempts = {m: path(where, body) for m, (where, body, _) in MISTAKES.items()}
    return grade_in_pairs(lambda p: grader.grade(p, timeout=90), attempts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


# --- the diagnoses on rows built here (no job) ------------------------------------------------------

def constants() -> dict:
    return grader.harness_constants(ROOT / "solutions" / "exercises" / NAME)


def rows_from_reference(scale: dict[str, float] | None = None) -> list[dict]:
    """RESULT rows of a script whose every number equals the grader's reference (times ``scale[name]``)."""
    c = constants()
    ref = grader.reference(c)
    scale = scale or {}
    return [{"rank": r, "shard_error": None, "shards_match": {}, "loss": ref["loss"], "logits_rel_diff": 1e-7,
             "grads": {n: {"norm": v * scale.get(n, 1.0), "rel_diff": 1e-7} for n, v in ref["norms"][r].items()},
             "losses": {"tp": ref["losses"], "single": ref["losses"]}} for r in range(grader.NPROC)]


def test_reference_rows_pass():
    assert grader.diagnose(rows_from_reference(), constants()).ok


def test_row_shard_sliced_along_the_wrong_dimension_is_named():
    rows = [{"rank": r, "shard_error": {"what": "row_shard's weight", "got": [16, 128], "want": [32, 64]}}
            for r in range(grader.NPROC)]
    message = grader.diagnose(rows, constants()).message
    assert "sliced proj.weight along the wrong dimension" in message and "columns (dim 1)" in message


def test_an_all_reduce_in_gs_backward_is_named():
    # the output's gradient summed over 2 ranks: every MLP weight's (and fc.bias's) gradient doubles
    doubled = {f"blocks.{b}{s}": 2.0 for b in range(2) for s in (".mlp.fc.weight", ".mlp.fc.bias", ".mlp.proj.weight")}
    message = grader.diagnose(rows_from_reference(doubled), constants()).message
    assert "2 times too large" in message and "g's backward" in message


def test_shards_of_the_wrong_block_are_named():
    rows = rows_from_reference()
    rows[1]["shards_match"] = {"blocks.0.mlp.fc.weight": False}
    assert "not the rank's block" in grader.diagnose(rows, constants()).message


def mistaken_rows(kind: str, rel: float = 0.0) -> list[dict]:
    """The reference rows with each rank's first loss that of the forward mistake ``kind`` (as the
    grader simulates it), moved by ``rel`` (relative): what a job with that mistake reports."""
    rows = rows_from_reference()
    losses = grader.mistaken_losses(constants())[kind]
    for r in range(grader.NPROC):
        rows[r]["loss"] = losses[r if len(losses) == grader.NPROC else 0] * (1 + rel)
    return rows


@pytest.mark.parametrize("kind", list(grader.WHAT_TO_DO))
def test_forward_mistake_named_by_the_nearest_simulation_with_its_margin(kind):
    # 3e-6 is 4x the largest rounding difference measured between 2 ranks and one process (8e-7)
    message = grader.diagnose(mistaken_rows(kind, rel=3e-6), constants()).message
    assert message.startswith(grader.WHAT_TO_DO[kind].format(n=grader.NPROC)[:40])
    assert "from the grader's simulation of this mistake" in message and "next nearest explanation" in message


def test_forward_between_two_explanations_is_not_forced_into_one():
    c = constants()
    sims = grader.mistaken_losses(c)
    rows = rows_from_reference()
    for r in range(grader.NPROC):  # halfway between proj's bias on every rank and an all-reduce in f's forward
        rows[r]["loss"] = (sims["bias"][0] + sims["f_forward"][0]) / 2
    assert grader.diagnose(rows, c).message.startswith("the forward differs from one process")


def test_diagnosis_holds_while_another_thread_grades():
    """The cause of wrong names seen on a slower CPU: the tests grade two attempts at a time, in threads,
    and each grader builds its one-process model from torch's global RNG, which threads share. Two
    threads seeding and drawing at once built models no rank had, so the simulations missed the ranks'
    losses. Here both threads diagnose at the same moment, eight times over, with nothing cached."""
    rows, c = mistaken_rows("partial"), constants()
    for _ in range(8):
        grader._reference.cache_clear()
        for v in at_once(lambda: grader.diagnose(rows, c), 2):
            assert "no all-reduce after the row-parallel proj" in v.message, v.message


def test_a_bias_added_on_rank_0_only_is_named_not_taken_for_copies():
    """proj's bias inside `if rank == 0:` before g: the forward is right, and rank 1's proj.bias gets no
    gradient. The grader used to say "not with copies of them"; it now names the one-rank use."""
    rows = rows_from_reference()
    for name in rows[1]["grads"]:
        if name.endswith(".mlp.proj.bias"):
            rows[1]["grads"][name] = {"norm": None, "rel_diff": None}
    message = grader.diagnose(rows, constants()).message
    assert "none on rank(s) [1]" in message and "not inside `if rank == 0:`" in message, message
    assert "copies" not in message
    for r in rows:  # missing on every rank: still the copies
        for name in r["grads"]:
            if name.endswith(".mlp.proj.bias"):
                r["grads"][name] = {"norm": None, "rel_diff": None}
    assert "not with copies of them" in grader.diagnose(rows, constants()).message


@pytest.mark.parametrize("module", ["ddp_course.course.l11_beyond_data_parallel.tp_lab", "ddp_course.parallel._tensor_parallel"])
def test_shards_cut_with_the_labs_hidden_block_are_refused_without_a_job(tmp_path, module):
    """The script used to import ``hidden_block`` from the lab, which returns a rank's slice of the hidden units:
    column_shard and row_shard, done. The script no longer imports it (its model comes from ``biased``), and a
    shard that hands its work to it, reached through the lab or its source, is refused before any job."""
    body = (f"    from {module} import hidden_block\n"
            "    block = hidden_block(fc.out_features, rank, world_size)\n"
            "    return fc.weight[block], fc.bias[block]\n")
    verdict = check.grade("11_tensor_parallel", exercise_attempt(tmp_path, NAME, "column_shard", body))
    assert not verdict.ok and "ddp_course.parallel._tensor_parallel.hidden_block" in verdict.message, verdict.message
    assert "hidden_block" not in (ROOT / "lessons" / "exercises" / NAME).read_text(encoding="utf-8")
