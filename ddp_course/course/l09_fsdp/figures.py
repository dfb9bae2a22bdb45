"""Figures of lesson 09 (FSDP). Each takes the JSON report of ``ddp_course.course.l09_fsdp.fsdp_lab`` and returns a figure."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

PARTS = ("params", "grads", "optimizer", "activations")
COLOURS = {"params": "C0", "grads": "C1", "optimizer": "C2", "activations": "C7"}


def _worst_rank(variant: dict) -> dict:
    """The rank holding the most (measured states): the one that decides what fits."""
    return max(variant["per_rank"], key=lambda r: r["measured"]["states"])


def memory_bars(reports: list[dict], *, variants: list[str] | None = None, unit: float = 1024.0):
    """Per world size, per variant: predicted (hatched) next to measured bytes, stacked by part.

    Uses the rank that holds the most; ``unit`` divides the bytes (KiB by default).
    """
    fig, axes = plt.subplots(1, len(reports), figsize=(5.2 * len(reports), 4.2), squeeze=False, sharey=True)
    for ax, rep in zip(axes[0], reports):
        names = [v for v in (variants or rep["variants"]) if v in rep["variants"]]
        for i, name in enumerate(names):
            r = _worst_rank(rep["variants"][name])
            for j, (kind, hatch) in enumerate((("predicted", "///"), ("measured", None))):
                bottom = 0.0
                for part in PARTS:
                    h = r[kind][part] / unit
                    ax.bar(i + (j - 0.5) * 0.38, h, width=0.36, bottom=bottom, color=COLOURS[part], hatch=hatch,
                           edgecolor="white" if hatch else "none", alpha=0.55 if hatch else 1.0)
                    bottom += h
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{rep['world_size']} ranks")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("bytes on the fullest rank (KiB)" if unit == 1024 else f"bytes / {unit:g}")
    handles = [Patch(color=COLOURS[p], label=p) for p in PARTS]
    handles += [Patch(facecolor="lightgrey", hatch="///", edgecolor="white", label="predicted (left)"),
                Patch(facecolor="grey", label="measured (right)")]
    fig.suptitle("memory per rank: the calculator's prediction and the measurement")
    fig.tight_layout()
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=6, fontsize=8, frameon=False)
    return fig


def shard_rows(report: dict, name: str = "tok_emb.weight"):
    """How one parameter's rows are split over the ranks: real rows per rank, padding hatched."""
    ranks = report["shards"]["per_rank"]
    full = ranks[0][name]["full"]
    rest = math.prod(full[1:])
    fig, ax = plt.subplots(figsize=(7.5, 0.55 + 0.45 * len(ranks)))
    start = 0
    for r, shard in enumerate(ranks):
        rows, stored = shard[name]["local"][0], shard[name]["storage_numel"] // rest
        ax.barh(r, rows, left=start, color=f"C{r}", edgecolor="black")
        if stored > rows:
            ax.barh(r, stored - rows, left=start + rows, color="white", hatch="///", edgecolor=f"C{r}")
        ax.text(start + stored / 2, r, f"rows {start}..{start + rows - 1}" + (f" + {stored - rows} pad" if stored > rows
                else ""), ha="center", va="center", fontsize=8)
        start += rows
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.invert_yaxis()
    ax.set_xlabel(f"row of {name} {tuple(full)}")
    ax.set_title(f"{name} on {len(ranks)} ranks: chunks of ceil({full[0]}/{len(ranks)}) rows, the storage padded")
    fig.tight_layout()
    return fig


def _unit_of(name: str) -> str:
    if "(" in name and name.endswith(")"):
        return name[name.index("(") + 1:-1] or "root"
    if " for " in name:
        return name.split(" for ")[-1]
    return "root"


def _compute_spans(fsdp: list[dict]) -> list[tuple[str, str, float, float]]:
    """(unit, forward|backward, start, end): a block's compute, between FSDP's hooks around it."""
    def first(prefix: str, unit: str, after: float = -1.0):
        return next((s for s in fsdp if s["name"] == f"{prefix} ({unit})" and s["start_ms"] > after), None)

    out = []
    for unit in sorted({_unit_of(s["name"]) for s in fsdp} - {"root"}):
        pre, post = first("FSDP::pre_forward", unit), first("FSDP::post_forward", unit)
        if pre and post:
            out.append((unit, "forward", pre["start_ms"] + pre["dur_ms"], post["start_ms"]))
        pre = first("FSDP::pre_backward", unit)
        acc = first("FSDP::post_backward_accumulate", unit)
        if pre and acc:
            out.append((unit, "backward", pre["start_ms"] + pre["dur_ms"], acc["start_ms"]))
    return out


def step_timeline(trace: dict):
    """One FSDP2 step on rank 0, per unit: all-gathers, the block's forward and backward compute,
    reduce-scatters; and the backend's collectives underneath."""
    comm = {"FSDP::all_gather": ("all-gather", "C0"), "FSDP::post_backward_reduce": ("reduce-scatter", "C1")}
    spans = [s for s in trace["fsdp"] if s["name"].split(" (")[0] in comm]
    compute = _compute_spans(trace["fsdp"])
    units = sorted({_unit_of(s["name"]) for s in spans}, key=lambda u: (u != "root", u))
    lanes = units + ["gloo (backend)"]
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.5 * len(lanes)))
    for unit, phase, start, end in compute:
        ax.barh(lanes.index(unit), end - start, left=start, height=0.75, color="C2" if phase == "forward" else "C4",
                alpha=0.35)
    for s in spans:
        _, colour = comm[s["name"].split(" (")[0]]
        ax.barh(lanes.index(_unit_of(s["name"])), s["dur_ms"], left=s["start_ms"], height=0.4, color=colour)
    for s in trace["backend"]:
        ax.barh(len(lanes) - 1, s["dur_ms"], left=s["start_ms"], height=0.4,
                color="C0" if "gather" in s["name"] else "C1", edgecolor="black", lw=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step (rank 0)")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color="C0", label="all-gather"), Patch(color="C1", label="reduce-scatter"),
               Patch(color="C2", alpha=0.35, label="block forward"), Patch(color="C4", alpha=0.35,
                                                                              label="block backward")]
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4, frameon=False)
    ax.set_title("one FSDP2 training step: gather before use, reduce-scatter after backward")
    fig.tight_layout()
    return fig


def strategies(reports: list[dict], *, variants: list[str] | None = None):
    """Per world size: bytes of parameters + gradients + optimizer states on the fullest rank, and the step time."""
    fig, (ax_mem, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(reports)
    names = []
    for rep in reports:
        names += [v for v in (variants or rep["variants"]) if v in rep["variants"] and v not in names]
    for k, rep in enumerate(reports):
        xs, mem, t = [], [], []
        for i, name in enumerate(names):
            if name in rep["variants"]:
                v = rep["variants"][name]
                xs.append(i + (k - (len(reports) - 1) / 2) * width)
                mem.append(_worst_rank(v)["measured"]["states"] / 1024)
                t.append(v["step_time_s"] * 1e3)
        ax_mem.bar(xs, mem, width=width, color=f"C{k}", label=f"{rep['world_size']} ranks")
        ax_t.bar(xs, t, width=width, color=f"C{k}", label=f"{rep['world_size']} ranks")
    for ax, label in ((ax_mem, "params + grads + AdamW on the fullest rank (KiB)"), (ax_t, "median step time (ms)")):
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax_mem.set_title("what each rank holds")
    ax_t.set_title("what a step costs (CPU, gloo)")
    fig.tight_layout()
    return fig
