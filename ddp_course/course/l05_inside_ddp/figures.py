"""Figures of lesson 05 (inside DDP): bucket layouts, the overlap timeline, the bucket-size sweep, hooks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ddp_course.course import plots

PHASE_COLOURS = {"forward": "#9ecae1", "backward": "#fdd0a2", "allreduce by hand": "#fc9272", "optimizer": "#c7e9c0"}
COMM_COLOUR = "#d62728"
COMPUTE_COLOUR = "#e6550d"


def _part(name: str) -> str:
    """The model part a parameter belongs to: ``blocks.1.attn.qkv.weight`` -> ``blocks.1``."""
    bits = name.split(".")
    return ".".join(bits[:2]) if bits[0] in ("blocks", "layers", "h") and len(bits) > 2 else bits[0]


def buckets(layouts: Mapping[str, Sequence[Mapping[str, Any]]], numel: Mapping[str, int], *, title: str = "", ax=None):
    """One row per layout: its buckets (black boxes, numbered) in the order DDP all-reduces them.

    ``layouts`` maps a label to the buckets a comm hook recorded (each with ``params``, a list of
    parameter names); bar width is the number of gradient elements, colour the part of the model a
    parameter belongs to, so the order in which the model's parts reach the network shows.
    """
    fig, ax = plots.new_axes(ax, (10, 1.2 + 0.7 * len(layouts)))
    order: list[str] = []
    for name in numel:
        if _part(name) not in order:
            order.append(_part(name))
    colour = {part: plt.cm.viridis(i / max(1, len(order) - 1)) for i, part in enumerate(order)}
    for row, bucket_list in enumerate(layouts.values()):
        x = 0
        for i, bucket in enumerate(bucket_list):
            start = x
            for name in bucket["params"]:
                ax.barh(row, numel[name], left=x, height=0.6, color=colour[_part(name)], edgecolor="white", linewidth=0.3)
                x += numel[name]
            ax.barh(row, x - start, left=start, height=0.78, fill=False, edgecolor="black", linewidth=1.4)
            ax.text(start + 0.01 * x, row - 0.44, f"bucket {i}", ha="left", va="bottom", fontsize=7)
    ax.set_yticks(range(len(layouts)), list(layouts), fontsize=8)
    ax.set_ylim(len(layouts) - 0.4, -0.8)
    ax.set_xlabel("gradient elements, in the order they are all-reduced")
    ax.legend(handles=[Patch(color=colour[p], label=p) for p in order], fontsize=7, ncol=len(order),
              loc="lower left", bbox_to_anchor=(0, 1.0))
    if title:
        ax.set_title(title, pad=22)
    ax.grid(axis="x", alpha=0.3)
    return plots.finish(fig, ax)


def timeline(traces: Mapping[str, Mapping[str, Any]], *, step: int = -1, title: str = "", axes=None):
    """One panel per trace (from ``ddp_common.read_trace``): one step's phases, backward's autograd
    functions, and the all-reduces as the backend ran them. Times in ms from the step's start."""
    n = len(traces)
    fig = None
    if axes is None:
        fig, axes = plt.subplots(n, 1, figsize=(10, 1.9 * n + 0.6), sharex=True, squeeze=False)
        axes = axes[:, 0]
    for ax, (label, tr) in zip(axes, traces.items()):
        gpu = tr.get("timeline") == "gpu"  # GPU kernels: placed in the step that launched them
        lanes = (["phase (CPU)", "backward kernels (GPU)", "all-reduce (GPU)"] if gpu else
                 ["phase", "autograd (backward)", "all-reduce (comm thread)"])
        s = tr["steps"][step]
        t0, t1 = s["start"], s["end"]
        if gpu:
            t1 = max([t1, *(e["end"] for e in tr["compute"] + tr["comm"] if t0 <= e.get("launched", e["start"]) < t1)])

        def within(spans, t0=t0, t1=s["end"]):
            return [(e["start"] - t0, e["end"] - e["start"]) for e in spans if t0 <= e.get("launched", e["start"]) < t1]

        for e in tr["phases"]:
            if t0 <= e["start"] < s["end"]:
                ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])], (2.6, 0.8),
                               facecolors=PHASE_COLOURS.get(e["name"], "#dddddd"), edgecolor="grey", linewidth=0.5)
        ax.broken_barh(within(tr["compute"]), (1.6, 0.8), facecolors=COMPUTE_COLOUR, linewidth=0)
        ax.broken_barh(within(tr["comm"]), (0.6, 0.8), facecolors=COMM_COLOUR, edgecolor="black", linewidth=0.4, alpha=0.85)
        ax.set_yticks([3.0, 2.0, 1.0], lanes, fontsize=8)
        ax.set_ylim(0.4, 3.6)
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{label}: one step, {t1 - t0:.0f} ms", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since the step started (rank 0)")
    handles = [Patch(color=c, label=k) for k, c in PHASE_COLOURS.items()]
    handles += [Patch(color=COMPUTE_COLOUR, label="backward function"), Patch(color=COMM_COLOUR, label="all-reduce")]
    axes[0].legend(handles=handles, fontsize=7, ncol=6, loc="lower left", bbox_to_anchor=(0, 1.12))
    if title:
        axes[0].figure.suptitle(title, y=1.0)
    return plots.finish(fig, axes[0])


def sweep(rows: Sequence[Mapping[str, Any]], *, model_bytes: int | None = None, title: str = "Step time vs bucket size",
          ax=None):
    """Median step time (with the min-max range of the rounds) against ``bucket_cap_mb`` (log scale),
    the number of all-reduces per step written at each point."""
    fig, ax = plots.new_axes(ax, (7, 3.8))
    caps = [r["bucket_cap_mb"] for r in rows]
    med = [r["median_ms"] for r in rows]
    lo = [r["median_ms"] - r["min_ms"] for r in rows]
    hi = [r["max_ms"] - r["median_ms"] for r in rows]
    ax.errorbar(caps, med, yerr=[lo, hi], marker="o", capsize=3, lw=1.6)
    ax.set_ylim(0, 1.15 * max(r["max_ms"] for r in rows))  # from zero: differences at their true size
    for r in rows:
        ax.annotate(f"{r['allreduces_per_step']}", (r["bucket_cap_mb"], r["median_ms"]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8)
    if model_bytes:
        ax.axvline(model_bytes / 2**20, color="grey", ls="--", lw=1)
        ax.annotate("model size", (model_bytes / 2**20, ax.get_ylim()[0]), rotation=90, va="bottom", ha="right",
                    fontsize=8, color="grey")
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (log scale); number above a point: all-reduces per step")
    ax.set_ylabel("ms per step (median, min-max)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    return plots.finish(fig, ax)


def hook_losses(losses: Mapping[str, Sequence[float]], *, title: str = "Training loss with each communication hook",
                ax=None):
    """Loss per step of runs that differ only in their communication hook."""
    fig, ax = plots.new_axes(ax, (7, 3.6))
    for i, (name, ys) in enumerate(losses.items()):
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=1.5, ls=["-", "--", "-.", ":"][i % 4])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plots.finish(fig, ax)
