"""Figures of lesson 08 (checkpoints)."""

from __future__ import annotations

import matplotlib.pyplot as plt

LABELS = {"nothing": "everything restored", "rng": "RNG states not restored",
          "data": "data position not restored", "optimizer": "optimizer state not restored"}


def forgotten_parts(report: dict, *, title: str = "Resumed at step {k}: forget one part of the state"):
    """The ``ckpt_forget`` lab after the resume point, one column per variant: the losses of the resumed
    and the uninterrupted run (top), and their difference (bottom, zero only for a complete restore)."""
    k = report["resume_at"]
    ref = {int(s): v for s, v in report["uninterrupted"]["losses"].items()}
    variants = report["variants"]
    fig, axes = plt.subplots(2, len(variants), figsize=(2.8 * len(variants), 4.2), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1]})
    for ax in axes[0, 1:]:  # the losses share a scale; each difference gets its own (they span decades)
        ax.sharey(axes[0, 0])
    for i, (part, v) in enumerate(variants.items()):
        top, bottom = axes[0, i], axes[1, i]
        got = {int(s): x for s, x in v["losses"].items()}
        steps = sorted(ref)
        top.plot(steps, [ref[s] for s in steps], color="black", lw=2.2, alpha=0.35, label="uninterrupted")
        top.plot(steps, [got[s] for s in steps], color=f"C{i}", lw=1.2, ls="--", label="resumed")
        top.set_title(LABELS.get(part, part), fontsize=9)
        top.text(0.97, 0.95, "bit-identical" if v["identical"] else f"max |Δloss| {v['max_loss_diff']:.2g}",
                 transform=top.transAxes, ha="right", va="top", fontsize=8)
        bottom.axhline(0.0, color="black", lw=0.6, alpha=0.5)
        bottom.plot(steps, [got[s] - ref[s] for s in steps], color=f"C{i}", lw=1.2)
        bottom.set_xlabel("optimizer step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("training loss")
    axes[1, 0].set_ylabel("resumed − uninterrupted\n(own scale per panel)")
    axes[0, 0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title.format(k=k), fontsize=11)
    fig.tight_layout()
    return fig
