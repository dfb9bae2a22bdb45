"""Figures of lesson 07 (mixed precision). Each takes plain data from ``ddp_course.course.l07_mixed_precision.amp`` or the amp
benchmark and returns the figure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt

from ddp_course.course import plots
from ddp_course.course.plots import bars


def dtype_ranges(rows: list[dict[str, Any]], *, marks: dict[str, float] | None = None, ax=None):
    """The positive range of each dtype on a log10 axis: subnormals (light), normal numbers (dark).

    ``marks``: vertical lines at values worth locating (e.g. a typical gradient, fp16's maximum).
    """
    fig, ax = plots.new_axes(ax, (8, 2.6))
    for i, r in enumerate(rows):
        lo, mid, hi = (math.log10(r[k]) for k in ("smallest_subnormal", "smallest_normal", "max"))
        ax.barh(i, mid - lo, left=lo, color=f"C{i}", alpha=0.35, height=0.6)
        ax.barh(i, hi - mid, left=mid, color=f"C{i}", alpha=0.9, height=0.6)
        ax.text(hi + 1, i, f"max {r['max']:.3g}", va="center", fontsize=8)
    for j, (label, value) in enumerate((marks or {}).items()):
        ax.axvline(math.log10(value), color="k", ls=":", lw=1)
        ax.text(math.log10(value), len(rows) - 0.5 + 0.4 * (j % 2), label, fontsize=8, ha="center")
    ax.set_yticks(range(len(rows)), [f"{r['precision']} ({r['exponent_bits']}e/{r['mantissa_bits']}m bits)"
                                     for r in rows])
    ax.set_xlabel("log10 of the magnitude (light: subnormal, dark: normal numbers)")
    ax.set_xlim(right=max(math.log10(r["max"]) for r in rows) + 12)
    ax.set_ylim(-0.6, len(rows) + 0.3)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("the range each format can hold")
    return plots.finish(fig, ax)


def scaler_trace(demo: dict[str, Any]):
    """GradScaler, step by step: the scale (log2) before and after each step, skipped steps marked;
    and the gradient norm as backward left it (scaled) and after ``unscale_``."""
    rows = demo["rows"]
    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    a.step(steps, [math.log2(r["scale"]) for r in rows], where="post", label="scale used", color="C0")
    a.plot(steps, [math.log2(r["scale_after"]) for r in rows], "o", ms=4, color="C0", alpha=0.5,
           label="scale after update()")
    skipped = [r for r in rows if r["skipped"]]
    a.plot([r["step"] for r in skipped], [math.log2(r["scale"]) for r in skipped], "x", color="C3", ms=10, mew=2,
           label="optimizer step skipped")
    a.set_xlabel("step")
    a.set_ylabel("log2(scale)")
    a.set_title("the loss scale")
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
    finite = [r for r in rows if math.isfinite(r["grad_norm_scaled"])]
    b.semilogy([r["step"] for r in finite], [r["grad_norm_scaled"] for r in finite], "o-", label="|g| as backward left it (scaled)")
    b.semilogy([r["step"] for r in finite], [r["grad_norm"] for r in finite], "s-", label="|g| after unscale_")
    b.axhline(demo["settings"]["grad_clip"], color="k", ls=":", lw=1, label="clip threshold")
    for r in skipped:
        b.axvline(r["step"], color="C3", alpha=0.4, lw=6)
    b.set_xlabel("step")
    b.set_ylabel("gradient norm")
    b.set_title("the gradient norm (red: inf/nan, step skipped)")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def amp_bench(result: dict[str, Any]):
    """The amp benchmark: step time (with the speed against fp32), activations kept for backward,
    and peak memory (CUDA allocator, or a fresh process's RSS growth on a CPU)."""
    rows = result["rows"]
    has_mem = all("memory" in r for r in rows)
    fig, axes = plt.subplots(1, 3 if has_mem else 2, figsize=(12 if has_mem else 8, 3.4))
    labels = [r["label"] for r in rows]
    bars({lb: r["step_s"] * 1e3 for lb, r in zip(labels, rows)}, ylabel="ms per step", ax=axes[0],
         title="step time (lower is faster)", fmt="{:.1f}")
    for i, r in enumerate(rows):
        if r.get("speed_vs_fp32"):
            axes[0].annotate(f"{r['speed_vs_fp32']:.2f}x", (i, 0), xytext=(0, 4), textcoords="offset points",
                             ha="center", fontsize=8, color="white", weight="bold")
    bars({lb: r["saved_activation_bytes"] / 2**20 for lb, r in zip(labels, rows)}, ylabel="MiB", ax=axes[1],
         title="activations kept for backward", fmt="{:.2f}")
    if has_mem:
        if result["memory_kind"] == "cuda_max_memory_allocated":
            vals, title = {lb: r["memory"]["cuda_peak_bytes"] / 2**20 for lb, r in zip(labels, rows)}, "CUDA allocator peak"
        else:
            vals = {lb: (r["memory"]["rss_growth_bytes"] or 0) / 2**20 for lb, r in zip(labels, rows)}
            title = "RSS growth while training (fresh process)"
        bars(vals, ylabel="MiB", ax=axes[2], title=title, fmt="{:.1f}")
    hw = result["hardware"]
    fig.suptitle(f"fp32 vs 16-bit on {hw['device']} ({hw['name']})", fontsize=10)
    fig.tight_layout()
    return fig


def clip_order(result: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]], *, baseline: float | None = None,
               title: str = "Clipping before or after unscale_"):
    """One panel per optimizer: the loss of each order of clip and unscale_, per step; ``baseline``
    (ln of the vocabulary, an untrained model's loss) as a dotted line."""
    fig, axes = plt.subplots(1, len(result), figsize=(5 * len(result), 3.4), sharey=True, squeeze=False)
    for ax, (name, orders) in zip(axes[0], result.items()):
        for i, (order, rows) in enumerate(orders.items()):
            ax.plot(range(1, len(rows["loss"]) + 1), rows["loss"], color=f"C{i}", lw=1.2, label=order)
        if baseline is not None:
            ax.axhline(baseline, color="0.5", ls=":", lw=1, label="ln(vocabulary): untrained")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("training loss (nats / char)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
