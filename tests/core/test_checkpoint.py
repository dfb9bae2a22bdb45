"""Checkpoints: a crashed DDP job restarted by torchrun ends bit-identical to one that never crashed;
checkpoints saved by 2 ranks load into 1 process; corrupt or mismatched checkpoints give clear errors;
the position in the data carries over to another world size. Lesson 08's labs (a reload into 4 ranks,
a process killed in the middle of a save) are tested in ``tests/lessons/test_checkpointing.py``, its
exercise in ``tests/exercises/test_exercise_08.py``.

The crashed and uninterrupted jobs are lesson 08's (section 4), with its settings: in ``make test``
the notebook's runs of the uninterrupted job, of the sharded crash-and-restart and of the 4-rank
reload are read (``notebook_runs``) instead of being launched again. Every other strategy's save and
resume, in both formats, is checked in ``tests/core/test_every_strategy.py``."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from checkpoint_runs import BASE, CKPT, FAIL_AT, crash_and_reference

from ddp_course import checkpoint
from ddp_course.checkpoint import CheckpointError
from ddp_course.config import TrainConfig
from ddp_course.data import DataPosition, TokenWindows, train_batches
from ddp_course.dist import DistInfo
from ddp_course.metrics import MetricsWriter, read_jsonl
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.paths import show
from ddp_course.train import build_optimizer

SHAPE = {"vocab_size": 65, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}
ONE = DistInfo()  # one process, no process group


def _final(out_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / checkpoint.FINAL, weights_only=True)["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Lesson 08's uninterrupted 2-rank DDP run and the same run crashed on rank 1 and restarted by
    torchrun, with sharded checkpoints (``checkpoint_runs``)."""
    return crash_and_reference(tmp_path_factory.mktemp("ckpt"))


# --- exact resume after a crash, torchrun restarting the job ---------------------------------------------

# The crash below must end bit for bit where the uninterrupted job ends. DDP's full checkpoints are
# written by the reference job and read back by 1 process further down.
@pytest.mark.timeout(400)
def test_restarted_job_equals_the_uninterrupted_one(runs):
    ref, r, fmt = runs["reference"], runs["sharded"], "sharded"
    # it really crashed once and resumed from the step-40 checkpoint on torchrun's second attempt
    assert f"injected failure on rank 1 at step {FAIL_AT}" in r.output
    assert f"resumed from {show(checkpoint.checkpoint_path(r.out_dir, CKPT, fmt))} at step {CKPT}" in r.output
    assert list(r.out_dir.glob("torchrun_logs/*/*/attempt_1"))
    assert r.summary["steps_run"] == BASE["max_steps"] - CKPT
    # CPU runs are deterministic, and the checkpoint holds everything the remaining steps depend on
    # (weights, AdamW moments and step counts, every rank's RNG for dropout, the data position), so the
    # redone steps must equal the uninterrupted run's to the last bit: no tolerance.
    rows = [(x["step"], x["loss"], x["lr"], x["grad_norm"]) for x in r.train_rows]
    assert rows == [(x["step"], x["loss"], x["lr"], x["grad_norm"]) for x in ref.train_rows]  # none twice
    assert r.summary["final_val_loss"] == ref.summary["final_val_loss"]
    final, ref_final = _final(r.out_dir), _final(ref.out_dir)
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)


def test_sharded_checkpoint_has_a_part_from_every_rank(runs):
    d = checkpoint.checkpoint_path(runs["sharded"].out_dir, CKPT, "sharded")
    names = {p.name for p in d.iterdir()}
    assert {".metadata", checkpoint.META, "__0_0.distcp", "__1_0.distcp"} <= names
    assert all((d / f"__{r}_0.distcp").stat().st_size > 0 for r in (0, 1))  # both ranks wrote tensors
    layout = checkpoint.sharded_layout(d)  # DCP wrote each entry of the replicated state once, on one rank
    assert set(layout) == {"__0_0.distcp", "__1_0.distcp"} and not set(layout["__0_0.distcp"]) & set(layout["__1_0.distcp"])
    assert {"model.tok_emb.weight", "optimizer.state.tok_emb.weight.exp_avg"} <= {e for v in layout.values() for e in v}
    meta = checkpoint.load(d)
    assert meta["world_size"] == 2 and meta["step"] == CKPT and len(meta["rng"]) == 2
    assert meta["position"] == {"samples": CKPT * 2 * BASE["micro_batch_size"], "micro_batches": CKPT,
                                "epoch": 0, "batch_in_epoch": CKPT}
    assert checkpoint.latest(runs["sharded"].out_dir).name == f"step_{BASE['max_steps']:07d}"
    assert not list(d.parent.glob("*.tmp"))


