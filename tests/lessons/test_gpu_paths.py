"""The device choice, and the CUDA paths of the labs as far as the machine at hand allows.

- Everywhere: the choice logic with the GPUs faked (``torch.cuda`` monkeypatched): ``auto`` never
  puts two NCCL ranks on one GPU; the test-only ``DDP_COURSE_TEST_GLOO_SHARED_GPU=1`` shares a GPU
  through gloo; a study of several jobs runs on one kind of device; two "nodes" on one machine never
  share a GPU. And the GPU reading of a profiler trace, on a small trace written by hand.
- With one CUDA GPU (skipped otherwise): the 2-rank paths -- DDP training, the DDP half of the DP vs
  DDP benchmark, the no_sync and profile labs, ZeroRedundancyOptimizer's lab, the tensor- and
  pipeline-parallel labs -- with CUDA tensors on 2 ranks that share the GPU through gloo (the
  test-only option), and the one-process labs on the GPU. The 2-GPU paths (NCCL
  DDP/FSDP, DP) are tested where they live, on machines with two GPUs.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from harness import TINY, python_module, torchrun

from ddp_course import dist as ddp_dist
from ddp_course.config import to_cli
from ddp_course.course.l04_ddp import two_nodes
from ddp_course.course.l05_inside_ddp.ddp_common import overlap_stats, read_trace
from ddp_course.dist import SHARED_GPU_VAR, DeviceError, choose_device, choose_study_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` makes torch report n CUDA GPUs (0: none) for the rest of the test."""
    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.delenv(SHARED_GPU_VAR, raising=False)
    return fake


# --- the choice, with the GPUs faked --------------------------------------------------------------

def test_auto_never_puts_two_nccl_ranks_on_one_gpu(gpus):
    gpus(1)
    assert choose_device("auto", 1)[:2] == (torch.device("cuda"), "nccl")
    device, backend, reason = choose_device("auto", 2)
    assert (device.type, backend) == ("cpu", "gloo") and "NCCL needs one GPU each" in reason
    with pytest.raises(DeviceError, match="one GPU per process"):
        choose_device("cuda", 2)
    gpus(2)
    assert choose_device("auto", 2)[:2] == (torch.device("cuda"), "nccl")
    assert choose_device("auto", 4)[:2] == (torch.device("cpu"), "gloo")


