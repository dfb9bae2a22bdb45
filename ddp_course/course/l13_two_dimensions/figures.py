"""Figures of lesson 13 (two, then three dimensions). Each takes plain data and returns the figure."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle


def three_d_mesh(lab: dict[str, Any], variant: str = "by_hand"):
    """The ``(pp, dp, tp)`` mesh of the three-dimensional lab: one row per ``(dp, tp)`` coordinate, one
    column per pipeline stage, each rank a box with the elements of the parameters it holds. Arrows:
    what travels between stages (activations forward, their gradients back, between the ranks of one
    row); dashed: the tied matrix's gradient, summed between the first and the last stage of a row.

    ``lab``: the lab's ``three_d_lab.json``; ``variant``: whose figures to show (the layout is the same)."""
    pp, dp, tp = lab["pp"], lab["dp"], lab["tp"]
    ranks = lab["variants"][variant]["per_rank"]
    rows = dp * tp
    fig, ax = plt.subplots(figsize=(2.6 * pp + 1.2, 0.75 * rows + 1.2))
    width, gap = 1.6, 1.1
    for r in ranks:
        c = r["coords"]
        row = rows - 1 - (c["dp"] * tp + c["tp"])
        x = c["pp"] * (width + gap)
        ax.add_patch(Rectangle((x, row + 0.1), width, 0.8, facecolor=f"C{c['dp']}", alpha=0.25, edgecolor=f"C{c['dp']}"))
        ax.text(x + width / 2, row + 0.5, f"rank {r['rank']}\n{r['local_elements']:,} elements", ha="center",
                va="center", fontsize=8)
        if c["pp"] < pp - 1:
            ax.add_patch(FancyArrowPatch((x + width, row + 0.62), (x + width + gap, row + 0.62), arrowstyle="-|>",
                                         mutation_scale=10, color="k", lw=0.8))
            ax.add_patch(FancyArrowPatch((x + width + gap, row + 0.38), (x + width, row + 0.38), arrowstyle="-|>",
                                         mutation_scale=10, color="0.5", lw=0.8))
        if c["pp"] == 0:
            end = (pp - 1) * (width + gap) + width / 2
            ax.add_patch(FancyArrowPatch((x + width / 2, row + 0.95), (end, row + 0.95), arrowstyle="<->",
                                         mutation_scale=7, linestyle="--", color="C3", lw=0.8))
    for s in range(pp):
        first = next(r for r in ranks if r["coords"]["pp"] == s)
        parts = ["embeddings"] * first["first"] + [f"blocks {first['blocks'][0]}-{first['blocks'][1] - 1}"] + (
            ["head"] if first["last"] else [])
        ax.text(s * (width + gap) + width / 2, rows + 0.35, f"stage {s}\n{' + '.join(parts)}", ha="center", fontsize=8)
    ax.set_yticks([rows - 1 - i + 0.5 for i in range(rows)], [f"dp {i // tp}, tp {i % tp}" for i in range(rows)])
    ax.set_xticks([])
    ax.set_xlim(-0.1, pp * (width + gap) - gap + 0.1)
    ax.set_ylim(0, rows + 0.9)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.tick_params(length=0)
    ax.set_title(f"{lab['world_size']} ranks as pp x dp x tp = {pp} x {dp} x {tp}: black, activations forward; "
                 "grey, their gradients back;\nred dashed, the tied matrix's gradient summed", fontsize=9)
    fig.tight_layout()
    return fig
