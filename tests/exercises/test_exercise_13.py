"""Exercise 13's grader accepts the 2-D plan and rejects the classic mistakes of it, naming each.

Every wrong attempt is the answered solution with the body of ``parallelize`` (or ``make_mesh``)
replaced by what a learner would write. Four are graded by real 4-rank jobs, two at a time: FSDP given
the whole mesh, tensor parallelism after ``fully_shard`` and plan keys that name no module, which fail
on an exception or a warning of PyTorch's that the grader reads (a job is the only honest test of
another version's wording), and the mesh's dimensions the other way round, which trains like one
process and is told apart only by the ranks of each group the job reports. The others are judged on
what real jobs of those attempts reported, kept below: the placements of a job that left the root
unsharded (``ROOT_UNSHARDED``) and of one that swapped the mesh's dimensions between tensor
parallelism and FSDP (``DIMS_SWAPPED``), and the layouts the probe recorded (``PROBES``,
``BATCH_SPLIT``), so that each classic mistake has its test without a job of its own.
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


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The answered exercise graded (the notebook's grading of the same file, when it ran in this session):
    (its verdict, its path)."""
    path, verdict = graded_answer(tmp_path_factory.mktemp("solution"), "13", NAME)
    return verdict, path


@pytest.mark.timeout(180)
def test_solution_passes(solution):
    verdict, path = solution
    assert check.check_harness("13", path).ok
    assert verdict.ok, verdict.message
    assert "trains like one process" in verdict.message and "as the plan derives them" in verdict.message
    assert {r["rank"]: r["groups"]["tp"] for r in verdict.records} == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}


def _swap_dims(text: str) -> str:
    return text.replace('mesh["tp"]', "@").replace('mesh["dp"]', 'mesh["tp"]').replace("@", 'mesh["dp"]')


# name: (the function replaced, its body, what the verdict must say)
MISTAKES = {
    "FSDP over the whole mesh": ("parallelize", PRE + BLOCK + ROOT + FSDP.replace('mesh=mesh["dp"]', "mesh=mesh"),
                                 ("FSDP given the whole 2-D mesh", "mesh=mesh['dp']")),
    # the plan's first entry a column-wise layer: distribute_tensor meets FSDP's DTensor (SequenceParallel
    # first meets it in DTensor.from_local instead: test_tensor_parallelism_after_fsdp_in_either_words)
    "tensor parallelism after fully_shard": (
        "parallelize", PRE + FSDP.replace("    return model\n", "") + BLOCK.replace(
            '"ln1": SequenceParallel(), "attn": gather,\n            "attn.qkv": ColwiseParallel(),',
            '"attn.qkv": ColwiseParallel(), "ln1": SequenceParallel(), "attn": gather,') + ROOT + "    return model\n",
        ("Cannot distribute a DTensor", "tensor parallelism applied after fully_shard", "Split over tp first")),
}


@pytest.mark.timeout(420)
def test_mistakes_graded_by_real_jobs_are_rejected_and_named(tmp_path):
    """Each attempt against what the grader says of it. Guards: tensor parallelism after fully_shard
    in PyTorch's other words ("Cannot distribute a DTensor ... to a different device mesh"), once shown
    with no cause. (Plan keys that name no module and the mesh the other way round are judged below from
    what a job of theirs prints and reports: the grader reads nothing else of them.)"""
    folders = [tmp_path / str(i) for i in range(len(MISTAKES))]
    for folder in folders:
        folder.mkdir()
    attempts = {name: exercise_attempt(folder, NAME, function, body)
                for folder, (name, (function, body, _)) in zip(folders, MISTAKES.items())}
    verdicts = grade_in_pairs(lambda path: check.grade("13", path), attempts)
    for name, (_, _, words) in MISTAKES.items():
        v = verdicts[name]
        assert not v.ok, name
        for w in words:
            assert w in v.message, (name, w, v.message)


def _warning(key: str, token: str, module: str, children: list[str]) -> str:
    """parallelize_module's warning for a plan key that names no module, as a rank prints it
    (torch/distributed/tensor/parallel/api.py: the module's repr follows the token, one child a line)."""
    lines = [f"[rank0]:.../torch/distributed/tensor/parallel/api.py:108: UserWarning: Parallelize plan key '{key}' "
             f"could not be resolved: no submodule matching token '{token}' in module {module}("]
    lines += [f"[rank0]:  ({c}): Linear(in_features=64, out_features=64, bias=True)" for c in children]
    return "\n".join([*lines, "[rank0]:), skipping this plan entry."])


def test_plan_keys_that_name_no_module_are_named_from_the_jobs_output():
    """GPT-2's module names where MiniGPT has qkv and fc: parallelize_module warns and skips both keys, and the
    job then fails in PyTorch's words alone ("aten.addmm.default got mixed torch.Tensor and DTensor"), as
    the verdict once showed it. The grader names each key and the children the module does have."""
    output = "\n".join([_warning("c_attn", "c_attn", "HeadParallelAttention", ["qkv", "proj", "resid_drop"]),
                        _warning("c_fc", "c_fc", "MLP", ["fc", "act", "proj", "drop"]),
                        "[rank0]: RuntimeError: aten.addmm.default: got mixed torch.Tensor and DTensor, need to "
                        "convert all torch.Tensor to DTensor before calling distributed operators!"])
    said = grader.hint(output)
    for words in ("name no module", "'attn.c_attn' (HeadParallelAttention has qkv, proj, resid_drop, no 'c_attn')",
                  "'mlp.c_fc'", "got mixed torch.Tensor and DTensor"):
        assert words in said, (words, said)


