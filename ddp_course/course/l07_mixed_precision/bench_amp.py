"""Mixed precision on this hardware: fp32 vs bf16 vs fp16 (and TF32 where a GPU has it).

    python -m ddp_course.course.l07_mixed_precision.bench_amp                         # MiniGPT 2 x 128, batch 16 x 64 tokens
    python -m ddp_course.course.l07_mixed_precision.bench_amp --n_embd=256 --rounds=5 --out=/tmp/bench
    python -m ddp_course.bench amp                              # the same, through the bench command

For each precision it measures, on the device at hand (``--device=auto``: the first GPU, else CPU):

- **step time**: the course's own ``ddp_course.train.train_step`` (autocast, a GradScaler for fp16,
  clipping, one AdamW step) on one batch, ``--steps`` steps per measurement, ``--rounds`` rounds
  with the precisions in rotating order (so machine noise falls on all of them), median reported;
- **activations kept for backward** (``ddp_course.metrics.saved_activation_bytes``: every tensor
  autograd saves, counted once per storage, under autocast -- the 16-bit weight copies included);
- **peak memory of a fresh process** that builds the model and trains ``--mem_steps`` steps in that
  precision: the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated``) on a GPU, the
  process's peak resident set size (and its growth over the training steps) on a CPU;
- **matmul throughput** of one ``--matmul`` x ``--matmul`` product in each dtype: the hardware's own
  answer to "is 16-bit arithmetic faster here?".

TF32 (fp32 storage, tensor-core matmuls with a 10-bit mantissa) is switched on with
``torch.set_float32_matmul_precision("high")`` on every supported version: on PyTorch 2.9 and later
that sets ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (the documented control there; the
older ``allow_tf32`` flag is being deprecated), on 2.6-2.8 ``allow_tf32``. It is timed as a fourth
variant on GPUs of compute capability 8.0 (Ampere) or newer; elsewhere it is reported as not
applicable, with the reason. Prints a table and writes ``<out>/amp.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ddp_course import bench as harness
from ddp_course.bench import BenchError, OptionError
from ddp_course.config import TrainConfig
from ddp_course.course.tiny import VOCAB  # random token ids: speed does not depend on them
from ddp_course.metrics import saved_activation_bytes
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import DTYPES, autocast, build_optimizer, make_scaler, train_step

NAME = "amp"
CPU_FLAGS = ("avx2", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
MEMORY_TAG = "AMP_BENCH_MEMORY "

OPTIONS: dict[str, tuple[Any, str]] = {
    "precisions": ("fp32,bf16,fp16", "comma-separated, of fp32, bf16, fp16"),
    "tf32": (True, "also time fp32 with TF32 matmuls, on GPUs that have them (compute capability 8.0+)"),
    "device": ("auto", "auto (the first GPU, else CPU) | cpu | cuda"),
    "n_layer": (2, "transformer blocks"), "n_head": (4, "attention heads"), "n_embd": (128, "model width"),
    "block_size": (64, "tokens per sequence"), "micro_batch_size": (16, "sequences per step"),
    "rounds": (3, "timed rounds; each times every precision, in rotating order"),
    "steps": (3, "optimizer steps per timed measurement"),
    "warmup": (1, "untimed steps of each precision first"),
    "memory": (True, "measure peak memory in a fresh process per precision"),
    "mem_steps": (2, "training steps of each memory process"),
    "matmul": (256, "n of the n x n matmul timed per dtype (0: skip)"),
    "threads": (0, "torch CPU threads (0: leave the default)"),
    "seed": (0, "model init and batch"),
    "timeout_s": (300.0, "wall-clock limit of each memory process"),
    "child": ("", "internal: the variant a memory process measures (with --worker=true)"),
}


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a measurement; ``precisions`` becomes a list."""
    precisions = [p.strip() for p in str(opts["precisions"]).split(",") if p.strip()]
    bad = [p for p in precisions if p not in ("fp32", "bf16", "fp16")]
    if bad or not precisions:
        raise OptionError(f"--precisions={opts['precisions']!r}: each must be fp32, bf16 or fp16, comma-separated "
                          "(e.g. --precisions=fp32,bf16).")
    opts["precisions"] = precisions
    harness.positive(opts, "rounds", "steps", "mem_steps", "micro_batch_size", "block_size", "n_layer", "n_head",
                     "n_embd")
    harness.positive(opts, "warmup", "matmul", "threads", least=0)
    if opts["n_embd"] % opts["n_head"]:
        raise OptionError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")
    harness.choice(opts, "device", ("auto", "cpu", "cuda"))


