"""Figures of lesson 10: scaling against the ideal, where a step's time goes, the DataLoader, the loss
of one job on one node and on two. Each takes a benchmark's result (the dict it wrote) and returns the figure."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt

PHASE_LABELS = {"data": "data loading", "forward": "forward", "backward_compute": "backward (compute)",
                "comm_wait": "waiting on communication", "optimizer": "optimizer step"}


def speedup_efficiency(result: dict[str, Any]):
    """Speedup and efficiency against the process count, weak and strong scaling, with the ideal
    (speedup = n) and the limit the machine's cores set (speedup <= cores when each process needs one)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = [r["nproc"] for r in result["weak"]]
    cores = result["cpu_count"]
    threads = result["options"]["threads"]
    ax1.plot(ns, ns, "k--", lw=1, label="ideal: n x one process")
    ax1.plot(ns, [min(n, cores / threads) for n in ns], ":", color="grey", lw=1.5,
             label=f"at most {cores} core(s) / {threads} thread(s) each")
    for kind, marker in (("weak", "o"), ("strong", "s")):
        rows = result[kind]
        ax1.plot([r["nproc"] for r in rows], [r["speedup"] for r in rows], marker=marker, lw=1.8,
                 label=f"{kind} scaling (measured)")
        ax2.plot([r["nproc"] for r in rows], [100 * r["efficiency"] for r in rows], marker=marker, lw=1.8,
                 label=f"{kind} scaling")
    ax2.axhline(100, color="k", ls="--", lw=1, label="ideal")
    for ax in (ax1, ax2):
        ax.set_xlabel("processes")
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("speedup (tokens/s over one process)")
    ax1.set_title("speedup")
    ax2.set_ylabel("efficiency = speedup / n  (%)")
    ax2.set_title("efficiency")
    fig.tight_layout()
    return fig


def step_breakdown(result: dict[str, Any]):
    """Stacked bars: the median time of each phase of a training step, per process count."""
    phases = result["phases"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"{p['nproc']} process{'es' if p['nproc'] > 1 else ''}" for p in phases]
    bottom = [0.0] * len(phases)
    for i, (key, name) in enumerate(PHASE_LABELS.items()):
        vals = [1e3 * p[key] for p in phases]
        ax.bar(labels, vals, bottom=bottom, color=f"C{i}", label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ar = [1e3 * p["allreduce_full_gradient"] for p in phases]
    for x, (b, a, p) in enumerate(zip(bottom, ar, phases)):
        if p["nproc"] > 1:
            ax.annotate(f"one all-reduce of the\nwhole gradient: {a:.2f} ms", (x, b), ha="center", va="bottom",
                        fontsize=8)
    ax.set_ylabel("ms per step (slowest rank)")
    ax.set_title("where a step's time goes (weak-scaling batch)")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.25)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def dataloader(result: dict[str, Any]):
    """Per configuration: the time per batch spent waiting for data, and computing, stacked."""
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    labels = [r["label"].replace(", ", "\n") for r in rows]
    wait = [1e3 * r["wait_per_batch_s"] for r in rows]
    comp = [1e3 * r["compute_per_batch_s"] for r in rows]
    ax.bar(labels, comp, color="C2", label="computing (forward + backward)")
    ax.bar(labels, wait, bottom=comp, color="C3", label="waiting for the next batch")
    ax.axhline(1e3 * result["batch_read_s"], color="grey", ls=":", lw=1.5,
               label="reading one batch in the training process")
    ax.set_ylabel("ms per batch (median of rounds)")
    ax.set_title(f"DataLoader settings ({result['cpu_count']} core(s))")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.45)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    return fig


def same_loss(curves: dict[str, tuple[list[int], list[float]]], title: str):
    """Loss curves that should lie on top of each other (one line style each, so all stay visible)."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    styles = ["-", "--", ":", "-."]
    for i, (label, (steps, loss)) in enumerate(curves.items()):
        ax.plot(steps, loss, ls=styles[i % len(styles)], lw=2.2 - 0.4 * i, marker="o", ms=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
