"""Lesson 11's tensor-parallel lab: MiniGPT's attention and MLP split with ``parallelize_module`` train
exactly as one process does; the fused qkv needs its rows reordered; what each rank holds and sends.

One launch of ``tp_lab`` (the notebook's job, option for option: under ``make test`` the tests read
the notebook's run) feeds the tests marked ``lab``; the others run in this process.
"""

from __future__ import annotations

import copy
import json

import notebook_runs
import pytest
import torch
import torch.nn as nn

from ddp_course.course.l11_beyond_data_parallel import tp_lab
from ddp_course.launch import run
from ddp_course.model import CausalSelfAttention, GPTConfig

LAB = "ddp_course.course.l11_beyond_data_parallel.tp_lab"
FLAGS: dict = {}  # the notebook runs the lab's defaults
# float32: the split model adds the same terms in another grouping (per rank, then the all-reduce),
# ~1e-7 of a loss; a wrong split changes the loss or the logits by 1e-3 or more (the naive qkv
# shard: a quarter of the logits' size). 1e-5 lies between.
RTOL = 1e-5


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    job = notebook_runs.reuse("runs/11/tp", LAB, 2, **FLAGS)
    if job is None:
        job = run(LAB, nproc=2, out_dir=tmp_path_factory.mktemp("tp"), timeout=120, progress=False, echo="none", **FLAGS)
    return json.loads((job.out_dir / "tp_lab.json").read_text(encoding="utf-8"))


@pytest.mark.timeout(150)
def test_tensor_parallel_trains_as_one_process(lab):
    assert lab["backend"] in ("gloo", "nccl") and lab["world_size"] == 2
    assert lab["first_logits_rel_diff"]["tp"] <= RTOL
    assert lab["max_rel_diff"] <= RTOL, (lab["losses_tp"], lab["losses_single"])
    assert all(r["losses"] == lab["losses_tp"] for r in lab["ranks"])  # the ranks hold one model, not two
    assert lab["losses_tp"][-1] < lab["losses_tp"][0]  # it trained


@pytest.mark.timeout(150)
def test_sharding_the_fused_qkv_in_its_own_order_mixes_q_and_k(lab):
    naive = lab["naive_qkv"]
    assert naive["layout"][0] == ["q heads 0-3", "k heads 0-1"]  # rank 0: all of q, half of k
    assert lab["first_logits_rel_diff"]["naive"] > 1e-2  # silently a different model
    assert lab["rearranged_layout"] == [["q heads 0-1", "k heads 0-1", "v heads 0-1"],
                                        ["q heads 2-3", "k heads 2-3", "v heads 2-3"]]


@pytest.mark.timeout(150)
def test_each_rank_holds_half_of_the_split_layers_and_all_the_rest(lab):
    full = lab["full_param_bytes"]
    for r in lab["ranks"]:
        b = r["param_bytes"]
        assert b["total"] == b["sharded"] + b["replicated"] < full
        assert 2 * b["sharded"] + b["replicated"] == full  # the linear layers of the blocks split evenly


@pytest.mark.timeout(150)
def test_two_all_reduces_per_block_each_way(lab):
    n_layer = lab["options"]["n_layer"]
    assert lab["collectives"] == {"forward": {"all_reduce": 2 * n_layer}, "backward": {"all_reduce": 2 * n_layer}}


# --- in this process ------------------------------------------------------------------------------

def test_head_parallel_attention_on_reordered_shards_is_the_attention():
    # Two "ranks" in one process: each takes its block of the reordered qkv rows and of proj's
    # columns (the bias on one of them only); the sum of their outputs is the attention's.
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPTConfig(vocab_size=65, n_head=4, n_embd=32))
    x = torch.randn(2, 8, 32)
    reordered = copy.deepcopy(attn)
    tp_lab.rearrange_qkv(reordered, 2)
    total = torch.zeros_like(x)
    for r in range(2):
        local = tp_lab.HeadParallelAttention(reordered, 2)
        rows, cols = tp_lab.hidden_block(96, r, 2), tp_lab.hidden_block(32, r, 2)
        local.qkv, local.proj = nn.Linear(32, 48), nn.Linear(16, 32)
        with torch.no_grad():
            local.qkv.weight.copy_(reordered.qkv.weight[rows])
            local.qkv.bias.copy_(reordered.qkv.bias[rows])
            local.proj.weight.copy_(reordered.proj.weight[:, cols])
            local.proj.bias.copy_(reordered.proj.bias if r == 0 else torch.zeros(32))
        total += local(x)
    assert torch.allclose(total, attn(x), atol=1e-6)


def test_bad_options_are_refused_before_any_process_group(capsys):
    assert tp_lab.main(["--n_head=3"]) == 2  # 64 channels do not split into 3 heads
    assert tp_lab.main(["--heads=2"]) == 2
    assert "--n_head" in capsys.readouterr().err
