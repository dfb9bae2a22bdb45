"""Metrics are data: rank 0 appends one JSON object per logged step to ``metrics.jsonl``.

A training row carries ``step`` (optimizer steps done), ``loss`` (mean training loss over the steps
since the previous row, averaged over ranks), ``lr``, ``tokens_per_s`` (over that interval, all
ranks together), ``grad_norm`` and, on a GPU with a known peak, ``mfu``; an evaluation row carries
``step`` and ``val_loss``.

Plots, tests and the launcher's progress bar read these files; nothing scrapes logs.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

# Dense peak throughput in FLOP/s for MFU, (16-bit tensor cores, fp32 without TF32), from the
# vendors' data sheets. Data sheets quote tensor-core figures "with sparsity" (2:4 structured); the
# dense peak, the one dense training can reach, is half of that. A GPU not listed gets no MFU rather
# than a made-up one. Matched by substring of torch.cuda.get_device_name in this order, so a longer
# name comes before a name it contains (H100 NVL before H100, L40S before L4, A100 before A10).
PEAK_FLOPS = {
    "GH200": (989e12, 67e12),  # NVIDIA GH200 Grace Hopper data sheet: its H100 GPU, bf16 1,979 sparse
    "H200 NVL": (835e12, 60e12),  # NVIDIA H200 data sheet, H200 NVL column: bf16 1,671 sparse, fp32 60
    "H200": (989e12, 67e12),  # NVIDIA H200 data sheet, H200 SXM column: bf16 1,979 sparse, fp32 67
    "H100 NVL": (835e12, 60e12),  # NVIDIA H100 data sheet, H100 NVL column: bf16 1,671 sparse, fp32 60
    "H100 PCIe": (756e12, 51e12),  # NVIDIA H100 data sheet, H100 PCIe column: bf16 1,513 sparse, fp32 51
    "H100": (989e12, 67e12),  # NVIDIA H100 data sheet, H100 SXM (HBM3) column: bf16 1,979 sparse, fp32 67
    "A100": (312e12, 19.5e12),  # NVIDIA A100 data sheet (SXM and PCIe alike): bf16 624 sparse, fp32 19.5
    "L40S": (362e12, 91.6e12),  # NVIDIA L40S data sheet: bf16 733 sparse, fp32 91.6
    "L4": (121e12, 30.3e12),  # NVIDIA L4 data sheet: bf16 242 sparse, fp32 30.3
    "A10G": (70e12, 31.2e12),  # a cloud-only part with no NVIDIA data sheet: figures as first entered, unverified
    "A10": (125e12, 31.2e12),  # NVIDIA A10 data sheet: bf16 250 sparse, fp32 31.2
    "T4": (65e12, 8.1e12),  # NVIDIA T4 data sheet: mixed fp16/fp32 65 dense (no bf16), fp32 8.1
    "V100": (125e12, 15.7e12),  # NVIDIA V100 data sheet, SXM2: tensor 125 dense (fp16 only), fp32 15.7
    "RTX 4090": (165e12, 82.6e12),  # NVIDIA Ada architecture whitepaper: fp16/bf16 with fp32 accumulate 165
    "RTX 3090": (71e12, 35.6e12),  # NVIDIA Ampere GA102 whitepaper: fp16/bf16 with fp32 accumulate 71
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The data-sheet peak for this GPU and precision, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, fp32) in PEAK_FLOPS.items():  # longer names first where it matters (see the table)
        if key in name:
            return half if precision in ("bf16", "fp16") else fp32
    return None


def mfu(flops_per_token: float, tokens_per_s: float, world_size: int, device: torch.device,
        precision: str) -> float | None:
    """Model-FLOPs utilisation: achieved model FLOP/s over the peak of all ranks' GPUs."""
    peak = peak_flops(device, precision)
    if peak is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * world_size)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory of this process: the CUDA caching allocator's peak, or the CPU's peak RSS."""
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)), "memory_kind": "cuda_allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    factor = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    return {"peak_memory_bytes": int(rss * factor), "memory_kind": "cpu_peak_rss"}


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class MetricsWriter:
    """Writes ``metrics.jsonl`` (one flushed line per row) on rank 0; a no-op elsewhere.

    ``resume_at``: a job resumed after that many steps keeps the rows up to it and appends. A run that
    crashed after its last checkpoint had logged steps that the resumed run computes again; their rows
    (and a row cut short by the crash) are dropped first, so no step appears twice (``dropped``: how many).
    """

    def __init__(self, out_dir: str | os.PathLike, enabled: bool, resume_at: int = 0) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._fh = None
        self.dropped = 0
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at:
                self.dropped = self._drop_after(resume_at)
            self._fh = open(self.path, "a" if resume_at else "w", buffering=1, encoding="utf-8")

    def _drop_after(self, step: int) -> int:
        """Rewrite the file without the rows logged after ``step`` (atomically); returns how many went."""
        if not self.path.exists():
            return 0
        lines = [ln for ln in self.path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        keep = []
        for ln in lines:
            try:
                if json.loads(ln).get("step", 0) > step:
                    continue
            except json.JSONDecodeError:  # a row cut short by the crash
                continue
            keep.append(ln)
        if len(keep) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
            os.replace(tmp, self.path)
        return len(lines) - len(keep)

    def write(self, row: dict[str, Any]) -> None:
        if self._fh is not None:
            # strict JSON: a skipped fp16 step's inf/nan gradient norm is written as null
            row = {"time": round(time.time(), 3),
                   **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}}
            self._fh.write(json.dumps(row, allow_nan=False) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded to 0.01; None where the OS has none (Windows).
    Benchmarks record it beside their timings: a busy machine explains a slow or noisy figure."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                break
    return rows


def saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes the autograd graph keeps from one forward for the backward (parameters excluded).

    Counted exactly, on any device, with ``torch.autograd.graph.saved_tensors_hooks``: every tensor
    saved for backward passes through the hook; storages are counted once.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def time_forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int = 5) -> dict[str, Any]:
    """Median seconds of one forward+backward (after one warm-up), and the CUDA peak where there is one."""
    device = x.device
    times = []
    reset_peak_memory(device)
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i > 0:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    out: dict[str, Any] = {"step_s": times[len(times) // 2]}
    if device.type == "cuda":
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out
