"""The real training entry point, end to end: torchrun with DDP on two CPU ranks, the one-process
baseline it must reproduce, refusals of bad input, and exact resumption from a checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from harness import TINY, python_module, torchrun

from ddp_course.config import TrainConfig, to_cli
from ddp_course.metrics import read_jsonl
from ddp_course.train import lr_at

SUMMARY_KEYS = ("final_loss", "final_val_loss", "total_tokens", "wall_time_s", "tokens_per_s", "peak_memory_bytes")


def run_train(args: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m ddp_course.train args`` as one process (no torchrun), with a timeout."""
    return python_module("ddp_course.train", args, timeout=timeout, check=check)


def load_run(out_dir: Path) -> tuple[list[dict], list[dict], dict, dict]:
    rows = read_jsonl(out_dir / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    config = json.loads((out_dir / "config.json").read_text())
    summary = json.loads((out_dir / "summary.json").read_text())
    return train, val, config, summary


# --- one DDP run on two ranks, shared by the smoke test and the equivalence test ------------------------

SMOKE = {**TINY, "max_steps": 40, "lr": 3e-3}  # TINY is what the `tiny` fixture returns


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    torchrun("ddp_course.train", 2, to_cli({**SMOKE, "strategy": "ddp", "out_dir": str(out)}), timeout=150)
    return out


@pytest.mark.timeout(200)
def test_torchrun_ddp_smoke(ddp_run):
    train, val, config, summary = load_run(ddp_run)
    cfg = TrainConfig(**{k: v for k, v in SMOKE.items()})

    assert config["world_size"] == 2
    assert config["backend"] == "gloo"
    assert config["strategy"] == "ddp"

    expected_steps = list(range(cfg.log_interval, cfg.max_steps + 1, cfg.log_interval))
    assert [r["step"] for r in train] == expected_steps
    for r in train:
        assert {"step", "loss", "lr", "tokens_per_s"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg))  # the lr used for that step
    # Loss falls: the first row (step 5, still in warm-up) sits near ln(65) = 4.17; by step 40 the
    # model has at least learned character frequencies (unigram entropy of the text ~3.3 nats; the
    # 2-rank run in development logged ~3.35). A logged loss is the mean over 8 x 32 = 256
    # characters, whose batch-to-batch noise is ~0.05, so a 0.3 drop cannot come from noise alone.
    assert train[-1]["loss"] < train[0]["loss"] - 0.3, [r["loss"] for r in train]

    assert val, "no val_loss rows"
    assert val[-1]["step"] == cfg.max_steps
    assert all(math.isfinite(r["val_loss"]) for r in val)

    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert summary["final_loss"] == train[-1]["loss"]
    assert summary["final_val_loss"] == val[-1]["val_loss"]
    assert summary["total_tokens"] == cfg.max_steps * cfg.micro_batch_size * 2 * cfg.block_size
    assert summary["wall_time_s"] > 0 and summary["tokens_per_s"] > 0 and summary["peak_memory_bytes"] > 0


@pytest.mark.timeout(200)
def test_single_process_with_double_batch_reproduces_the_ddp_run(ddp_run, tmp_path):
    out = tmp_path / "single"
    single = {**SMOKE, "micro_batch_size": 2 * SMOKE["micro_batch_size"], "strategy": "single",
              "threads": 1, "out_dir": str(out)}
    run_train(to_cli(single))
    d_train, d_val, _, d_sum = load_run(ddp_run)
    s_train, s_val, s_config, s_sum = load_run(out)
    assert s_config["world_size"] == 1 and s_config["backend"] is None

    # Same windows per step (tests/core/test_data.py), same initial weights, gradients averaged over the
    # ranks: the runs differ only in fp32 summation order (~1e-7 per step; observed ~3e-7 in the
    # loss after 40 steps). 1e-4 leaves a wide margin, and any real difference -- other data,
    # unsynchronised replicas, a wrong average -- shifts a logged loss by 1e-2 or more.
    assert [r["step"] for r in s_train] == [r["step"] for r in d_train]
    assert [r["lr"] for r in s_train] == [r["lr"] for r in d_train]
    assert [r["loss"] for r in s_train] == pytest.approx([r["loss"] for r in d_train], abs=1e-4)
    assert [r["grad_norm"] for r in s_train] == pytest.approx([r["grad_norm"] for r in d_train], rel=1e-3)
    assert [r["step"] for r in s_val] == [r["step"] for r in d_val]
    assert [r["val_loss"] for r in s_val] == pytest.approx([r["val_loss"] for r in d_val], abs=1e-4)
    assert s_sum["total_tokens"] == d_sum["total_tokens"]


