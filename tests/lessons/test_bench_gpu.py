"""The GPU throughput benchmark (``python -m ddp_course.bench gpu``) and what its figures rest on.

On a CPU the benchmark runs scaled down, reports no MFU and no per-loop peak memory, each with its
reason; the CUDA tests at the end check the GPU-only parts (memory, MFU, pinned batches, compile).
Speed targets are not asserted here: they belong to the benchmark's own PASS/FAIL.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_course import bench
from ddp_course.course.l01_minigpt import bench_overhead
from ddp_course.metrics import peak_flops

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUICK = {"steps": 2, "warmup": 1, "repeats": 2, "check_steps": 2, "n_batches": 2, "batch": 2}
ROW_KEYS = ("size", "compile", "n_params", "flops_per_token", "tokens_per_step", "course_tokens_per_s",
            "hand_tokens_per_s", "course_tokens_per_s_median", "hand_tokens_per_s_median", "ratio",
            "ratio_paired_median", "ratio_cpu_time", "spread", "noisy", "first_step_s", "course_mfu", "hand_mfu",
            "course_peak_memory_bytes", "hand_peak_memory_bytes")


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_gpu_bench_on_cpu(tmp_path, capsys, keep_threads):
    res = bench.run("gpu", device="cpu", threads=1, out=tmp_path, **QUICK)
    first = capsys.readouterr().out.splitlines()[0]
    assert "running the small sizes" in first and "on CPU" in first and "MFU not reported" in first
    on_disk = json.loads((tmp_path / "gpu.json").read_text())
    assert on_disk["scale"] == "small" and on_disk["compile_modes"] == [False]  # --compile=auto: eager on a CPU
    assert on_disk["device"] == "cpu" and on_disk["peak_flops"] is None
    assert "no CUDA GPU" in on_disk["mfu_reason"] and "not measured on a CPU" in on_disk["peak_memory_reason"]
    assert on_disk["mfu_pass"] is None and isinstance(on_disk["pass"], bool)
    assert [r["size"] for r in on_disk["rows"]] == ["shakespeare", "gpt2"]
    for row in on_disk["rows"]:
        for key in ROW_KEYS:
            assert key in row, key
        assert len(row["course_tokens_per_s"]) == len(row["hand_tokens_per_s"]) == 2
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0 and row["ratio_cpu_time"] > 0
        assert row["course_mfu"] is None and row["hand_mfu"] is None
        assert row["course_peak_memory_bytes"] is None and row["hand_peak_memory_bytes"] is None
        assert row["tokens_per_step"] == 2 * row["block_size"]  # --batch=2 overrides the size's own
    assert on_disk["rows"][1]["vocab_size"] == 4096 and on_disk["rows"][1]["tokens"] == "synthetic"
    for check in on_disk["same_work_check"].values():
        assert check["ok"] and len(check["loss_course"]) == 2 and check["flash_attention"] in (True, False)
    assert on_disk["rows"][0]["ratio"] == pytest.approx(res["rows"][0]["ratio"])


def test_gpu_bench_option_errors(capsys, tmp_path):
    assert bench.main(["gpu", "--help"]) == 0
    assert "--sizes=shakespeare,gpt2" in capsys.readouterr().out
    cases = [("--sizes=gpt3", 2, "'gpt3' is not one of shakespeare, gpt2"),
             ("--compile=maybe", 2, "'maybe' is not one of both, on, off, auto"),
             ("--scale=huge", 2, "'huge' is not one of full, small, auto"), ("--warmup=0", 2, "--warmup must be positive"),
             ("--steps=-1", 2, "--steps must be 0 or more"), ("--stepz=3", 2, "Did you mean --steps"),
             ("--repeats=x", 2, "--repeats expects an integer")]
    for arg, code, message in cases:
        assert bench.main(["gpu", arg, f"--out={tmp_path}"]) == code, arg
        assert message in capsys.readouterr().err, arg
    if not torch.cuda.is_available():
        assert bench.main(["gpu", "--device=cuda", f"--out={tmp_path}"]) == 2
        assert "sees no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()


def test_same_work_check_refuses_a_hand_loop_without_autocast(tmp_path, monkeypatch, keep_threads):
    """A hand loop that drops bf16 autocast does other work: the benchmark refuses to time it."""
    original = bench_overhead.hand_step
    monkeypatch.setattr(bench_overhead, "hand_step", lambda m, o, x, y, clip, dtype=None: original(m, o, x, y, clip))
    with pytest.raises(bench.BenchError, match="do not do the same work"):
        bench.run("gpu", device="cpu", sizes="shakespeare", threads=1, out=tmp_path, **QUICK)
    assert not (tmp_path / "gpu.json").exists()


class _Matmuls(TorchDispatchMode):
    """Records the dtype of the operands of every matrix product dispatched inside it."""
    OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}  # (bias,) a, b

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.OPERANDS:
            self.seen += [(name, args[i].dtype) for i in self.OPERANDS[name]]
        elif name.startswith("_scaled_dot_product"):  # q, k, v, output and their gradients: (B, nh, T, hs)
            self.seen += [(name, a.dtype) for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
        return func(*args, **(kwargs or {}))


def test_no_fp32_matmul_under_bf16_autocast():
    """Why the benchmark leaves TF32 alone: in a bf16 step no matmul runs in fp32 (forward and backward)."""
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import autocast

    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32))
    x, y = torch.randint(50, (2, 16)), torch.randint(50, (2, 16))
    with _Matmuls() as rec:
        with autocast(torch.device("cpu"), "bf16"):
            _, loss = model(x, y)
        loss.backward()
    assert {n for n, _ in rec.seen} >= {"addmm", "mm", "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert {d for _, d in rec.seen} == {torch.bfloat16}, rec.seen


def test_flops_per_token_counts_the_tied_head_once_and_no_position_table():
    from ddp_course.model import GPTConfig, MiniGPT

    c = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32)
    m = MiniGPT(c)
    block = 4 * c.n_embd + (3 * c.n_embd * c.n_embd + 3 * c.n_embd) + (c.n_embd * c.n_embd + c.n_embd) \
        + (4 * c.n_embd * c.n_embd + 4 * c.n_embd) + (4 * c.n_embd * c.n_embd + c.n_embd)  # 2 LNs, qkv, proj, fc, proj
    n = c.n_layer * block + c.vocab_size * c.n_embd + 2 * c.n_embd  # + token table (= head) + final LN
    assert m.num_params(include_embeddings=False) == n
    assert m.flops_per_token() == 6 * n + 12 * c.n_layer * c.block_size * c.n_embd


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA A10G", "A10G"),
    ("NVIDIA A10", "A10"), ("Some Future GPU", None)])
def test_peak_table_matches_the_most_specific_name(monkeypatch, name, key):
    from ddp_course.metrics import PEAK_FLOPS

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda"), "bf16") == (PEAK_FLOPS[key][0] if key else None)
    assert peak_flops(torch.device("cpu"), "bf16") is None


# --- on a GPU (skipped on CPU-only machines) -----------------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
def test_gpu_bench_on_cuda(tmp_path):
    res = bench.run("gpu", device="cuda", scale="small", compile="off", out=tmp_path, **QUICK)
    assert res["device"].startswith("cuda") and res["peak_memory_reason"] is None
    assert (res["peak_flops"] is None) == (res["mfu_reason"] is not None)
    for row in res["rows"]:
        assert row["course_peak_memory_bytes"] > 0 and row["hand_peak_memory_bytes"] > 0
        assert (row["course_mfu"] is None) == (res["peak_flops"] is None)
    if torch.cuda.is_bf16_supported():  # the model's attention reaches SDPA's flash kernel in bf16
        assert all(c["flash_attention"] for c in res["same_work_check"].values())


@pytest.mark.cuda
@pytest.mark.timeout(900)
@needs_cuda
def test_gpu_bench_compiled_on_cuda(tmp_path):
    res = bench.run("gpu", device="cuda", scale="small", sizes="shakespeare", compile="on", out=tmp_path, **QUICK)
    assert [r["compile"] for r in res["rows"]] == [True]
    assert res["rows"][0]["course_tokens_per_s_median"] > 0


@pytest.mark.cuda
@needs_cuda
def test_stream_batches_pinned_for_a_gpu():
    from ddp_course.data import stream_batches

    tokens = torch.arange(1000)
    x, y = next(stream_batches(tokens, 8, 4, 0, 1, seed=0, pin_memory=True))
    plain = next(stream_batches(tokens, 8, 4, 0, 1, seed=0))
    assert x.is_pinned() and y.is_pinned()
    assert torch.equal(x, plain[0]) and torch.equal(y, plain[1])
