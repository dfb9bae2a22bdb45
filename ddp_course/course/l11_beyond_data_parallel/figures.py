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


SLOT_COLOURS = {"F": "C0", "B": "C1", "I": "C3", "W": "C2"}


def schedule_timeline(slots: list[list[tuple]], *, title: str, ax=None, scale: float = 1e3):
    """One step of a schedule, a row per rank: each slot ``(kind, stage, micro-batch, start, end)`` as a
    bar coloured by kind (F forward, B backward, I input gradient, W weight gradient), labelled with
    its micro-batch where it is wide enough, paler for a rank's second stage; white is idle."""
    fig, ax = new_axes(ax, (7, 0.5 + 0.45 * len(slots)))
    several = any(len({s for _, s, *_ in rank}) > 1 for rank in slots)
    end_all = max(e for rank in slots for *_, e in rank)
    for r, rank in enumerate(slots):
        for kind, stage, i, start, end in rank:
            ax.barh(r, (end - start) * scale, left=start * scale, color=SLOT_COLOURS[kind], edgecolor="white",
                    height=0.7, alpha=1.0 if not several or stage < len(slots) else 0.6)
            if end - start > 0.025 * end_all:
                ax.text((start + end) / 2 * scale, r, f"{i}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(slots)), [f"rank {r}" for r in range(len(slots))])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return finish(fig, ax)


def schedules(lab: dict[str, Any], names: list[str], *, key: str = "timeline", unit: str = "ms"):
    """A panel per schedule of ``names`` (from ``schedules_lab.json``): ``key`` is ``timeline`` (the slots
    as the ranks ran them, on a common clock) or ``replayed_timeline`` (the same order and durations,
    with only the waits the data imposes). Paler bars: a rank's second stage."""
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.1 + 0.55 * lab["world_size"] * len(names)), sharex=False)
    axes = [axes] if len(names) == 1 else list(axes)
    for ax, name in zip(axes, names):
        s = lab["schedules"][name]
        idle = s["replayed_idle"] if key == "replayed_timeline" else statistics.median(s["measured_idle"])
        schedule_timeline(s[key], title=f"{name}: idle {idle:.0%}", ax=ax)
    axes[-1].set_xlabel(f"{unit} since the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SLOT_COLOURS.values()]
    fig.legend(handles, ["F forward", "B backward", "I input gradient", "W weight gradient"], loc="upper right",
               fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def held_over_step(lab: dict[str, Any], names: list[str]):
    """A panel per schedule of ``names`` (the ones written by hand, whose bytes the lab counted): the
    activations each stage holds after each of its slots, in micro-batches, a line per stage."""
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.2), sharey=True)
    axes = [axes] if len(names) == 1 else list(axes)
    for ax, name in zip(axes, names):
        for s, trace in lab["schedules"][name]["held_trace"].items():
            ax.step([k + 1 for k, _ in trace], [h for _, h in trace], where="post", label=f"stage {s}")
        ax.set_title(f"{name}: activations held, p = {lab['world_size']}, m = {lab['micro_batches']}", fontsize=9)
        ax.set_xlabel("the stage's slots (F or B), in order")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("micro-batches of activations")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    return fig