# --------------------------------------------------------------------------------------------------
# the hardware

def resolve_device(name: str):
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device=cuda but PyTorch sees no CUDA GPU; use --device=cpu or --device=auto.")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_flags() -> dict[str, bool] | None:
    """The CPU features that decide 16-bit speed on a CPU (Linux /proc/cpuinfo; None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return {f: f in have for f in CPU_FLAGS}
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform module knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "device_type": device.type}
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        info |= {"name": torch.cuda.get_device_name(device), "capability": f"{cap[0]}.{cap[1]}",
                 "bf16_supported": torch.cuda.is_bf16_supported(), "tf32_capable": cap >= (8, 0)}
    else:
        info |= {"name": cpu_model(), "threads": torch.get_num_threads(),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": cpu_flags()}
    return info


TF32_CPU_REASON = ("not applicable on a CPU: TF32 is a matmul mode of NVIDIA tensor cores (compute capability "
                   "8.0+), and PyTorch documents torch.set_float32_matmul_precision as affecting CUDA only")


def variants(opts: dict[str, Any], device) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """What to measure here, and what cannot be measured here (with the reason)."""
    run, skipped = [], []
    for p in opts["precisions"]:
        if p == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            skipped.append({"label": "bf16", "reason": "this GPU has no bfloat16 support (compute capability < 8.0)"})
        else:
            run.append({"label": p, "precision": p, "tf32": False})
    if opts["tf32"]:
        if device.type != "cuda":
            skipped.append({"label": "tf32", "reason": TF32_CPU_REASON})
        elif torch.cuda.get_device_capability(device) < (8, 0):
            skipped.append({"label": "tf32", "reason": "this GPU has no TF32 tensor cores (compute capability < 8.0)"})
        else:
            run.append({"label": "tf32", "precision": "fp32", "tf32": True})
    return run, skipped


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """fp32 matmuls in full fp32 ("highest", PyTorch's default) or TF32 ("high"); restored afterwards."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


# --------------------------------------------------------------------------------------------------
# one variant

def build(opts: dict[str, Any], device, precision: str):
    """(model, optimizer, scaler, batch): the same seed for every precision."""
    cfg = TrainConfig(n_layer=opts["n_layer"], n_head=opts["n_head"], n_embd=opts["n_embd"],
                      block_size=opts["block_size"], micro_batch_size=opts["micro_batch_size"], precision=precision)
    torch.manual_seed(opts["seed"])
    model = MiniGPT(GPTConfig.from_train(cfg, VOCAB)).to(device)
    g = torch.Generator().manual_seed(opts["seed"])
    tokens = torch.randint(VOCAB, (opts["micro_batch_size"], opts["block_size"] + 1), generator=g)
    batch = (tokens[:, :-1].to(device), tokens[:, 1:].to(device))
    return model, build_optimizer(model, cfg, device), make_scaler(device, precision), batch


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AutocastModel(nn.Module):
    """``model`` with its forward under autocast; backward then runs outside it, as in training."""

    def __init__(self, model: nn.Module, device: torch.device, precision: str):
        super().__init__()
        self.inner, self.device, self.precision = model, device, precision

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        with autocast(self.device, self.precision):
            return self.inner(x, y)


def matmul_gflops(device, precision: str, tf32: bool, n: int, repeats: int = 5) -> float:
    """GFLOP/s of an n x n x n matmul in this dtype (median of ``repeats`` after one warm-up)."""
    dtype = DTYPES[precision]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    times = []
    with matmul_precision(tf32):
        for i in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            a @ b
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times) / 1e9


