"""Exercise 13's grader accepts the 2-D plan and rejects the classic mistakes of it, naming each.

Every wrong attempt is the answered solution with the body of ``parallelize`` replaced by what a
learner would write. Two are graded by real 4-rank jobs, side by side: FSDP given the whole mesh and
tensor parallelism after ``fully_shard``, which fail before training on an exception of PyTorch's
that the grader reads (a job is the only honest test of another version's wording). The others are
judged on what real jobs of those attempts reported, kept below: the placements of a job that left
the root unsharded (``ROOT_UNSHARDED``) and the layouts the probe recorded (``PROBES``), so that each
classic mistake has its test without a job of its own.
"""

from __future__ import annotations

import pytest
from harness import exercise_attempt, grade_in_pairs, graded_answer

from ddp_course import check
from ddp_course.course.l13_two_dimensions import grader

NAME = "13_two_d_plan.py"
PRE = ('    prepare_attention(model, mesh["tp"].size())\n'
       '    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))\n')
BLOCK = '''    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "ln1": SequenceParallel(), "attn": gather,
            "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp": gather,
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
'''
ROOT = '''    parallelize_module(model, mesh["tp"], {
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "ln_f": SequenceParallel(),
        "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
    })
'''
FSDP = '''    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
'''


@pytest.mark.timeout(180)
def test_solution_passes(tmp_path):
    path, verdict = graded_answer(tmp_path, "13", NAME)
    assert check.check_harness("13", path).ok
    assert verdict.ok, verdict.message
    assert "trains like one process" in verdict.message and "as the plan derives them" in verdict.message


MISTAKES = {
    "FSDP over the whole mesh": (PRE + BLOCK + ROOT + FSDP.replace('mesh=mesh["dp"]', "mesh=mesh"),
                                 ("FSDP given the whole 2-D mesh", "mesh=mesh['dp']")),
    "tensor parallelism after fully_shard": (PRE + FSDP.replace("    return model\n", "") + BLOCK + ROOT + "    return model\n",
                                             ("tensor parallelism applied after fully_shard", "Split over tp first")),
}


@pytest.mark.timeout(240)
def test_mistakes_that_fail_on_pytorchs_exceptions_are_rejected_and_named(tmp_path):
    folders = [tmp_path / str(i) for i in range(len(MISTAKES))]
    for folder in folders:
        folder.mkdir()
    attempts = {name: exercise_attempt(folder, NAME, "parallelize", body)
                for folder, (name, (body, _)) in zip(folders, MISTAKES.items())}
    verdicts = grade_in_pairs(lambda path: check.grade("13", path), attempts)
    for name, (_, words) in MISTAKES.items():
        v = verdicts[name]
        assert not v.ok, name
        for w in words:
            assert w in v.message, (name, w, v.message)


# --- the other layout mistakes, on the probe records of real jobs ------------------------------------------

def _rec(module: str, inp: tuple | None, out: tuple | None, weight: list[str] | None = None) -> dict:
    """One probe record: (dtensor, placements, local tokens) of the input and output, of 16 tokens."""
    def lay(x):
        return None if x is None else {"dtensor": x[0], "placements": x[1], "local_seq": x[2], "seq": 16}
    return {"module": module, "input": lay(inp), "output": lay(out), "weight": weight or []}


PLAN_RECORDS = [
    _rec("blocks.0", (False, [], 8), (False, [], 8)), _rec("blocks.0.ln1", (True, ["S(1)"], 8), (True, ["S(1)"], 8)),
    _rec("blocks.0.attn", (True, ["R"], 16), (False, [], 8)),
    _rec("blocks.0.attn.qkv", (True, ["R"], 16), (False, [], 16), ["_S(0, 2)", "S(0)"]),
    _rec("blocks.0.attn.proj", (True, ["S(2)"], 16), (False, [], 8), ["_S(0, 2)", "S(1)"]),
    _rec("blocks.0.ln2", (True, ["S(1)"], 8), (True, ["S(1)"], 8)),
    _rec("blocks.0.mlp", (True, ["R"], 16), (False, [], 8)),
    _rec("blocks.0.mlp.fc", (True, ["R"], 16), (False, [], 16), ["_S(0, 2)", "S(0)"]),
    _rec("blocks.0.mlp.proj", (True, ["S(2)"], 16), (False, [], 8), ["_S(0, 2)", "S(1)"]),
    _rec("ln_f", (True, ["S(1)"], 8), (True, ["S(1)"], 8)), _rec("head", (False, [], 16), (False, [], 16)),
]


