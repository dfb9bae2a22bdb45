"""Each strategy's own decisions, in one process and without a process group: the parts of
``ddp_course/parallel/<name>.py`` that the training runs of ``tests/core/test_every_strategy.py`` (every
strategy trained, saved and resumed on 2 ranks) cannot show -- its refusals and the choices it makes
from the options. What each strategy does inside a real job is its lesson's (tests/lessons)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ddp_course import config, parallel
from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DeviceError, DistInfo
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.parallel import ddp, dp, fsdp, fsdp1, fsdp_tp

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GLOO = {"backend": "gloo", "device": torch.device("cpu")}


# --- ddp ------------------------------------------------------------------------------------------------

def test_ddp_comm_hook_choice_and_refusals():
    assert ddp.comm_hook("none", "gloo") is None
    assert ddp.comm_hook("bf16", "gloo") is ddp.bf16_hook  # the built-in refuses gloo
    assert ddp.comm_hook("bf16", "nccl").__name__ == "bf16_compress_hook"
    with pytest.raises(ddp.CommHookError, match="choose one of"):
        ddp.comm_hook("fp8", "gloo")


def test_ddp_comm_hook_choices_are_its_hooks():
    """--comm_hook's choices, read from ddp.py without torch, are none and the hooks ddp.HOOKS holds."""
    assert config.own_options("ddp")["comm_hook"][2] == ("none", *ddp.HOOKS)


def test_ddp_kwargs_buffers_flag():
    cfg = SimpleNamespace(bucket_cap_mb=1.0, find_unused_parameters=True, static_graph=False, broadcast_buffers=False)
    kw = ddp.ddp_kwargs(cfg)
    assert kw["bucket_cap_mb"] == 1.0 and kw["find_unused_parameters"] is True
    assert kw.get("forward_sync_buffers", kw.get("broadcast_buffers")) is False
    assert "broadcast_buffers" not in ddp.ddp_kwargs(SimpleNamespace(**{**vars(cfg), "broadcast_buffers": True}))


# --- dp: one process, every GPU ------------------------------------------------------------------------------

@pytest.mark.skipif(N_GPUS >= 2, reason="checks the refusal on a machine with fewer than 2 CUDA GPUs")
def test_dp_refuses_without_two_gpus():
    with pytest.raises(DeviceError) as err:
        dp.wrap(nn.Linear(2, 2), DistInfo(), TrainConfig(strategy="dp"))
    msg = str(err.value)
    assert "nn.DataParallel does nothing without CUDA devices" in msg
    assert "lessons/03_data_parallel.ipynb" in msg and "--strategy=ddp" in msg


@pytest.mark.parametrize("name", parallel.one_process())
def test_a_one_process_strategy_refuses_several_ranks_in_one_place(name, monkeypatch):
    """single's and dp's refusal of a job of several ranks is Strategy.refusal's, worded once."""
    monkeypatch.setattr(dp, "cuda_gpus", lambda: 2)  # dp would otherwise stop first, at the missing GPUs
    with pytest.raises(ConfigError, match=rf"--strategy={name} runs in one process, but this job has 2 ranks: "
                                          r"every rank would train a model of its own.*nproc=1\)\), or use --strategy=ddp"):
        parallel.Strategy(name).wrap(nn.Linear(2, 2), DistInfo(world_size=2, **GLOO), TrainConfig(strategy=name))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the wrapper's own code on the no-CUDA path")
def test_dp_loss_is_the_models_loss(one_thread):
    # Without CUDA, DataParallelLM runs the module directly, so this checks the wrapper's own code:
    # the loss computed from the (gathered) logits must be exactly MiniGPT's loss.
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=65, block_size=32, n_layer=1, n_head=2, n_embd=32))
    x = torch.randint(0, 65, (4, 32))
    y = torch.randint(0, 65, (4, 32))
    wrapped = dp.DataParallelLM(model, device_ids=None)
    logits, loss = wrapped(x, y)
    ref_logits, ref_loss = model(x, y)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)  # same ops, same order
    assert wrapped(x).shape == (4, 32, 65)


# --- fsdp and fsdp1 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("shard_size", "reshard", "strategy"), [
    (0, True, "FULL_SHARD"), (0, False, "SHARD_GRAD_OP"), (2, True, "HYBRID_SHARD"), (2, False, "_HYBRID_SHARD_ZERO2")])
def test_fsdp1_sharding_strategy_follows_the_table(shard_size, reshard, strategy):
    cfg = TrainConfig(strategy="fsdp1", fsdp_shard_size=shard_size, reshard_after_forward=reshard)
    assert fsdp1.sharding_strategy(DistInfo(world_size=4, **GLOO), cfg).name == strategy


def test_fsdp_shard_sizes_that_cannot_work_are_refused():
    four = DistInfo(world_size=4, **GLOO)
    assert fsdp.shard_layout(four, TrainConfig(strategy="fsdp", fsdp_shard_size=2)) == (2, 2)
    with pytest.raises(ConfigError, match=r"--fsdp_shard_size=3 does not divide the 4 rank\(s\).*one of \[1, 2, 4\]"):
        fsdp.shard_layout(four, TrainConfig(strategy="fsdp", fsdp_shard_size=3))
    with pytest.raises(ConfigError, match="silently stops synchronising"):  # FSDP1's hybrid bug, refused
        fsdp1.sharding_strategy(four, TrainConfig(strategy="fsdp1", fsdp_shard_size=1))


def test_cpu_offload_on_a_cpu_job_is_refused_in_one_place():
    """FSDP2's and FSDP1's refusal of --fsdp_cpu_offload without GPUs is fsdp.cpu_offload's, worded once."""
    info, model = DistInfo(world_size=2, **GLOO), nn.Linear(2, 2)
    cfg = TrainConfig(strategy="fsdp1", fsdp_cpu_offload=True)
    refused = r"--fsdp_cpu_offload moves the sharded parameters.*drop --fsdp_cpu_offload, or run on GPUs"
    for call in (lambda: fsdp.offload_policy(info, cfg), lambda: fsdp1.wrap(model, info, cfg, state={})):
        with pytest.raises(ConfigError, match=refused):
            call()


def test_the_plain_copy_of_a_sharded_model_holds_its_state_and_leaves_the_rng_alone(one_thread):
    """fsdp's and fsdp_tp's ``gathered`` build their copy here (the full state dict each strategy gives)."""
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32))
    before = torch.get_rng_state()
    copy = fsdp.plain_copy(model, model.state_dict())
    assert torch.equal(torch.get_rng_state(), before)
    assert copy is not model and all(torch.equal(v, model.state_dict()[k]) for k, v in copy.state_dict().items())


# --- fsdp_tp -----------------------------------------------------------------------------------------------

def test_fsdp_tp_layout_and_data_parallel_ranks():
    cfg = TrainConfig(strategy="fsdp_tp", tp=2)
    assert fsdp_tp.layout(4, cfg) == (2, 2)
    assert [fsdp_tp.data_parallel(r, 4, cfg) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(ConfigError, match="does not divide the 4 rank"):
        fsdp_tp.layout(4, TrainConfig(strategy="fsdp_tp", tp=3))
    with pytest.raises(ConfigError, match="--n_head=3 does not divide by 2"):
        fsdp_tp.layout(4, TrainConfig(strategy="fsdp_tp", tp=2, n_head=3, n_embd=96))
    with pytest.raises(ConfigError, match=r"--tp must be at least 1 \(got 0\): fsdp_tp: tensor-parallel ranks"):
        TrainConfig(tp=0)  # fsdp_tp.py's check of its own option