def test_the_test_only_option_shares_a_gpu_through_gloo(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv(SHARED_GPU_VAR, "1")
    for requested in ("auto", "cuda"):
        device, backend, reason = choose_device(requested, 2)
        assert (device.type, backend) == ("cuda", "gloo") and "test-only" in reason
    assert choose_device("auto", 1)[:2] == (torch.device("cuda"), "nccl")  # enough GPUs: the normal choice
    assert choose_device("cpu", 2)[:2] == (torch.device("cpu"), "gloo")
    gpus(2)
    monkeypatch.setenv(SHARED_GPU_VAR, "1")
    assert choose_device("auto", 2)[1] == "nccl"  # one GPU each: NCCL, the option changes nothing
    gpus(0)
    monkeypatch.setenv(SHARED_GPU_VAR, "1")
    assert choose_device("auto", 2)[:2] == (torch.device("cpu"), "gloo")  # no GPU to share
    with pytest.raises(DeviceError):
        choose_device("cuda", 2)


def test_a_study_runs_every_job_on_one_kind_of_device(gpus):
    gpus(0)
    assert choose_study_device("auto", [1, 2, 4])[:2] == ("cpu", [1, 2, 4])
    gpus(1)  # only the 1-process job would get a GPU: the CPU for all, and the reason says why
    device, sizes, reason = choose_study_device("auto", [1, 2])
    assert (device, sizes) == ("cpu", [1, 2]) and "mixed devices" in reason
    gpus(2)  # 1 and 2 processes fit: those, on the GPUs, and the 4 is left out with a reason
    device, sizes, reason = choose_study_device("auto", [4, 1, 2])
    assert (device, sizes) == ("cuda", [1, 2]) and "left out 4" in reason
    with pytest.raises(DeviceError):
        choose_study_device("cuda", [1, 2, 4])
    gpus(4)
    assert choose_study_device("auto", [1, 2, 4])[:2] == ("cuda", [1, 2, 4])
    assert choose_study_device("cpu", [1, 2, 4])[:2] == ("cpu", [1, 2, 4])


def test_two_nodes_on_one_machine_never_share_a_gpu(gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus(4)
    assert two_nodes.gpus_per_node(2)[0] == ["0,1", "2,3"]
    assert two_nodes.gpus_per_node(1)[0] == ["0", "1"]
    assert two_nodes.gpus_per_node(2, share=True)[0] == ["0,1,2,3"] * 2
    gpus(2)
    assert two_nodes.gpus_per_node(2)[0] == ["", ""]  # too few for both: both on the CPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert two_nodes.gpus_per_node(1)[0] == ["5", "7"]  # the GPUs this process was given, not 0 and 1


def test_a_pinned_cpu_says_why(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    threads = torch.get_num_threads()
    try:
        with ddp_dist.setup(device="cpu", threads=1, because="the reason") as info:
            assert info.device.type == "cpu"
            assert info.device_reason.startswith("CPU by design: the reason")
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="device='cpu'"):
        with ddp_dist.setup(device="auto", because="the reason"):
            pass


# --- the GPU reading of a profiler trace, on a trace written by hand -------------------------------

def _gpu_trace(path) -> None:
    """One step as a CUDA trace records it (times in us): forward, then backward's two autograd functions
    on the engine's thread (tid 2), each launching a kernel; the first also hands a bucket to NCCL, whose
    kernel runs on its own stream while the second backward kernel computes."""
    def x(name, ts, dur, tid, cat="cpu_op", **args):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat, "args": args}

    events = [
        x("step 0", 0, 100, 1, "user_annotation"), x("forward", 0, 20, 1, "user_annotation"),
        x("backward", 20, 60, 1, "user_annotation"),
        x("autograd::engine::evaluate_function: MmBackward0", 25, 10, 2),
        x("cudaLaunchKernel", 26, 2, 2, "cuda_runtime", correlation=1),
        x("c10d::allreduce_", 31, 2, 2),
        x("cudaLaunchKernel", 32, 1, 2, "cuda_runtime", correlation=2),
        x("autograd::engine::evaluate_function: EmbeddingBackward0", 40, 10, 2),
        x("cudaLaunchKernel", 41, 2, 2, "cuda_runtime", correlation=3),
        x("cudaLaunchKernel", 85, 2, 1, "cuda_runtime", correlation=4),  # the optimizer, after backward
        x("sgemm_backward", 30, 40, 7, "kernel", correlation=1, stream=7),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 60, 20, "kernel",
          correlation=2, stream=20),
        x("embedding_backward", 70, 30, 7, "kernel", correlation=3, stream=7),
        x("adam_kernel", 110, 10, 7, "kernel", correlation=4, stream=7),
    ]
    path.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")


def test_a_gpu_trace_is_read_from_the_kernels(tmp_path):
    _gpu_trace(tmp_path / "trace.json")
    trace = read_trace(tmp_path / "trace.json")
    assert trace["timeline"] == "gpu"
    assert [c["name"] for c in trace["compute"]] == ["sgemm_backward", "embedding_backward"]  # not the optimizer's
    assert len(trace["comm"]) == 1 and trace["comm"][0]["name"].startswith("ncclDevKernel_AllReduce")
    stats = overlap_stats(trace)
    # backward's kernels: 0.030 .. 0.100 ms; NCCL's: 0.050 .. 0.110 ms -> 0.050 hidden, 0.010 exposed
    assert stats["backward_compute_ms"] == pytest.approx(0.070)
    assert stats["allreduce_in_flight_ms"] == pytest.approx(0.060)
    assert stats["allreduce_during_backward_ms"] == pytest.approx(0.050)
    assert stats["allreduce_after_backward_ms"] == pytest.approx(0.010)
    assert stats["launched_during_backward"] == 1 and stats["n_allreduce"] == 1
    assert stats["step_ms"] == pytest.approx(0.110)  # the step ends with its last kernel, not its CPU range


def test_a_gloo_all_reduce_in_a_gpu_trace_counts_once(tmp_path):
    # gloo with CUDA tensors (the test-only shared GPU): no NCCL kernel, so the all-reduce is gloo's CPU
    # span; the profiler mirrors that span onto the GPU timeline (seen on an H100, torch 2.11), which
    # must not count as a second all-reduce.
    _gpu_trace(tmp_path / "nccl.json")
    events = [e for e in json.loads((tmp_path / "nccl.json").read_text())["traceEvents"]
              if not e["name"].startswith("nccl")]
    mark = {"ph": "X", "name": "gloo:all_reduce", "ts": 50, "dur": 60, "pid": 1, "tid": 30, "cat": "user_annotation",
            "args": {}}
    events += [mark, {**mark, "ts": 95, "dur": 5, "tid": 7, "cat": "gpu_user_annotation"}]
    (tmp_path / "gloo.json").write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
    trace = read_trace(tmp_path / "gloo.json")
    assert trace["timeline"] == "gpu" and [c["start"] for c in trace["comm"]] == [pytest.approx(0.050)]
    assert overlap_stats(trace)["n_allreduce"] == 1