def _with(**changes) -> list[dict]:
    """The plan's records with some replaced (by module name), cut after the last replaced one when
    ``cut`` names where the job crashed."""
    cut = changes.pop("cut", None)
    out = [changes.get(r["module"].replace(".", "_"), r) for r in PLAN_RECORDS]
    return out[:[r["module"] for r in out].index(cut) + 1] if cut else out


# A job of PRE + BLOCK + ROOT + FSDP without its last line (fully_shard on the model): where rank 0's
# parameters lived (its RESULT line's "params", mesh dimensions only)
ROOT_UNSHARDED = {**{n: {"dims": []} for n in ("tok_emb.weight", "pos_emb.weight")},
                  **{f"blocks.{b}.{m}.{w}": {"dims": ["dp", "tp"]} for b in (0, 1)
                     for m in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj") for w in ("weight", "bias")},
                  **{n: {"dims": ["tp"]} for n in ("ln_f.weight", "ln_f.bias")}}


def test_the_root_left_unsharded_is_named_from_the_placements():
    problem = grader._placement_problem({"params": ROOT_UNSHARDED})
    assert problem is not None
    for w in ("the root is not sharded", "tok_emb.weight, pos_emb.weight, ln_f.weight, ln_f.bias",
              "fully_shard(model, mesh=mesh['dp'])"):
        assert w in problem, (w, problem)


PROBES = {
    # RowwiseParallel() on attn.proj (its output all-reduced, whole): recorded from a job of that attempt,
    # which crashed at the residual addition after the probe's last record
    "a row-wise output reduced to the whole sequence": (
        [_rec("blocks.0", (False, [], 8), None), _rec("blocks.0.ln1", (True, ["S(1)"], 8), (True, ["S(1)"], 8), ["R"]),
         _rec("blocks.0.attn", (True, ["R"], 16), (False, [], 16)),
         _rec("blocks.0.attn.qkv", (True, ["R"], 16), (False, [], 16), ["S(0)"]),
         _rec("blocks.0.attn.proj", (True, ["S(2)"], 16), (False, [], 16), ["S(1)"])],
        ("attn.proj hands on the whole sequence", "RowwiseParallel(output_layouts=Shard(1))")),
    # SequenceParallel(use_local_output=True) and no gather before the MLP: fc takes the slice for the whole
    "a slice taken for the whole sequence": (
        _with(blocks_0_mlp=_rec("blocks.0.mlp", (False, [], 8), (False, [], 4)),
              blocks_0_mlp_fc=_rec("blocks.0.mlp.fc", (True, ["R"], 8), (False, [], 8), ["_S(0, 2)", "S(0)"]),
              cut="blocks.0.mlp.proj"),
        ("mlp receives a slice of the sequence", "PrepareModuleInput")),
    # PrepareModuleOutput(Partial -> Shard(1)) on attn after RowwiseParallel(output_layouts=Shard(1))
    "reduced twice": (
        _with(blocks_0_attn=_rec("blocks.0.attn", (True, ["R"], 16), (False, [], 4)), cut="blocks.0.attn.proj"),
        ("reduced and cut onto the sequence twice",)),
    # attn.proj given ColwiseParallel
    "a row-wise layer split column-wise": (
        _with(blocks_0_attn_proj=_rec("blocks.0.attn.proj", (True, ["S(2)"], 16), None, ["_S(0, 2)", "S(0)"]),
              cut="blocks.0.attn.proj"),
        ("attn.proj is split column-wise", "RowwiseParallel")),
    # ln2 left out of the plan: a plain LayerNorm on the slice
    "a LayerNorm without SequenceParallel": (
        _with(blocks_0_ln2=_rec("blocks.0.ln2", (False, [], 8), (False, [], 8))),
        ("ln2 normalises a slice of the sequence as a plain module", "SequenceParallel()")),
}


@pytest.mark.parametrize("name", list(PROBES))
def test_layout_mistakes_are_named_from_the_probe(name):
    records, words = PROBES[name]
    problem = grader.layout_problem(records)
    assert problem is not None, name
    for w in words:
        assert w in problem, (name, w, problem)


def test_the_plans_own_layouts_are_no_problem():
    assert grader.layout_problem(PLAN_RECORDS) is None