# --- another world size: saved by 2 ranks, loaded by 1 ---------------------------------------------

def _fresh(shape: dict, seed: int = 1):
    torch.manual_seed(seed)
    model = MiniGPT(GPTConfig(**shape))
    return model, build_optimizer(model, TrainConfig(), torch.device("cpu"))


def test_every_checkpoint_function_that_touches_states_requires_the_plan(tmp_path):
    """How a model's and optimizer's states are read is its strategy's (ZeRO-1, FSDP x TP and the pipeline
    bring their own; FSDP x TP's need what its wrap kept in the plan), and checkpoint keeps no table of
    models to guess it from: the plan is required (``plan=``, or the ``TrainState`` that save and resume
    take), and a call without it fails before anything is read or written."""
    from ddp_course import parallel

    model, opt = _fresh(SHAPE)
    for call, missing in ((lambda: checkpoint.fingerprint(model, opt), "keyword-only argument: 'plan'"),
                          (lambda: checkpoint.save_final(tmp_path, 1, model, ONE), "keyword-only argument: 'plan'"),
                          (lambda: checkpoint.TrainState(model, opt), "positional argument: 'plan'")):
        with pytest.raises(TypeError, match=f"missing 1 required {missing}"):
            call()
    assert not any(tmp_path.iterdir())  # refused before a byte was written
    assert checkpoint.fingerprint(model, opt, plan=parallel.Strategy("single")) == checkpoint.fingerprint(
        model, opt, plan=checkpoint.DCP)  # a plain model's plan keeps PyTorch's state dicts


def _load_one_process(path: Path):
    shape = checkpoint.load(path)["shape"]
    model, opt = _fresh(shape)
    meta = checkpoint.resume(path, checkpoint.TrainState(model, opt, checkpoint.DCP, shape), ONE)
    return model, opt, meta


@pytest.mark.timeout(400)
def test_two_rank_checkpoints_load_into_one_process(runs):
    full = checkpoint.checkpoint_path(runs["reference"].out_dir, CKPT, "full")
    sharded = checkpoint.checkpoint_path(runs["sharded"].out_dir, CKPT, "sharded")
    saved = torch.load(full, weights_only=True)
    model, opt, meta = _load_one_process(full)
    assert meta["step"] == CKPT and meta["world_size"] == 2
    # the truth is the file itself: every tensor, by name, bit for bit
    for name, t in model.state_dict().items():
        assert torch.equal(t, saved["model"][name]), name
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of[id(p)] for group in opt.param_groups for p in group["params"]]  # the optimizer's order
    for i, st in opt.state_dict()["state"].items():
        for key, t in st.items():
            assert torch.equal(t, saved["optimizer"]["state"][names[i]][key]), (names[i], key)
    assert torch.equal(torch.get_rng_state(), saved["rng"][0]["torch"])  # rank 0's generator
    # the sharded run reached step 40 along the same path: its checkpoint holds the same state
    model_s, opt_s, _ = _load_one_process(sharded)
    assert (checkpoint.fingerprint(model_s, opt_s, plan=checkpoint.DCP)
            == checkpoint.fingerprint(model, opt, plan=checkpoint.DCP))


@pytest.mark.parametrize(("saved_world", "saved_micro", "world", "micro"), [(2, 4, 4, 2), (2, 4, 1, 8), (4, 2, 2, 4)])
def test_data_position_carries_over_to_another_world_size(saved_world, saved_micro, world, micro):
    # With the same global batch, the resumed job's next global batch is exactly the samples the saving
    # job would have used next: every world size walks the same shuffled order of the epoch.
    ds = TokenWindows(torch.arange(2000), block_size=8)
    steps = 7
    saved, resumed = DataPosition(saved_micro, saved_world), DataPosition(micro, world)
    saved.advance(steps)
    resumed.load_state_dict(saved.state_dict())
    start = resumed.micro_batches

    def next_global_batch(w: int, m: int, skip: int) -> set[int]:
        return {int(x[i, 0]) for r in range(w) for x, _ in [next(train_batches(ds, m, r, w, seed=3, start_batch=skip))]
                for i in range(m)}

    assert next_global_batch(world, micro, start) == next_global_batch(saved_world, saved_micro, steps)