# --- bad input is refused with exit code 2 and a message that says what to do -----------------------------

@pytest.mark.timeout(60)
def test_misspelled_flag_exits_2_with_a_suggestion(tmp_path):
    proc = run_train(["--max_step=3", f"--out_dir={tmp_path}"], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Did you mean --max_steps" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU, so --device=cuda is valid")
def test_device_cuda_without_a_gpu_exits_2_pointing_at_auto(tiny, tmp_path):
    proc = run_train([*to_cli({**tiny, "max_steps": 1, "out_dir": str(tmp_path)}), "--device=cuda"],
                     timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--device=auto" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- resuming from a checkpoint continues exactly -----------------------------------------------------------

@pytest.mark.timeout(200)
def test_resume_after_a_failure_matches_the_uninterrupted_run(tiny, tmp_path):
    base = {**tiny, "max_steps": 20, "lr": 3e-3, "ckpt_interval": 10, "threads": 1}
    a, b = tmp_path / "a", tmp_path / "b"
    # A, uninterrupted, and B: the same run, killed by the injected failure after step index 10 (the
    # 11th update), i.e. after the step-10 checkpoint was written; max_steps stays 20 so the LR
    # schedule is the same. A and B's first attempt are independent: they run side by side.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(run_train, to_cli({**base, "out_dir": str(a)}))
        proc = run_train(to_cli({**base, "out_dir": str(b), "fail_at_step": 10}), check=False)
        first.result()
    assert proc.returncode != 0
    assert "injected failure" in proc.stdout + proc.stderr
    assert not (b / "summary.json").exists()
    ckpts = b / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000010.pt"

    run_train(to_cli({**base, "out_dir": str(b), "resume": True}))
    a_train, a_val, _, a_sum = load_run(a)
    b_train, b_val, _, b_sum = load_run(b)
    # CPU runs are deterministic run to run (same threads, same kernels), and the checkpoint holds
    # everything the remaining steps depend on (weights, AdamW moments and step count, data
    # position from the step, RNG states), so the resumed steps must match bit for bit.
    assert b_sum["steps_run"] == 10
    assert b_sum["final_loss"] == a_sum["final_loss"]
    assert b_sum["final_val_loss"] == a_sum["final_val_loss"]
    assert [r["step"] for r in b_train] == [r["step"] for r in a_train]  # no duplicated rows
    after = [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in a_train if r["step"] > 10]
    assert after and [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in b_train if r["step"] > 10] == after
    assert [r["val_loss"] for r in b_val] == [r["val_loss"] for r in a_val]


# --- on a GPU (skipped on CPU-only machines) -----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_single_rank_smoke(tiny, tmp_path):
    run_train(to_cli({**tiny, "max_steps": 10, "device": "cuda", "out_dir": str(tmp_path)}))
    train, val, config, summary = load_run(tmp_path)
    assert config["device"].startswith("cuda")
    assert summary["memory_kind"] == "cuda_allocated" and summary["peak_memory_bytes"] > 0
    assert all(math.isfinite(r["loss"]) for r in train) and val


@pytest.mark.multigpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_two_rank_ddp_smoke(tiny, tmp_path):
    torchrun("ddp_course.train", 2,
             to_cli({**tiny, "max_steps": 10, "strategy": "ddp", "device": "cuda", "out_dir": str(tmp_path)}))
    _, _, config, summary = load_run(tmp_path)
    assert config["backend"] == "nccl" and config["world_size"] == 2
    assert math.isfinite(summary["final_loss"])
