"""Figures of lesson 11 (beyond data parallelism). Each takes plain data and returns the figure."""

from __future__ import annotations

import statistics
from typing import Any

import matplotlib.pyplot as plt

from ddp_course.course.plots import finish, new_axes


def bubble_vs_m(bubble: dict[str, Any], *, ax=None):
    """The measured idle fraction against the number of micro-batches m: the median over the repeats
    (dots) with their range (bars), and GPipe's (p - 1) / (m + p - 1) as a curve.

    ``bubble`` is the ``"bubble"`` part of the lab's ``pp_lab.json``."""
    fig, ax = new_axes(ax, (6, 3.8))
    p, rows = bubble["stages"], [bubble["per_m"][str(m)] for m in bubble["micro_batches"]]
    ms = [r["m"] for r in rows]
    grid = [1 + i * (max(ms) - 1) / 200 for i in range(201)]
    ax.plot(grid, [(p - 1) / (m + p - 1) for m in grid], color="k", lw=1.2, label=f"(p - 1) / (m + p - 1), p = {p}")
    med = [statistics.median(r["idle"]) for r in rows]
    lo = [m - min(r["idle"]) for m, r in zip(med, rows)]
    hi = [max(r["idle"]) - m for m, r in zip(med, rows)]
    ax.errorbar(ms, med, yerr=[lo, hi], fmt="o", color="C3", capsize=4,
                label=f"measured: median, range over {bubble['repeats']} repeats")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m (same global batch)")
    ax.set_ylabel("idle fraction = 1 - busy / wall")
    ax.set_ylim(0, max(0.6, max(med[i] + hi[i] for i in range(len(ms))) + 0.05))
    ax.set_title("the pipeline bubble")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return finish(fig, ax)


def timeline(bubble: dict[str, Any], m: int, *, ax=None):
    """One measured step at ``m`` micro-batches (the repeat with the median idle fraction): each
    stage's forwards (F) and backwards (B) on a time axis from the common barrier; white is idle."""
    fig, ax = new_axes(ax, (7, 2.4))
    row = bubble["per_m"][str(m)]
    stages = row["timeline"]
    colours = {"F": "C0", "B": "C1"}
    for s, intervals in enumerate(stages):
        for kind, i, start, end in intervals:
            ax.barh(s, (end - start) * 1e3, left=start * 1e3, color=colours[kind], edgecolor="white", height=0.6)
            if (end - start) * 1e3 > 0.04 * max(e for iv in stages for *_, e in iv) * 1e3:
                ax.text((start + end) / 2 * 1e3, s, f"{kind}{i}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in range(len(stages))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's barrier")
    ax.set_title(f"GPipe, m = {m}: forwards (F), backwards (B); white = idle")
    ax.grid(axis="x", alpha=0.3)
    return finish(fig, ax)


def bubble(bubble: dict[str, Any], m: int):
    """Both figures side by side: :func:`bubble_vs_m` and the :func:`timeline` of one step at ``m``."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1, 1.4]})
    bubble_vs_m(bubble, ax=left)
    timeline(bubble, m, ax=right)
    fig.tight_layout()
    return fig