# --- the checkpoint files: pointer, keep_last, round trip, errors ------------------------------------------

def _trained(seed: int = 0, shape: dict = SHAPE):
    model, opt = _fresh(shape, seed)
    x = torch.randint(0, shape["vocab_size"], (2, shape["block_size"]), generator=torch.Generator().manual_seed(seed))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_round_trip_restores_everything(tmp_path, fmt, one_thread):
    model, opt = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler._scale, scaler._growth_tracker = torch.tensor(256.0), torch.tensor(3, dtype=torch.int32)
    random.seed(11)
    torch.manual_seed(12)
    pos = DataPosition(micro_batch_size=4, world_size=1, batches_per_epoch=3)
    pos.advance(5 * 2)  # 5 steps of 2 micro-batches
    state = checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, step=5, parts={"scaler": scaler, "position": pos})
    checkpoint.save(tmp_path, state, ONE, fmt=fmt)
    want = checkpoint.fingerprint(model, opt, plan=checkpoint.DCP), random.random(), torch.rand(3)

    model2, opt2 = _fresh(SHAPE, seed=99)
    scaler2, pos2 = torch.amp.GradScaler("cpu"), DataPosition(micro_batch_size=4, world_size=1)
    assert checkpoint.fingerprint(model2, opt2, plan=checkpoint.DCP) != want[0]
    state2 = checkpoint.TrainState(model2, opt2, checkpoint.DCP, SHAPE, parts={"scaler": scaler2, "position": pos2})
    meta = checkpoint.resume(checkpoint.latest(tmp_path), state2, ONE)
    assert (checkpoint.fingerprint(model2, opt2, plan=checkpoint.DCP), random.random()) == want[:2]
    assert torch.equal(torch.rand(3), want[2])
    assert scaler2.state_dict() == scaler.state_dict() and scaler2.get_scale() == 256.0
    assert meta["step"] == state2.step == 5 and meta["position"] == {"samples": 40, "micro_batches": 10, "epoch": 3,
                                                                     "batch_in_epoch": 1}
    assert pos2.micro_batches == 10  # the part read itself back
    assert model2.head.weight is model2.tok_emb.weight  # loading keeps the tied weights tied


def test_a_part_cannot_take_a_name_the_checkpoint_keeps_and_save_needs_the_shape(tmp_path):
    model, opt = _fresh(SHAPE)
    with pytest.raises(ValueError, match=r"keeps \['rng'\] for itself"):
        checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, parts={"rng": DataPosition(4, 1)})
    with pytest.raises(ValueError, match="needs the model's shape"):
        checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP), ONE)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_pointer_keep_last_and_leftovers(tmp_path, fmt, one_thread):
    model, opt = _trained()
    assert checkpoint.latest(tmp_path) is None
    d = checkpoint.ckpt_dir(tmp_path)
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, step), ONE, fmt=fmt,
                        keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        checkpoint.checkpoint_path(tmp_path, s, fmt).name for s in (2, 3)]
    assert checkpoint.latest(tmp_path) == checkpoint.checkpoint_path(tmp_path, 3, fmt)
    (d / "step_0000009.pt.tmp").write_bytes(b"half a file")  # what a killed save leaves behind
    checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, 4), ONE, fmt=fmt, keep_last=2)
    assert not (d / "step_0000009.pt.tmp").exists()
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [checkpoint.POINTER] + [checkpoint.checkpoint_path(tmp_path, s, fmt).name for s in (3, 4)])
    (d / checkpoint.POINTER).write_text("step_0000007.pt\n")
    with pytest.raises(CheckpointError, match="names step_0000007.pt, which does not exist"):
        checkpoint.latest(tmp_path)


def _error(fn) -> str:
    with pytest.raises(CheckpointError) as exc:
        fn()
    msg = str(exc.value)
    assert "Traceback" not in msg and "\n" not in msg  # one paragraph, not a pickle traceback
    return msg


