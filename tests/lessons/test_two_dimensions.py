"""Lesson 13 (two dimensions at once): the 2-D lab against one process, the plan's predictions, the
strategy ``fsdp_tp`` in the training loop (trained, resumed bit for bit, loaded at other mesh shapes),
what the plan needs from PyTorch as it is, and the third dimension (pipeline stages over the 2-D plan).

The jobs are the notebook's: under ``make test`` each test reads the notebook's run of the same job
(``notebook_runs.reuse``) instead of launching it again.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta

import notebook_runs
import pytest
import torch
import torch.distributed as dist
from harness import free_port, python_module, spawn

from ddp_course import checkpoint
from ddp_course.course.l11_beyond_data_parallel import plan
from ddp_course.course.l13_two_dimensions import layouts, limits, two_d_harness
from ddp_course.dist import clean_exit
from ddp_course.launch import run

LAB = "ddp_course.course.l13_two_dimensions.two_d_lab"
# the notebook's training runs, option for option (solutions/13_two_dimensions.ipynb, section 7)
TRAIN = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, micro_batch_size=4, max_steps=8, log_interval=1,
             eval_interval=0, eval_batches=2, lr=3e-3, ckpt_format="sharded", ckpt_interval=4)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    job = notebook_runs.reuse("runs/13_lab", LAB, 4)
    if job is None:
        job = run(LAB, nproc=4, out_dir=tmp_path_factory.mktemp("two_d_lab"), timeout=240, progress=False, echo="none")
    return json.loads((job.out_dir / "two_d_lab.json").read_text())


@pytest.mark.timeout(300)
def test_every_variant_trains_like_one_process(lab):
    tol = lab["tolerances"]
    assert set(lab["variants"]) == {"sp", "no_sp", "vocab"} and (lab["dp"], lab["tp"]) == (2, 2)
    for name, v in lab["variants"].items():
        assert v["matches"], (name, v["loss_rel_diff"], v["grad_rel_err"], v["update_rel_diff"])
        assert v["loss_rel_diff"] <= tol["loss_rtol"] and v["grad_rel_err"] <= tol["grad_rtol"]
        assert v["update_rel_diff"] <= tol["update_rtol"]


@pytest.mark.timeout(300)
def test_bytes_per_rank_equal_the_prediction(lab):
    shape, dp, tp = lab["shape"], lab["dp"], lab["tp"]
    predicted = layouts.predicted_states(shape, dp, tp)
    batch = lab["options"]["batch_size"] // dp
    acts = {"sp": layouts.sequence_parallel_activations(shape, batch, tp),
            "no_sp": plan.fsdp_tp(shape, dp * tp, lab["options"]["batch_size"], tp_size=tp).activations}
    for name in ("sp", "no_sp"):
        for r in lab["variants"][name]["per_rank"]:
            p = predicted[r["rank"]]
            assert (r["states"]["params"], r["states"]["grads"], r["states"]["optimizer"]) == (
                p["params"], p["grads"], p["optimizer"]), (name, r["rank"])
            assert r["activations"] == acts[name], (name, r["rank"])
    assert acts["sp"] < acts["no_sp"]


@pytest.mark.timeout(300)
def test_collectives_per_mesh_dimension_equal_the_derived_table(lab):
    """Every variant's counts, ``vocab`` included: its loss's three all-reduces over tp, issued inside
    DTensor's handlers under ``loss_parallel``, are counted (``two_d_harness.CollectiveCounter``)."""
    L = lab["shape"]["n_layer"]
    for name, options in (("sp", {}), ("no_sp", {"sequence_parallel": False}), ("vocab", {"vocab_parallel": True})):
        want = layouts.expected_collectives(L, dp=lab["dp"], **options)
        assert all(r["collectives"] == want for r in lab["variants"][name]["per_rank"]), name