def test_the_mesh_the_other_way_round_is_named_from_the_groups_the_job_reports(solution):
    """tp the outer dimension (tp groups {0, 2}, {1, 3}): the same numbers and collectives as the plan on 4
    CPU ranks, once accepted (the grader compared the mesh's sizes only). The records are the solution's
    job's, each rank's groups as init_device_mesh((TP, world_size // TP), ("tp", "dp")) makes them."""
    verdict, path = solution
    swapped = [{**r, "groups": {**r["groups"], "tp": [r["rank"] % 2, r["rank"] % 2 + 2],
                                "dp": [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1]}} for r in verdict.records]
    v = grader.diagnose(swapped, grader.expected(path))
    assert not v.ok
    for words in ("dimensions the other way round", "tensor-parallel group is ranks [0, 2]", "last (innermost)"):
        assert words in v.message, (words, v.message)


def test_tensor_parallelism_after_fsdp_in_either_words():
    """PyTorch refuses a parallel style on a parameter FSDP already sharded in two ways, depending on the
    style that meets it first (torch/distributed/tensor/_api.py): both name the order. The other one's
    lines the grader reads (the exception, a frame of parallelize_module), as a job of the attempt with
    SequenceParallel first printed them."""
    output = ("[rank0]:   File \".../torch/distributed/tensor/parallel/api.py\", line 86, in parallelize_module\n"
              "[rank0]: RuntimeError: the local_tensor argument only accepts torch.Tensor but got "
              "<class 'torch.distributed.tensor.DTensor'> value.\n")
    assert "tensor parallelism applied after fully_shard" in grader.hint(output)
    other = ("ValueError: Cannot distribute a DTensor with device mesh DeviceMesh((dp=2), 'cpu', stride=(2,)) to a "
             "different device mesh DeviceMesh((tp=2), 'cpu', stride=(1,)).")
    assert "tensor parallelism applied after fully_shard" in grader.hint(other)


def test_an_answer_that_calls_the_course_plan_is_refused(tmp_path):
    """The plans live in ``parallel._tp_plan``, which the exercise does not import; reaching for them is
    refused before any job (the grader's DELEGATES)."""
    body = ('    from ddp_course.parallel._tp_plan import tensor_parallel\n'
            '    tensor_parallel(model, mesh["tp"])\n' + FSDP)
    path = exercise_attempt(tmp_path, NAME, "parallelize", body)
    verdict = check.grade("13", path)
    assert not verdict.ok and "parallelize() hands its work to the course's own version" in verdict.message, verdict


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


# A job of PRE + BLOCK + ROOT + FSDP with mesh["tp"] and mesh["dp"] swapped (tensor parallelism over
# dp, FSDP over tp): rank 0's parameters' mesh dimensions
DIMS_SWAPPED = {**{n: {"dims": ["tp"]} for n in ("tok_emb.weight", "pos_emb.weight")},
                **{f"blocks.{b}.{m}.{w}": {"dims": ["tp", "dp"]} for b in (0, 1)
                   for m in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj") for w in ("weight", "bias")},
                **{n: {"dims": ["tp", "dp"]} for n in ("ln_f.weight", "ln_f.bias")}}


def test_tensor_parallelism_and_fsdp_on_each_others_dimension_are_named():
    """Guards the cause: the grader once said "the root is not sharded" (tok_emb.weight is sharded, over tp)."""
    problem = grader._placement_problem({"params": DIMS_SWAPPED})
    assert problem is not None and "the root is not sharded" not in problem
    for w in ("tensor parallelism ran over mesh['dp'] and FSDP over mesh['tp']", "swapped"):
        assert w in problem, (w, problem)


# A job of the plan with Shard(0) for Shard(1) and SequenceParallel(sequence_dim=0): the stream split on
# the batch. Its numbers and its collectives are the plan's; the probe's records show where it differs
BATCH_SPLIT = [
    _rec("blocks.0", (False, [], 16), (False, [], 16)), _rec("blocks.0.ln1", (True, ["S(0)"], 16), (True, ["S(0)"], 16), ["R"]),
    _rec("blocks.0.attn", (True, ["R"], 16), (False, [], 16)),
    _rec("blocks.0.attn.qkv", (True, ["R"], 16), (False, [], 16), ["S(0)"]),
    _rec("blocks.0.attn.proj", (True, ["S(2)"], 16), (False, [], 16), ["S(1)"]),
    _rec("blocks.0.ln2", (True, ["S(0)"], 16), (True, ["S(0)"], 16), ["R"]),
    _rec("blocks.0.mlp", (True, ["R"], 16), (False, [], 16)),
    _rec("blocks.0.mlp.fc", (True, ["R"], 16), (False, [], 16), ["S(0)"]),
    _rec("blocks.0.mlp.proj", (True, ["S(2)"], 16), (False, [], 16), ["S(1)"]),
    _rec("ln_f", (True, ["S(0)"], 16), (True, ["S(0)"], 16), ["R"]), _rec("head", (False, [], 16), (False, [], 16)),
]


def test_the_stream_split_on_the_batch_is_not_sequence_parallelism(solution):
    """Guards: the plan with the batch in place of the sequence was accepted -- the same numbers, the same
    collectives. Judged as the solution's own job, with rank 0's probe that of the real job of the
    attempt."""
    verdict, path = solution
    found = [dict(r, probe=BATCH_SPLIT) if r["rank"] == 0 else r for r in verdict.records]
    v = grader.diagnose(found, grader.expected(path))
    assert not v.ok
    for w in ("split on dimension 0, the batch", "not sequence parallelism", "Shard(1)"):
        assert w in v.message, (w, v.message)
    assert "dimension 0" in grader.layout_problem(BATCH_SPLIT)


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