def child_memory(opts: dict[str, Any]) -> None:
    """In a fresh process: build, train ``mem_steps`` steps in one variant, print the peak memory."""
    label = opts["child"]
    if label not in ("fp32", "bf16", "fp16", "tf32"):
        raise BenchError(f"--child={label!r} is not a variant (fp32, bf16, fp16, tf32).")
    precision, tf32 = ("fp32", True) if label == "tf32" else (label, False)
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    device = resolve_device(opts["device"])
    model, optimizer, scaler, batch = build(opts, device, precision)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = current_rss()
    with matmul_precision(tf32):
        for _ in range(opts["mem_steps"]):
            loss, _ = train_step(model, optimizer, scaler, [batch], device=device, precision=precision, grad_clip=1.0)
    loss.item()
    _sync(device)
    peak = peak_rss()
    out = {"label": label, "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
           "rss_growth_bytes": max(0, peak - rss_before) if rss_before else None}
    if device.type == "cuda":
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    print(MEMORY_TAG + json.dumps(out), flush=True)


def current_rss() -> int | None:
    """Resident set size now, in bytes (Linux; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The process's peak resident set size so far, in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss * (1 if sys.platform == "darwin" else 1024))  # Linux reports KiB, macOS bytes


def measure_memory(opts: dict[str, Any], label: str, device) -> dict[str, Any]:
    """Peak memory of one variant, measured by a fresh process (:func:`child_memory`)."""
    keys = ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size", "mem_steps", "threads", "seed")
    r = harness.launch(harness.module_benches()[NAME], 1, what=f"the memory process for {label}",
                       timeout=opts["timeout_s"], use_torchrun=False, worker=True, child=label, device=device.type,
                       **{k: opts[k] for k in keys})
    lines = [ln for ln in r.output.splitlines() if ln.startswith(MEMORY_TAG)]
    if not lines:
        raise BenchError(f"the memory process for {label} printed no measurement:\n{r.output[-2000:]}")
    return json.loads(lines[-1][len(MEMORY_TAG):])


# --------------------------------------------------------------------------------------------------
# the bench

@harness.bench(NAME, check=_check, worker=child_memory, **OPTIONS)
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Run with parsed options; prints the table and returns what it writes to ``<out>/amp.json``."""
    if opts["threads"]:
        torch.set_num_threads(opts["threads"])
    device = resolve_device(opts["device"])
    hw = hardware(device)
    todo, skipped = variants(opts, device)
    if not todo:
        raise BenchError("nothing to measure on this device: " + "; ".join(f"{s['label']}: {s['reason']}" for s in skipped))
    tokens = opts["micro_batch_size"] * opts["block_size"]
    print(f"[amp bench] MiniGPT {opts['n_layer']} layers x {opts['n_embd']} wide, batch {opts['micro_batch_size']} x "
          f"{opts['block_size']} tokens, on {device} ({hw['name']}"
          + (f", {hw['threads']} thread(s)" if device.type == "cpu" else f", compute capability {hw.get('capability')}")
          + f"); {', '.join(v['label'] for v in todo)}; {opts['rounds']} rounds x {opts['steps']} steps", flush=True)

    states = {}
    for v in todo:
        model, optimizer, scaler, batch = build(opts, device, v["precision"])
        states[v["label"]] = {"v": v, "model": model, "opt": optimizer, "scaler": scaler, "batch": batch, "times": []}

    def steps(label: str, n: int) -> float:
        s = states[label]
        with matmul_precision(s["v"]["tf32"]):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                loss, _ = train_step(s["model"], s["opt"], s["scaler"], [s["batch"]], device=device,
                                     precision=s["v"]["precision"], grad_clip=1.0)
            s["loss"] = loss.item()  # one host sync per measurement
            _sync(device)
            dt = (time.perf_counter() - t0) / n
        if not math.isfinite(s["loss"]):
            raise BenchError(f"the {label} loss became {s['loss']}: the measurement is not of normal training")
        return dt

    labels = [v["label"] for v in todo]
    if opts["warmup"]:
        for label in labels:
            steps(label, opts["warmup"])
    for r in range(opts["rounds"]):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            states[label]["times"].append(steps(label, opts["steps"]))
        print(f"[amp bench] round {r + 1}/{opts['rounds']}: "
              + ", ".join(f"{lb} {states[lb]['times'][-1] * 1e3:.1f} ms" for lb in labels), flush=True)

    rows = []
    for label in labels:
        s = states[label]
        v = s["v"]
        step_s = statistics.median(s["times"])
        model = s["model"]
        model.zero_grad(set_to_none=True)
        with matmul_precision(v["tf32"]):
            saved = saved_activation_bytes(AutocastModel(model, device, v["precision"]), *s["batch"])
        row = {"label": label, "precision": v["precision"], "tf32": v["tf32"], "step_s": step_s,
               "step_s_rounds": s["times"], "tokens_per_s": tokens / step_s, "saved_activation_bytes": saved,
               "final_loss": s["loss"], "scale_final": s["scaler"].get_scale() if s["scaler"] is not None else None}
        if opts["matmul"]:
            row["matmul_gflops"] = matmul_gflops(device, v["precision"], v["tf32"], opts["matmul"])
        rows.append(row)
    states.clear()  # free the models before the memory processes start
    if opts["memory"]:
        for row in rows:
            row["memory"] = measure_memory(opts, row["label"], device)
            row["peak_memory_bytes"] = row["memory"].get("cuda_peak_bytes", row["memory"]["peak_rss_bytes"])
    base = next((r for r in rows if r["label"] == "fp32"), None)
    for row in rows:
        row["speed_vs_fp32"] = base["step_s"] / row["step_s"] if base else None
        row["saved_activations_vs_fp32"] = (row["saved_activation_bytes"] / base["saved_activation_bytes"]
                                            if base else None)

    mem_kind = "CUDA allocator peak" if device.type == "cuda" else "peak RSS (growth in training)"
    print()
    print(f"{'variant':<8} {'ms/step':>9} {'tokens/s':>10} {'speed vs fp32':>14} {'activations MiB':>16} "
          f"{mem_kind:>30} {'matmul GFLOP/s':>15}")
    for row in rows:
        mem = "-"
        if "memory" in row:
            m = row["memory"]
            mem = (f"{m['cuda_peak_bytes'] / 2**20:,.1f} MiB" if "cuda_peak_bytes" in m else
                   f"{m['peak_rss_bytes'] / 2**20:,.0f} MiB (+{(m['rss_growth_bytes'] or 0) / 2**20:,.1f})")
        speed = f"{row['speed_vs_fp32']:.2f}x" if row["speed_vs_fp32"] else "-"
        mm = f"{row['matmul_gflops']:,.1f}" if "matmul_gflops" in row else "-"
        print(f"{row['label']:<8} {row['step_s'] * 1e3:>9.2f} {row['tokens_per_s']:>10,.0f} {speed:>14} "
              f"{row['saved_activation_bytes'] / 2**20:>16.2f} {mem:>30} {mm:>15}")
    for s in skipped:
        print(f"{s['label']:<8} {s['reason']}")
    if device.type == "cpu" and hw.get("cpu_flags"):
        flags = hw["cpu_flags"]
        print(f"\nCPU: PyTorch kernels for {hw['cpu_capability']}; 16-bit features: "
              + ", ".join(f"{f} {'yes' if flags[f] else 'no'}" for f in CPU_FLAGS if f not in ("avx2", "avx512f")))
    return {"bench": NAME, "options": opts, "hardware": hw, "rows": rows, "skipped": skipped,
            "tf32": {"applicable": any(r["tf32"] for r in rows),
                     "reason": next((s["reason"] for s in skipped if s["label"] == "tf32"), None)},
            "memory_kind": "cuda_max_memory_allocated" if device.type == "cuda" else "cpu_peak_rss"}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