# --- one GPU, for real (skipped without one) -------------------------------------------------------

def _one_gpu_shared() -> dict[str, str]:
    """The environment of a 2-rank job that shares the first visible GPU through gloo (test-only)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return {SHARED_GPU_VAR: "1", "CUDA_VISIBLE_DEVICES": first}


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_ddp_training_with_cuda_tensors_on_two_ranks_sharing_a_gpu(tmp_path):
    proc = torchrun("ddp_course.train", 2, to_cli({**TINY, "max_steps": 10, "strategy": "ddp", "out_dir": str(tmp_path)}),
                    env=_one_gpu_shared(), timeout=240)
    config = json.loads((tmp_path / "config.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert config["backend"] == "gloo" and config["device"] == "cuda:0" and config["world_size"] == 2
    assert "test-only" in proc.stdout  # the first line says how it ran
    assert math.isfinite(summary["final_loss"]) and summary["memory_kind"] == "cuda_allocated"


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_dp_vs_ddp_as_far_as_one_gpu_allows(tmp_path):
    # The DDP half of the benchmark: 2 ranks on the one GPU, each recording that GPU's peak memory.
    torchrun("ddp_course.course.l03_data_parallel.train_gpu_memory", 2,
             to_cli({**TINY, "max_steps": 6, "strategy": "ddp", "out_dir": str(tmp_path / "ddp")}),
             env=_one_gpu_shared(), timeout=240)
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "ddp").glob("gpu_memory_rank*.json"))]
    assert [list(r["gpus"]) for r in records] == [["0"], ["0"]]
    assert all(r["gpus"]["0"]["peak_allocated_bytes"] > 0 for r in records)
    # The DP half needs two GPUs: with one, the benchmark refuses in one line, before anything starts.
    r = python_module("ddp_course.course.l03_data_parallel.bench_dp_vs_ddp", [f"--out={tmp_path}"],
                      env={"CUDA_VISIBLE_DEVICES": _one_gpu_shared()["CUDA_VISIBLE_DEVICES"]}, check=False)
    assert r.returncode == 2 and r.stderr.startswith("error: DP vs DDP needs at least 2 CUDA GPUs"), r.stderr
    assert "one CUDA GPU" in r.stderr and not (tmp_path / "dp_vs_ddp.json").exists()


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_no_sync_lab_with_cuda_tensors(tmp_path):
    torchrun("ddp_course.course.l06_grad_accumulation.no_sync_lab", 2, [f"--out_dir={tmp_path}", "--variants=no_sync,backward_only"],
             env=_one_gpu_shared(), timeout=240)
    res = json.loads((tmp_path / "no_sync_lab.json").read_text())
    assert res["device"] == "cuda" and res["backend"] == "gloo"
    # backward_only is lesson 06's silent bug: the right gradients at K times the traffic (every
    # micro-step all-reduces), as on the CPU (tests/lessons/test_no_sync_lesson.py)
    for variant in ("no_sync", "backward_only"):
        assert all(s["matches_big_batch"] for s in res["variants"][variant]["steps"]), variant
    assert all(s["synced_micro_steps"] == [s["micro_batches"] - 1] for s in res["variants"]["no_sync"]["steps"])
    assert all(s["synced_micro_steps"] == list(range(s["micro_batches"]))
               for s in res["variants"]["backward_only"]["steps"])


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_profile_lab_reads_a_cuda_trace(tmp_path):
    torchrun("ddp_course.course.l05_inside_ddp.ddp_profile", 2,
             [f"--out_dir={tmp_path}", "--bucket_cap_mb=0.01", "--n_layer=2", "--n_head=2", "--n_embd=32",
              "--block_size=16", "--micro_batch_size=4", "--trace_steps=1", "--steps=2", "--rounds=1", "--warmup=2"],
             env=_one_gpu_shared(), timeout=240)
    res = json.loads((tmp_path / "profile.json").read_text())
    assert res["device"] == "cuda"
    variants = res["variants"]
    assert all(v["timeline"] == "gpu" and v["median_ms"] > 0 for v in variants.values())
    stats = {name: v["trace_stats"] for name, v in variants.items()}
    assert stats["one_bucket"]["n_allreduce"] == 1 and stats["one_bucket"]["launched_during_backward"] == 0
    assert stats["overlap"]["launched_during_backward"] >= 1 and stats["by_hand"]["launched_during_backward"] == 0
    assert all(s["backward_compute_ms"] > 0 for s in stats.values())


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_kill_lab_on_the_gpu_leaves_a_checkpoint_that_loads_on_the_cpu(tmp_path):
    from ddp_course import checkpoint
    from ddp_course.config import TrainConfig
    from ddp_course.course.l08_checkpointing.ckpt_kill import SHAPE
    from ddp_course.dist import DistInfo
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import build_optimizer

    proc = python_module("ddp_course.course.l08_checkpointing.ckpt_kill", ["--device=cuda", f"--out_dir={tmp_path}"],
                         check=False)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "ckpt_kill.json").read_text())
    model = MiniGPT(GPTConfig(**SHAPE))
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    meta = checkpoint.resume(checkpoint.latest(tmp_path), checkpoint.TrainState(model, opt, checkpoint.DCP), DistInfo())
    assert meta["step"] == 1 and checkpoint.fingerprint(model, opt, plan=checkpoint.DCP) == report["fingerprint"]


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_zero_redundancy_lab_with_cuda_tensors(tmp_path):
    torchrun("ddp_course.course.l09_fsdp.zero_lab", 2, [f"--out_dir={tmp_path}"], env=_one_gpu_shared(), timeout=240)
    lab = json.loads((tmp_path / "zero_lab.json").read_text())
    assert (lab["device"], lab["backend"]) == ("cuda", "gloo")
    lr = lab["options"]["lr"]
    assert all(r["max_abs_diff_vs_ddp"] <= lr / 100 and r["max_abs_diff_across_ranks"] == 0 for r in lab["per_rank"])
    assert all(r["zero_optimizer_bytes"] == r["predicted_zero1"] for r in lab["per_rank"])
    assert lab["consolidated"]["same_parameters"] and lab["consolidated"]["max_abs_diff_moments"] <= lr / 100


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_tensor_parallel_lab_with_cuda_tensors(tmp_path):
    torchrun("ddp_course.course.l11_beyond_data_parallel.tp_lab", 2, [f"--out_dir={tmp_path}"],
             env=_one_gpu_shared(), timeout=240)
    lab = json.loads((tmp_path / "tp_lab.json").read_text())
    assert (lab["device"], lab["backend"]) == ("cuda", "gloo")
    # the CPU's tolerance (tests/lessons/test_tensor_parallel.py): float32 matmuls on the GPU are still float32
    # (TF32 is off for them by default), only summed in another order
    assert lab["max_rel_diff"] <= 1e-5 and lab["first_logits_rel_diff"]["tp"] <= 1e-5
    assert lab["losses_tp"][-1] < lab["losses_tp"][0]


@pytest.mark.cuda
@pytest.mark.timeout(300)
@needs_cuda
def test_pipeline_lab_with_cuda_tensors(tmp_path):
    # gloo sends no CUDA tensors: the lab's own send/recv go through the CPU, and the library (which
    # would need gloo to) is refused with a reason (NCCL, on two GPUs, runs it)
    lab_module = "ddp_course.course.l11_beyond_data_parallel.pp_lab"
    refused = torchrun(lab_module, 2, [f"--out_dir={tmp_path}"], env=_one_gpu_shared(), timeout=120, check=False)
    assert refused.returncode != 0 and "error: torch.distributed.pipelining" in refused.stdout + refused.stderr
    torchrun(lab_module, 2, [f"--out_dir={tmp_path}", "--micro_batches=1,4", "--repeats=2", "--library=false"],
             env=_one_gpu_shared(), timeout=240)
    lab = json.loads((tmp_path / "pp_lab.json").read_text())
    assert (lab["device"], lab["backend"]) == ("cuda", "gloo")
    par = lab["parity"]["variants"]
    assert par["gpipe"]["matches"] and "torch_pipelining" not in par
    assert not par["no_tied_sync"]["matches"] and not par["no_loss_scale"]["matches"]
    assert all(0 < i < 1 for r in lab["bubble"]["per_m"].values() for i in r["idle"])
