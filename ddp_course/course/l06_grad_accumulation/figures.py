"""Figures of lesson 06 (gradient accumulation and no_sync). Each returns the matplotlib figure."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt


def lab_summary(lab: dict[str, Any]):
    """Left: all-reduces per optimizer step of each variant (full steps of K micro-batches).
    Right: each variant's worst gradient error against one big batch (log scale), with the tolerance.

    Green bars: the gradient matches one big batch on every optimizer step; red: it does not.
    ``lab`` is the ``no_sync_lab.json`` the lab writes.
    """
    names = list(lab["variants"])
    k = lab["k"]
    full = [v["steps"][0] for v in lab["variants"].values()]  # the first step has K micro-batches
    rounds = [s["all_reduce_rounds"] for s in full]
    worst = [max(s["rel_err"] for s in v["steps"]) for v in lab["variants"].values()]
    ok = [all(s["matches_big_batch"] for s in v["steps"]) for v in lab["variants"].values()]
    colours = ["tab:green" if good else "tab:red" for good in ok]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    bars = ax1.bar(names, rounds, color=colours)
    for rect, v in zip(bars, rounds):
        ax1.annotate(f"{v:g}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center", va="bottom")
    ax1.axhline(1, color="k", lw=0.8, ls=":")
    ax1.set_ylabel(f"all-reduces per optimizer step (K = {k})")
    ax1.set_title("communication")
    ax1.margins(y=0.15)

    floor = 1e-9  # an exact zero would vanish on the log axis
    bars = ax2.bar(names, [max(w, floor) for w in worst], color=colours)
    for rect, v in zip(bars, worst):
        ax2.annotate(f"{v:.0e}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                     va="bottom", fontsize=8)
    ax2.axhline(lab["grad_rtol"], color="k", lw=0.8, ls="--", label=f"tolerance {lab['grad_rtol']:g}")
    ax2.set_yscale("log")
    ax2.set_ylim(floor, 10)
    ax2.set_ylabel("relative error (worst step)")
    ax2.set_title("gradient vs one big batch")
    ax2.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{lab['world_size']} ranks: green = same gradient as one big batch, red = wrong gradient")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def step_times(result: dict[str, Any]):
    """Left: optimizer-step time against K, with (solid) and without (dashed) no_sync, per world size.
    Right: the time no_sync saved per optimizer step, with the dotted prediction (K - 1) x one
    measured all-reduce of the whole gradient.

    ``result`` is what ``ddp_course.course.l06_grad_accumulation.bench_no_sync`` returns (or writes to no_sync.json).
    """
    jobs = result["jobs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, job in enumerate(jobs):
        colour = f"C{i}"
        ks = [r["k"] for r in job["rows"]]
        label = f"{job['world_size']} process(es)" + (" (oversubscribed)" if job.get("oversubscribed") else "")
        ax1.plot(ks, [r["sync_s"] * 1e3 for r in job["rows"]], "o--", color=colour,
                 label=f"{label}, without no_sync")
        ax1.plot(ks, [r["no_sync_s"] * 1e3 for r in job["rows"]], "o-", color=colour, label=f"{label}, with no_sync")
        ax2.plot(ks, [r["saved_s"] * 1e3 for r in job["rows"]], "o-", color=colour, label=f"{label}: measured")
        ax2.plot(ks, [r["predicted_saved_s"] * 1e3 for r in job["rows"]], ":", color=colour,
                 label=f"{label}: (K-1) x one all-reduce ({job['allreduce_s'] * 1e3:.2f} ms)")
    for ax in (ax1, ax2):
        ks = [r["k"] for r in jobs[0]["rows"]]
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks)
        ax.set_xticklabels([str(k) for k in ks])
        ax.set_xlabel("K (micro-batches per optimizer step)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("ms per optimizer step (median)")
    ax1.set_title("step time")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_ylabel("ms saved per optimizer step")
    ax2.set_title("what no_sync saves")
    backend = {j["backend"] + " on " + j["device"] for j in jobs}
    fig.suptitle(f"train_step with and without no_sync ({', '.join(sorted(backend))})")
    fig.tight_layout()
    return fig
