"""Figures of lesson 14 (long sequences and many experts). Each takes plain data and returns the figure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt


def ring_work(layouts: dict[str, Any], predicted: dict[str, list[dict[str, int]]]):
    """Per rank, for each layout: the score entries computed (left, bars; the formula as black ticks) and
    the CPU milliseconds spent computing them (right; the median of the repeats, the range as a bar).

    ``layouts`` is the ``"layouts"`` part of ``ring_lab.json``; ``predicted`` the formula per layout."""
    fig, (work_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    width = 0.38
    for i, (kind, lay) in enumerate(layouts.items()):
        ranks = [r for r in range(len(lay["per_rank"]))]
        xs = [r + (i - 0.5) * width for r in ranks]
        work_ax.bar(xs, [r["score_elements"] / 1e6 for r in lay["per_rank"]], width, color=f"C{i}", label=kind)
        work_ax.scatter(xs, [p["score_elements"] / 1e6 for p in predicted[kind]], marker="_", s=300, color="k",
                        zorder=3, label="formula" if i == 0 else None)
        ms = [1e3 * r["compute_s"] for r in lay["per_rank"]]
        lo = [m - 1e3 * min(r["compute_s_all"]) for m, r in zip(ms, lay["per_rank"])]
        hi = [1e3 * max(r["compute_s_all"]) - m for m, r in zip(ms, lay["per_rank"])]
        time_ax.bar(xs, ms, width, yerr=[lo, hi], capsize=3, color=f"C{i}", label=kind)
    for ax, title, ylabel in ((work_ax, "work: score entries computed (forward)", "million entries"),
                              (time_ax, "CPU time computing blocks (forward + backward)", "ms")):
        ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ring_training(training: dict[str, Any]):
    """MiniGPT on the ring against one process: the losses (left, float32) and each step's relative
    difference between the two, in float32 and in float64 (right, log scale)."""
    fig, (loss_ax, diff_ax) = plt.subplots(1, 2, figsize=(11, 3.6))
    f32 = training["float32"]
    steps = range(1, len(f32["ring_losses"]) + 1)
    loss_ax.plot(steps, f32["reference_losses"], color="k", lw=2.5, alpha=0.35, label="one process")
    loss_ax.plot(steps, f32["ring_losses"], color="C0", lw=1, label=f"ring ({f32.get('ring_ranks', 4)} ranks, zigzag)")
    loss_ax.set_ylabel("training loss")
    for i, (name, run) in enumerate(training.items()):
        diff_ax.plot(steps, [max(d, 1e-17) for d in run["loss_rel_diff"]], color=f"C{i + 1}", lw=1, label=name)
    diff_ax.set_yscale("log")
    diff_ax.set_ylabel("|ring - one process| / one process")
    loss_ax.set_title("the losses")
    diff_ax.set_title("their relative difference, per step")
    for ax in (loss_ax, diff_ax):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def running_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each step (fewer at the start): per-step loads are noisy,
    one batch of characters at a time."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def moe_balance(training: dict[str, dict[str, Any]], *, window: int = 10, axes=None):
    """The load of the busiest expert over the mean (left) and the fraction of token-slots dropped
    (right) at each training step, one colour per run: the raw steps faint, their running mean over
    ``window`` steps solid.

    ``training`` is the ``"training"`` part of ``moe_lab.json``: run label -> ``{"imbalance": [...],
    "dropped_fraction": [...], "n_experts": E, "top_k": k, "aux_coef": ..., "capacity_factor": ...}``.
    1 is a perfectly even load; ``E / k`` is the collapse, every token sent to the same k experts."""
    fig = None
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    load_ax, drop_ax = axes
    for i, (label, run) in enumerate(training.items()):
        steps = range(1, len(run["imbalance"]) + 1)
        for ax, key in ((load_ax, "imbalance"), (drop_ax, "dropped_fraction")):
            ax.plot(steps, run[key], color=f"C{i}", lw=0.6, alpha=0.3)
            ax.plot(steps, running_mean(run[key], window), color=f"C{i}", lw=1.8, label=label)
    first = next(iter(training.values()), None)
    if first is not None:
        collapse = first["n_experts"] / first["top_k"]
        load_ax.axhline(collapse, color="k", ls=":", lw=1, label=f"collapse: E / k = {collapse:g}")
        drop_ax.set_title(f"slots dropped (capacity factor {first['capacity_factor']:g})")
    load_ax.axhline(1, color="k", ls="--", lw=1, label="even load")
    load_ax.set_ylabel("busiest expert / mean (mean of the blocks)")
    load_ax.set_title("load balance")
    drop_ax.set_ylabel("fraction of token-slots dropped")
    drop_ax.set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if fig is not None:
        fig.tight_layout()
    return fig or load_ax.figure
