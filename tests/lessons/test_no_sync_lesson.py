"""Lesson 06: the no_sync lab, the no_sync bench and the batch bookkeeping error (the exercise's grader:
tests/exercises/test_exercise_06.py).

(The package's own ``train_step`` -- no_sync gradient equivalence and all-reduce counts -- is tested
in tests/core/test_distributed.py; these tests cover what lesson 06 adds.) Every launch has a timeout.

"""

from __future__ import annotations

import json
import time

import notebook_runs
import pytest

from ddp_course.launch import run


# --- the lab -------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_lab_counts_all_reduces_and_compares_gradients_with_one_big_batch(tmp_path):
    # small buckets: several all-reduces per backward, so "1 vs K" is checked per bucket, not only per step
    run("ddp_course.course.l06_grad_accumulation.no_sync_lab", nproc=2, out_dir=tmp_path, timeout=120, progress=False, echo="none",
        k=4, n_micro=10, bucket_cap_mb=0.1)
    res = json.loads((tmp_path / "no_sync_lab.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    b, tol = res["n_buckets"], res["grad_rtol"]
    assert b > 1, "bucket_cap_mb=0.1 should split the ~0.4 MB of gradients into several buckets"
    every = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1]]
    last = [[3], [3], [1]]

    def col(variant, key):
        return [s[key] for s in res["variants"][variant]["steps"]]

    for variant, want in (("no_sync", last), ("always_sync", every), ("backward_only", every),
                          ("flag_after_forward", [[0]] * 3), ("forward_only", [[]] * 3), ("loss_over_k", last)):
        assert col(variant, "synced_micro_steps") == want, variant
        assert col(variant, "bucket_all_reduces") == [len(w) * b for w in want], variant  # every bucket, per sync
        for s in res["variants"][variant]["steps"]:  # the hook saw the same on every rank
            assert all(r["synced_micro_steps"] == s["synced_micro_steps"] for r in s["ranks"]), variant

    # Right gradients (tolerance explained in the lab: summation order gives ~1e-7), identical replicas.
    for variant in ("no_sync", "always_sync", "backward_only"):
        assert max(col(variant, "rel_err")) <= tol, variant
        assert max(col(variant, "replica_max_diff")) == 0.0, variant
    # Wrong ones: a rank-local part of the gradient misses by tens of percent and the replicas differ.
    for variant in ("flag_after_forward", "forward_only"):
        assert min(col(variant, "rel_err")) > 0.1, variant
        assert min(col(variant, "replica_max_diff")) > 0.0, variant
    # The leftover step of 2 divided by K = 4: exactly half the gradient; the full steps are right.
    assert col("loss_over_k", "matches_big_batch") == [True, True, False]
    assert col("loss_over_k", "norm_ratio")[-1] == pytest.approx([0.5, 0.5], rel=1e-5)


@pytest.mark.timeout(60)
def test_lab_refuses_unknown_options(tmp_path):
    r = run("ddp_course.course.l06_grad_accumulation.no_sync_lab", nproc=1, out_dir=tmp_path, timeout=50, progress=False, echo="none",
            use_torchrun=False, check=False, bogus=3)
    assert r.returncode != 0
    assert "unknown option --bogus" in r.output