@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_other_model_shape_is_named(tmp_path, fmt, one_thread):
    model, opt = _trained()
    path = checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, 1), ONE, fmt=fmt)
    other = {**SHAPE, "n_embd": 64}
    model2, opt2 = _fresh(other)
    msg = _error(lambda: checkpoint.resume(path, checkpoint.TrainState(model2, opt2, checkpoint.DCP, other), ONE))
    assert str(path) in msg and "n_embd: checkpoint 32 vs this run 64" in msg


def test_truncated_or_foreign_full_file_is_refused(tmp_path, one_thread):
    model, opt = _trained()
    path = checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, 1), ONE)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    msg = _error(lambda: checkpoint.load(path))
    assert str(path) in msg and "truncated or corrupt" in msg
    import datetime

    foreign = tmp_path / "foreign.pt"
    torch.save({"step": 1, "when": datetime.datetime(2020, 1, 1)}, foreign)  # not a tensor or plain value
    msg = _error(lambda: checkpoint.load(foreign))
    assert str(foreign) in msg and "weights_only=True" in msg and "datetime" in msg


def test_damaged_sharded_checkpoint_is_named(tmp_path, one_thread):
    model, opt = _trained()
    path = checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, 1), ONE, fmt="sharded")
    part = path / "__0_0.distcp"
    data = part.read_bytes()

    def attempt() -> str:
        model2, opt2 = _fresh(SHAPE)
        return _error(lambda: checkpoint.resume(path, checkpoint.TrainState(model2, opt2, checkpoint.DCP, SHAPE), ONE))

    part.write_bytes(data[:1000])
    msg = attempt()
    assert str(path) in msg and "__0_0.distcp has 1000 bytes but the index expects at least" in msg
    part.unlink()
    assert "its part __0_0.distcp is missing" in attempt()
    part.write_bytes(data)
    index = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(index[: len(index) // 2])
    assert "index .metadata is truncated, corrupt or not DCP's" in attempt()
    # a pickle that would run code when loaded is refused, not executed
    (path / ".metadata").write_bytes(pickle.dumps(os.getcwd))
    assert "posix.getcwd is not part of a DCP index" in attempt()
    (path / ".metadata").write_bytes(index)
    (path / checkpoint.META).unlink()
    assert "meta.pt is missing" in attempt()


def test_metrics_rows_after_the_checkpoint_are_dropped(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s} for s in (5, 10, 15)] + [{"step": 10, "val_loss": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 1')
    writer = MetricsWriter(tmp_path, enabled=True, resume_at=10)
    assert writer.dropped == 2  # the row of step 15 and the torn last line
    writer.write({"step": 11, "loss": 0.5})
    writer.close()
    assert [{k: v for k, v in r.items() if k != "time"} for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        rows[0], rows[1], rows[3], {"step": 11, "loss": 0.5}]


# --- exercise 08 -------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", checkpoint.FORMATS)
def test_cuda_state_round_trip(tmp_path, fmt):
    # A model on the GPU: the GPU's generator is saved with the CPU's, and the checkpoint (written from CPU
    # copies) loads back onto the GPU.
    gpu = DistInfo(device=torch.device("cuda", 0))
    model, opt = _fresh(SHAPE)
    model.cuda()
    opt = build_optimizer(model, TrainConfig(), gpu.device)
    x = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"]), device=gpu.device)
    model(x, x)[1].backward()
    opt.step()
    torch.cuda.manual_seed(5)
    checkpoint.save(tmp_path, checkpoint.TrainState(model, opt, checkpoint.DCP, SHAPE, 1), gpu, fmt=fmt)
    want, draw = checkpoint.fingerprint(model, opt, plan=checkpoint.DCP), torch.rand(4, device=gpu.device)
    assert "cuda" in checkpoint.load(checkpoint.latest(tmp_path))["rng"][0]  # (a sharded folder: its meta.pt)
    model2, _ = _fresh(SHAPE, seed=3)
    model2.cuda()
    opt2 = build_optimizer(model2, TrainConfig(), gpu.device)
    checkpoint.resume(checkpoint.latest(tmp_path), checkpoint.TrainState(model2, opt2, checkpoint.DCP, SHAPE), gpu)
    assert next(model2.parameters()).is_cuda and checkpoint.fingerprint(model2, opt2, plan=checkpoint.DCP) == want
    assert torch.equal(torch.rand(4, device=gpu.device), draw)
