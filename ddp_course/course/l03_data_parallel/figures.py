"""Figures for lesson 03 (DataParallel): one DP step in time, bytes per replica, DP vs DDP per GPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

from ddp_course.course import plots

STAGE_COLOURS = {"scatter": "C7", "forward": "C0", "gather": "C1", "loss": "C3", "backward": "C9",
                 "reduce": "C4", "update": "C2", "broadcast": "C5"}


def step_timeline(report, *, title: str = "one DP step, stage by stage", ax=None):
    """A Gantt chart of a :class:`ddp_course.course.l03_data_parallel.dp_mechanism.StepReport`: one row per replica.

    The forward is drawn per replica from its thread's own start and end; the backward on every row
    (autograd walks every replica's graph); every other stage on replica 0's row, where it runs.
    """
    n = len(report.memory)
    fig, ax = plots.new_axes(ax, (8, 0.6 * n + 1.6))
    seen = set()
    for stage, replica, start, end in report.spans:
        rows = range(n) if stage == "backward" else [replica]
        for row in rows:
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.6, color=STAGE_COLOURS[stage],
                    label=None if stage in seen else stage, edgecolor="black", linewidth=0.3)
            seen.add(stage)
    ax.set_yticks(range(n), [f"replica {k}" + (" (device 0)" if k == 0 else "") for k in range(n)])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the step started")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3 if n < 4 else -0.2))
    return plots.finish(fig, ax)


def bytes_by_replica(memory: Sequence[Mapping[str, int]], *, title: str = "what each replica holds in one step",
                     unit: float = 2**20, unit_name: str = "MiB", fmt: str = "{:.2f}", ax=None):
    """Stacked bars: for each replica, the bytes of each kind of tensor it holds (from a StepReport)."""
    fig, ax = plots.new_axes(ax, (6.5, 3.6))
    kinds = list(memory[0])
    bottoms = [0.0] * len(memory)
    names = [f"replica {k}" for k in range(len(memory))]
    for i, kind in enumerate(kinds):
        vals = [m[kind] / unit for m in memory]
        ax.bar(names, vals, bottom=bottoms, label=kind, color=f"C{i}")
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, total in enumerate(bottoms):
        ax.annotate(fmt.format(total), (x, total), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(unit_name)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    return plots.finish(fig, ax)


def dp_vs_ddp(result: Mapping, *, axes=None):
    """Two panels from a dp_vs_ddp benchmark result: peak memory of each GPU, and tokens/s."""
    fig = None
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    n = result["gpus"]
    width = 0.38
    for j, kind in enumerate(("dp", "ddp")):
        mem = [result["runs"][kind]["peak_allocated_bytes"][str(i)] / 2**20 for i in range(n)]
        xs = [i + (j - 0.5) * width for i in range(n)]
        axes[0].bar(xs, mem, width, label=kind.upper(), color=f"C{j}")
    axes[0].set_xticks(range(n), [f"GPU {i}" for i in range(n)])
    axes[0].set_ylabel("peak allocated, MiB")
    axes[0].set_title("peak memory per GPU")
    axes[0].legend()
    axes[0].grid(axis="y", alpha=0.3)
    tps = {k.upper(): result["runs"][k]["tokens_per_s"] for k in ("dp", "ddp")}
    axes[1].bar(list(tps), list(tps.values()), color=["C0", "C1"])
    for i, v in enumerate(tps.values()):
        axes[1].annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=9)
    axes[1].set_ylabel("tokens / s")
    axes[1].set_title(f"throughput on {n} GPUs")
    axes[1].grid(axis="y", alpha=0.3)
    axes[1].margins(y=0.15)
    return plots.finish(fig, axes[0])