def test_chunks_puts_the_leftover_in_a_last_shorter_step():
    from ddp_course.course.l06_grad_accumulation.no_sync_lab import chunks

    assert chunks(10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert chunks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunks(3, 5) == [[0, 1, 2]]
    with pytest.raises(ValueError):
        chunks(0, 4)


# --- the bench -----------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_bench_times_both_modes_and_checks_the_counts(tmp_path):
    """On 2 ranks, K = 1 and 4: lesson 06's run of the bench (K = 1, 2, 4, 8 on 1 and 2 processes) when
    it ran in this session, else a short run of its own."""
    from ddp_course.course.l06_grad_accumulation import bench_no_sync

    lesson = notebook_runs.folder("runs/06_bench")
    if lesson is not None and notebook_runs.fresh(lesson / "no_sync.json"):
        on_disk = json.loads((lesson / "no_sync.json").read_text())
    else:
        res = bench_no_sync.bench(ks="1,4", world_sizes="2", rounds=1, steps=1, warmup=0, n_layer=1, n_embd=32,
                                  n_head=2, micro_batch_size=2, timeout_s=120, out=tmp_path)
        on_disk = json.loads((tmp_path / "no_sync.json").read_text())
        assert on_disk["jobs"] == res["jobs"]
    (job,) = [j for j in on_disk["jobs"] if j["world_size"] == 2]
    assert job["backend"] == "gloo"
    b = job["n_buckets"]
    for k in (1, 4):  # the same-work check the bench made before timing, kept in its output
        assert job["counts"][f"{k}/no_sync"]["bucket_all_reduces"] == b
        assert job["counts"][f"{k}/sync"]["bucket_all_reduces"] == k * b
        assert job["counts"][f"{k}/no_sync"]["synced_micro_steps"] == [k - 1]
    assert {1, 4} <= {r["k"] for r in job["rows"]}
    for r in job["rows"]:
        assert 0 < r["no_sync_s"] < 60 and 0 < r["sync_s"] < 60
        assert r["predicted_saved_s"] == pytest.approx((r["k"] - 1) * job["allreduce_s"])
    assert job["allreduce_s"] > 0


def test_skipped_work_keeps_the_reducer_rows_the_lesson_names():
    """Lesson 06 names the reducer's steps in the profile (the division, torch::distributed::reducer::mul_out;
    the all-reduce; the copy back into .grad): ``skipped_work`` keeps them whatever their rank by time.
    It used to keep only the top operators, and on a CPU the division's own label ranked below them, so
    the lesson's profile named a row it did not show. On a one-rank gloo group in this process, with the
    top cut to one operator."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_course.course.l06_grad_accumulation.bench_no_sync import skipped_work

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
        x = torch.randn(4, 8)

        def step(no_sync: bool) -> None:
            for k in range(4):
                with ddp.no_sync() if no_sync and k < 3 else __import__("contextlib").nullcontext():
                    ddp(x).sum().backward()
            ddp.zero_grad(set_to_none=True)

        found = skipped_work(step, repeats=2, top=1)
    finally:
        dist.destroy_process_group()
    names = {op["name"]: op for op in found["ops"]}
    for name in ("torch::distributed::reducer::mul_out", "c10d::allreduce_",
                 "torch.distributed.ddp.reducer::copy_bucket_to_grad"):
        assert name in names, (name, sorted(names))
    # one call per parameter on each synchronising micro-step: 1 with no_sync, 4 without (4 parameters)
    assert (names["torch::distributed::reducer::mul_out"]["calls_no_sync"],
            names["torch::distributed::reducer::mul_out"]["calls_sync"]) == (4, 16)


def test_bench_refuses_bad_options(capsys):
    from ddp_course.course.l06_grad_accumulation import bench_no_sync

    with pytest.raises(bench_no_sync.BenchError, match="unknown option --rondus"):
        bench_no_sync.parse_options(["--rondus=3"])
    with pytest.raises(bench_no_sync.BenchError, match="comma-separated integers"):
        bench_no_sync.parse_options(["--ks=1,two"])
    with pytest.raises(bench_no_sync.BenchError, match="at least 1"):
        bench_no_sync.parse_options(["--world_sizes=0,2"])
    assert bench_no_sync.main(["--steps=0"]) == 2
    assert "error: --steps must be positive (got 0)" in capsys.readouterr().err  # bench.shared_checks, first


# --- the exercise grader -------------------------------------------------------------------------------

# The lab test above measures the all-reduce pattern of each misplacement (flag set after forward:
# [0]; forward-only: []); this checks, without a launch each, that the grader names every pattern.
# --- tokens-per-update bookkeeping ---------------------------------------------------------------------

@pytest.mark.parametrize("world, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_fixes_tokens_per_update_across_world_sizes(world, accum):
    from ddp_course.config import TrainConfig

    cfg = TrainConfig(global_batch_size=64, micro_batch_size=8, block_size=64)
    cfg.resolve_batch(world)
    assert cfg.grad_accum_steps == accum
    assert cfg.global_batch(world) * cfg.block_size == 64 * 64


def test_uneven_global_batch_is_refused_with_the_arithmetic_before_any_process_starts(tmp_path):
    from ddp_course.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError) as exc:
        TrainConfig(global_batch_size=48, micro_batch_size=8).resolve_batch(4)
    msg = str(exc.value)
    assert "48 / 32 = 1.5, not a whole number" in msg and "--global_batch_size=32 or 64" in msg
    with pytest.raises(ConfigError) as exc:  # below one step: a single suggestion, not "128 or 128"
        TrainConfig(global_batch_size=64, micro_batch_size=8).resolve_batch(16)
    assert "for example --global_batch_size=128)" in str(exc.value)

    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="40 / 16 = 2.5"):
        run("ddp_course.train", nproc=2, strategy="ddp", micro_batch_size=8, global_batch_size=40,
            out_dir=tmp_path / "bad", timeout=30)
    assert time.perf_counter() - t0 < 5  # refused in this process: no torchrun start-up
    assert not (tmp_path / "bad").exists()


@pytest.mark.multigpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_on_two_gpus_with_nccl(tmp_path):
    from ddp_course.course.l06_grad_accumulation import bench_no_sync

    res = bench_no_sync.bench(ks="1,4", world_sizes="1,2", device="cuda", rounds=2, steps=2, timeout_s=240, out=tmp_path)
    assert [j["backend"] for j in res["jobs"]] == ["nccl", "nccl"]
    for job in res["jobs"]:
        assert job["counts"]["4/sync"]["bucket_all_reduces"] == 4 * job["n_buckets"]
        assert all(r["no_sync_s"] > 0 and r["sync_s"] > 0 for r in job["rows"])
