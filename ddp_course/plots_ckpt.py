"""Figures of lesson 08 (checkpoints)."""

from __future__ import annotations

import matplotlib.pyplot as plt

LABELS = {"nothing": "everything restored", "rng": "RNG states not restored",
          "data": "data position not restored", "optimizer": "optimizer state not restored"}


def forgotten_parts(report: dict, *, title: str = "Resumed at step {k}: forget one part of the state"):
    """The ``ckpt_forget`` lab's losses after the resume point: the uninterrupted run, then one panel per variant."""
    k = report["resume_at"]
    ref = {int(s): v for s, v in report["uninterrupted"]["losses"].items()}
    variants = report["variants"]
    fig, axes = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 3.0), sharey=True)
    for i, (ax, (part, v)) in enumerate(zip(axes, variants.items())):
        got = {int(s): x for s, x in v["losses"].items()}
        ax.plot(list(ref), list(ref.values()), color="black", lw=2.2, alpha=0.35, label="uninterrupted")
        ax.plot(list(got), list(got.values()), color=f"C{i}", lw=1.2, ls="--", label="resumed")
        ax.set_title(LABELS.get(part, part), fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.text(0.97, 0.95, "bit-identical" if v["identical"] else f"max |Δloss| {v['max_loss_diff']:.2g}",
                transform=ax.transAxes, ha="right", va="top", fontsize=8)
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title.format(k=k), fontsize=11)
    fig.tight_layout()
    return fig