def _counter_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils._python_dispatch import _disable_current_modes

    torch.set_num_threads(1)
    with clean_exit():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        g = torch.Generator().manual_seed(0)
        logits = distribute_tensor(torch.randn(4, 6, generator=g), mesh, [Shard(1)])  # sharded by vocabulary
        target = torch.randint(6, (4,), generator=g)
        found = {}
        with two_d_harness.CollectiveCounter(two_d_harness.mesh_groups(mesh)) as c, loss_parallel():
            torch.nn.functional.cross_entropy(logits, target)
        found["loss_parallel"] = c.counts
        with two_d_harness.CollectiveCounter(two_d_harness.mesh_groups(mesh)) as c:
            logits.redistribute(mesh, [Replicate()])  # DTensor's redistribution, from Python
            dist.all_reduce(torch.ones(2), group=mesh.get_group())  # c10d's, as FSDP issues them
        found["outside"] = c.counts
        with two_d_harness.CollectiveCounter(two_d_harness.mesh_groups(mesh)) as c, _disable_current_modes():
            dist.all_reduce(torch.ones(2), group=mesh.get_group())  # one that no dispatch mode sees
        found["hidden"] = c.counts
        torch.save(found, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_counter_counts_the_collectives_dtensor_issues_inside_its_handlers(tmp_path):
    """Guards the lab's and the exercise's collective counts (``two_d_harness.CollectiveCounter``).

    ``loss_parallel``'s cross-entropy issues three all-reduces over the vocabulary shards (the largest
    logit, the sum of exponentials, the target's logit) inside DTensor's own op handlers, where a
    dispatch mode that runs each operator itself is switched off: the counter once counted none of
    them. And a collective that the counter cannot see at all is still counted, as ``unseen``, from
    the process group's own numbering of what it ran."""
    spawn(_counter_worker, (free_port(), str(tmp_path)), 2)
    for rank in range(2):
        found = torch.load(tmp_path / f"rank{rank}.pt")
        assert found["loss_parallel"] == {"tp:all_reduce": 3}, (rank, found)
        assert found["outside"] == {"tp:all_gather": 1, "tp:all_reduce": 1}, (rank, found)
        assert found["hidden"] == {"tp:unseen": 1}, (rank, found)


def test_the_derived_table_for_more_blocks():
    t = layouts.expected_collectives(4, sequence_parallel=True, dp=2)
    assert t["forward"] == {"tp:all_gather": 9, "tp:reduce_scatter": 8, "dp:all_gather": 5}
    assert t["backward"] == {"tp:all_gather": 9, "tp:reduce_scatter": 8, "tp:all_reduce": 18, "dp:all_gather": 4,
                             "dp:reduce_scatter": 5}
    assert layouts.expected_collectives(4, sequence_parallel=False, dp=1) == {
        "forward": {"tp:all_reduce": 8}, "backward": {"tp:all_reduce": 8}}
    v = layouts.expected_collectives(4, vocab_parallel=True, dp=2)
    assert v["forward"] == {**t["forward"], "tp:all_reduce": 4}
    assert v["backward"] == {**t["backward"], "tp:reduce_scatter": 9}


def test_the_plan_table_reads_the_styles():
    from ddp_course.parallel import _tp_plan as tp_plan

    rows = {r[0]: r for r in layouts.describe(tp_plan.block_plan(True), layouts.BLOCK_ORDER)}
    assert rows["ln1"][1:] == ("SequenceParallel", "S(1)", "S(1)")
    assert rows["attn"][1:] == ("PrepareModuleInput", "S(1)", "R")
    assert rows["attn.proj"][3].endswith("S(1)") and rows["attn.qkv"][3] == "S(-1)"


# --- the strategy (its layout and refusals: tests/core/test_strategies.py) ------------------------------

def _train(rel: str, nproc: int, tmp_path_factory, **flags):
    job = notebook_runs.reuse(rel, "ddp_course.train", nproc, **{**TRAIN, **flags})
    if job is None:
        out = tmp_path_factory.mktemp(rel.split("/")[-1])
        job = run("ddp_course.train", nproc=nproc, out_dir=out, timeout=300, progress=False, echo="none",
                  **{**TRAIN, **flags})
    return job


@pytest.fixture(scope="module")
def two_d(tmp_path_factory):
    return _train("runs/13_fsdp_tp", 4, tmp_path_factory, strategy="fsdp_tp", tp=2)


@pytest.mark.timeout(400)
def test_fsdp_tp_trains_like_ddp_on_the_same_batches(two_d, tmp_path_factory):
    ddp = _train("runs/13_ddp", 2, tmp_path_factory, strategy="ddp")
    (sa, la), (sb, lb) = two_d.series("loss"), ddp.series("loss")
    assert sa == sb and max(abs(a - b) / b for a, b in zip(la, lb)) <= 1e-6
    # DTensor's warning about two collectives where one mesh dimension would need one, filtered out
    # by the strategy (_tensor_parallel.quiet_sequential_redistribution)
    assert "sequential" not in two_d.output
    assert two_d.config["data_parallel_size"] == 2 and two_d.config["global_batch_size_resolved"] == 8


@pytest.mark.timeout(600)
def test_fsdp_tp_resumes_bit_for_bit_and_loads_at_other_mesh_shapes(two_d, tmp_path):
    """Resumed at step 4 of 8: the same weights as the uninterrupted run, bit for bit; its step-8
    checkpoint loaded by FSDP on 4 ranks (4 x 1) and by one process: the same weights.
    The notebook's runs of these jobs are read when there are (section 7's folders)."""
    final = torch.load(two_d.out_dir / checkpoint.FINAL, weights_only=True)["model"]
    jobs = {"13_resumed": ({"strategy": "fsdp_tp", "tp": 2}, 4, "step_0000004"),
            "13_load/fsdp_4_x_1": ({"strategy": "fsdp"}, 4, None),
            "13_load/one_process": ({"strategy": "single"}, 1, None)}
    for rel, (opts, nproc, only) in jobs.items():
        job = notebook_runs.reuse(f"runs/{rel}", "ddp_course.train", nproc, resume=True, **{**TRAIN, **opts})
        if job is None:
            folder = tmp_path / rel.replace("/", "_")
            if only:  # one checkpoint, named latest: the run resumes from it
                shutil.copytree(two_d.out_dir / "checkpoints" / only, folder / "checkpoints" / only)
                (folder / "checkpoints" / "latest").write_text(only)
            else:
                shutil.copytree(two_d.out_dir / "checkpoints", folder / "checkpoints")
            job = run("ddp_course.train", nproc=nproc, out_dir=folder, timeout=300, progress=False, echo="none",
                      resume=True, **{**TRAIN, **opts})
        weights = torch.load(job.out_dir / checkpoint.FINAL, weights_only=True)["model"]
        assert all(torch.equal(final[k], weights[k]) for k in final), rel


# --- what the plan needs from PyTorch (lesson 13, section 9) -------------------------------------------

def test_pytorch_still_unties_a_tied_weight_and_gloo_still_reduce_scatters_by_an_all_reduce_and_more():
    """Each assertion is a fact of PyTorch as it is that the lesson relies on or reports. The day one
    fails: drop the re-tie in ``_tp_plan.tensor_parallel`` (the tie survives parallelize_module),
    or reword lesson 13's section 9 on gloo (it has a reduce-scatter of its own)."""
    job = notebook_runs.reuse("runs/13_limits", "ddp_course.course.l13_two_dimensions.limits", 1)  # section 9's
    found = limits.parse(job.output if job else python_module("ddp_course.course.l13_two_dimensions.limits",
                                                               timeout=120).stdout)
    assert found["tie_survives"] is False
    assert "gloo:all_reduce" in found["reduce_scatter_ops"]
    # the day this flips, the root reshards after a forward: the order kept in
    # two_d_harness.train_side_by_side (optimizer first) stays right, the section's warning goes
    assert found["late_optimizer_moves_root"] is False


# --- a third dimension: pipeline stages over the 2-D plan (section 11) ----------------------------

THREE = "ddp_course.course.l13_two_dimensions.three_d_lab"


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    job = notebook_runs.reuse("runs/13_three_d", THREE, 8)
    if job is None:
        job = run(THREE, nproc=8, out_dir=tmp_path_factory.mktemp("three_d_lab"), timeout=300, progress=False,
                  echo="none")
    return json.loads((job.out_dir / "three_d_lab.json").read_text())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("variant", ["by_hand", "strategy"])
def test_pipeline_over_fsdp_over_tensor_parallel_trains_like_one_process(three, variant):
    """8 ranks as 2 x 2 x 2, by hand and as --strategy=pipeline: every rank's stage (its gradients at the
    first step, its weights after the last) and the last stage's losses against one process, and the
    stages together cover every parameter of the model (the tied matrix on both end stages)."""
    tol, v = three["tolerances"], three["variants"][variant]
    assert (three["pp"], three["dp"], three["tp"]) == (2, 2, 2) and v["matches"] and v["covers_every_parameter"]
    assert v["losses"] == pytest.approx(three["reference_losses"], rel=tol["loss_rtol"])
    for r in v["per_rank"]:
        assert r["grad_rel_err"] <= tol["grad_rtol"] and r["update_rel_diff"] <= tol["update_rtol"], r["rank"]
        c = r["coords"]  # rank (s * dp + d) * tp + t; the embeddings first and the head last
        assert r["rank"] == (c["pp"] * three["dp"] + c["dp"]) * three["tp"] + c["tp"]
        assert (r["first"], r["last"]) == (c["pp"] == 0, c["pp"] == three["pp"] - 1)
        # a later stage receives its tensor-parallel rank's slice of the sequence
        assert r["received"] == (None if r["first"] else [2, three["options"]["block_size"] // three["tp"], 64])
    assert sorted({tuple(r["blocks"]) for r in v["per_rank"]}) == [(0, 2), (2, 4)]


def test_the_parity_check_notices_a_stage_that_leaves_a_parameter_out():
    from ddp_course.course.l13_two_dimensions.three_d_lab import summary

    def rank(params, first=False, last=False):
        return {"params": params, "first": first, "last": last, "ok": True, "seconds": [0.1], "losses": [1.0],
                "loss_rel_diff": 0.0, "grad_rel_err": 0.0, "update_rel_diff": 0.0}

    names = ["blocks.0.w", "blocks.1.w", "tok_emb.weight"]
    whole = [rank(["blocks.0.w", "tok_emb.weight"], first=True), rank(["blocks.1.w", "tok_emb.weight"], last=True)]
    assert summary(whole, names)["matches"]
    missing = [rank(["tok_emb.weight"], first=True), rank(["blocks.1.w", "tok_emb.weight"], last=True)]
    untied = [rank(["blocks.0.w", "tok_emb.weight"], first=True), rank(["blocks.1.w"], last=True)]
    assert not summary(missing, names)["matches"] and not summary(untied, names)["matches"]


@pytest.mark.timeout(400)
def test_fsdp_inside_the_pipeline_reduce_scatters_per_micro_batch_by_hand_and_once_in_the_strategy(three):
    """By hand FSDP keeps its gradient sync on: each micro-batch's backward reduce-scatters every unit of
    the stage (its blocks and the stage); the strategy syncs in the last backward only, and the all-reduces
    over tp of the sequence-parallel norms' gradients fall by the same factor m."""
    m = three["options"]["micro_batches"]
    hand, strategy = (three["variants"][v]["per_rank"] for v in ("by_hand", "strategy"))
    for a, b in zip(hand, strategy):
        units = a["blocks"][1] - a["blocks"][0] + 1
        assert a["collectives"]["dp:reduce_scatter"] == m * units and b["collectives"]["dp:reduce_scatter"] == units
        assert a["collectives"]["tp:all_reduce"] == m * b["collectives"]["tp:all_reduce"]
        for counts in (a["collectives"], b["collectives"]):
            assert not any(k.endswith(":unseen") for k in counts), counts
        assert a["collectives"]["dp:all_gather"] == b["collectives"]["dp:all_gather"]  # parameters: the same


def test_the_three_d_layout_refuses_what_cannot_be_split():
    from ddp_course.cli import FlagError
    from ddp_course.course.l13_two_dimensions import three_d_lab

    opts = dict(three_d_lab.DEFAULTS)
    assert three_d_lab.layout(8, opts) == (2, 2, 2)
    assert three_d_lab.layout(4, {**opts, "tp": 1}) == (2, 2, 1)
    assert three_d_lab.layout(4, opts) == (2, 1, 2)
    for world, change, said in ((6, {}, "must divide the 6 ranks"), (8, {"pp": 1}, "at least 2"),
                                (8, {"n_layer": 1}, "cannot give each of 2 stages"),
                                (8, {"n_head": 3}, "--n_head=3 must be divisible by --tp=2"),
                                (8, {"batch_size": 12}, "divisible by dp x micro_batches")):
        with pytest.raises(FlagError, match=said):
            three_d_lab.layout(world, {**opts, **change})


def test_a_stage_names_its_parameters_as_the_whole_model_does():
    from ddp_course.course.l13_two_dimensions.three_d_lab import global_name

    assert global_name("blocks.0.attn.qkv.weight", 2) == "blocks.2.attn.qkv.weight"
    assert global_name("blocks.1.mlp.fc.bias", 0) == "blocks.1.mlp.fc.bias"
    assert global_name("head.weight", 2) == "tok_emb.weight"  # the tied matrix's copy on the last stage
    assert global_name("ln_f.weight", 2) == "ln_f.weight" and global_name("pos_emb.weight", 0) == "pos_emb.weight"


def test_the_stage_plan_cuts_the_sequence_on_the_first_stage_and_gathers_it_on_the_last():
    from ddp_course.parallel import _tp_plan as tp_plan

    whole = tp_plan.root_plan(sequence_parallel=True)
    assert set(tp_plan.stage_plan(first=True, last=False)) == {"blocks.0"}
    assert set(tp_plan.stage_plan(first=False, last=False)) == set()
    assert set(tp_plan.stage_plan(first=False, last=True)) == {"ln_f", "head"}
    assert set(tp_plan.stage_plan(first=True, last=True)) == set(whole)  # one stage: the whole model's plan


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (one per rank of the 2 x 2 mesh)")
def test_fsdp_tp_on_four_gpus(tmp_path):
    ddp = run("ddp_course.train", nproc=2, strategy="ddp", out_dir=tmp_path / "ddp", timeout=300, progress=False,
              echo="none", **{**TRAIN, "device": "cuda", "ckpt_interval": 0})
    two_d = run("ddp_course.train", nproc=4, strategy="fsdp_tp", tp=2, out_dir=tmp_path / "tp", timeout=300,
                progress=False, echo="none", **{**TRAIN, "device": "cuda", "ckpt_interval": 0})
    assert two_d.series("loss")[0] == ddp.series("loss")[0]
    assert max(abs(a - b) / b for a, b in zip(two_d.series("loss")[1], ddp.series("loss")[1])) <= 1e-5
