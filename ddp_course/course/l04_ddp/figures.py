"""Figures of lesson 04 (DDP): equivalence with one process, what breaks it, epoch orders."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np


def equivalence(ddp_losses: Sequence[float], single_losses: Sequence[float], *, labels=("DDP, 2 ranks",
                "1 process, concatenated batch"), title: str = "DDP vs one process"):
    """Left: both loss curves on one axis. Right: their absolute difference per step (log scale)."""
    steps = np.arange(1, len(ddp_losses) + 1)
    a, b = np.asarray(ddp_losses, dtype=float), np.asarray(single_losses, dtype=float)
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(steps, b, color="C1", lw=4, alpha=0.45, label=labels[1])
    ax.plot(steps, a, color="C0", lw=1.4, ls="--", label=labels[0])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    diff = np.abs(a - b)
    shown = np.where(diff > 0, diff, np.nan)  # an exact 0 has no place on a log axis
    ax_d.semilogy(steps, shown, "o", ms=4, color="C2")
    ax_d.set_xlabel("optimizer step")
    ax_d.set_ylabel("|loss difference|")
    ax_d.set_title(f"largest {diff.max():.1e} (exact zeros not drawn)", fontsize=9)
    ax_d.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def breakers(losses: Mapping[str, Sequence[float]], reference: Sequence[float], param_diff: Mapping[str, float],
             *, tolerance: float, title: str = "What breaks the equivalence"):
    """Left: each variant's loss curve against the reference. Right: each variant's largest final
    parameter difference from the reference (log scale), with the tolerance as a line."""
    fig, (ax, ax_b) = plt.subplots(1, 2, figsize=(10.5, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    steps = np.arange(1, len(reference) + 1)
    ax.plot(steps, reference, color="black", lw=3.5, alpha=0.35, label="1 process (reference)")
    for i, (name, ls) in enumerate(losses.items()):
        ax.plot(np.arange(1, len(ls) + 1), ls, lw=1.2, color=f"C{i}", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    names = list(param_diff)
    vals = [max(param_diff[n], 1e-12) for n in names]
    colours = ["C2" if v <= tolerance else "C3" for v in vals]
    ax_b.barh(names, vals, color=colours)
    ax_b.set_xscale("log")
    ax_b.axvline(tolerance, color="black", ls=":", lw=1.2, label=f"tolerance {tolerance:.0e}")
    for y, v in enumerate(vals):
        ax_b.annotate(f"{v:.1e}", (v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax_b.invert_yaxis()
    ax_b.set_xlim(min(vals) / 10, max(vals) * 30)
    ax_b.set_xlabel("largest |final parameter difference|")
    ax_b.set_title("final weights vs the reference", fontsize=10)
    ax_b.legend(fontsize=8, loc="upper right")
    ax_b.grid(alpha=0.3, axis="x", which="both")
    fig.tight_layout()
    return fig


def epoch_orders(orders: Mapping[str, Sequence[Sequence[int]]], *, title: str = "Which window, when (rank 0)"):
    """One panel per run: row e is the order in which rank 0 visited its windows in epoch e (colour =
    window index). Identical rows = the same order every epoch."""
    fig, axes = plt.subplots(1, len(orders), figsize=(5.2 * len(orders), 2.8), squeeze=False, layout="constrained")
    vmax = max(max(max(row) for row in rows) for rows in orders.values())
    for ax, (name, rows) in zip(axes[0], orders.items()):
        im = ax.imshow(np.asarray(rows), aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_yticks(range(len(rows)), [f"epoch {e}" for e in range(len(rows))])
        ax.tick_params(axis="y", length=0)
        ax.set_xlabel("position in the epoch")
        ax.set_title(name, fontsize=10)
    fig.colorbar(im, ax=axes[0].tolist(), label="window index", fraction=0.03)
    fig.suptitle(title, fontsize=11)
    return fig


def adamw_steps(result: Mapping, *, highlight: Mapping[str, tuple] | None = None,
                title: str = "One AdamW step against the gradient, every weight of the model"):
    """Each weight's first AdamW step (in units of lr) against its |gradient|, log-log, with AdamW's
    formula |g| / (|g| + eps) and SGD's |g| as lines; ``highlight`` maps a label to ``(|g|, |step|)``
    of a group of weights drawn on top (the key biases, say)."""
    g, step, lr, eps = result["grad"].numpy(), result["step"].numpy() / result["lr"], result["lr"], result["eps"]
    keep = g > 0
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.loglog(g[keep], step[keep], ".", ms=2, alpha=0.25, color="C0", label="a weight of the model")
    for i, (label, (hg, hs)) in enumerate((highlight or {}).items()):
        ax.loglog(hg.numpy(), hs.numpy() / lr, "o", ms=4, mfc="none", color=f"C{i + 3}", label=label)
    line = np.logspace(np.log10(g[keep].min()) - 0.5, np.log10(g.max()) + 0.5, 200)
    ax.loglog(line, line / (line + eps), color="C1", lw=1.5, label="AdamW: |g| / (|g| + eps)")
    ax.loglog(line, line, color="C2", lw=1.2, ls="--", label="SGD: |g|")
    ax.axvline(eps, color="0.5", lw=0.8, ls=":")
    ax.text(eps, ax.get_ylim()[0] * 3, " eps", color="0.4", fontsize=8)
    ax.set_xlabel("|gradient| of the weight")
    ax.set_ylabel("|step| / lr")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
