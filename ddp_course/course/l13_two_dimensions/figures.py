"""Figures of lesson 13 (two, then three dimensions). Each takes plain data and returns the figure."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle


def three_d_mesh(lab: dict[str, Any]):
    """The ``(pp, dp, tp)`` mesh of the three-dimensional lab as one panel per pipeline stage: each
    rank a box at its ``(dp, tp)`` place, with the blocks it computes, the elements of the parameters it
    holds and its gradients' relative error against one process.

    ``lab``: the lab's ``three_d_lab.json``."""
    pp, dp, tp = lab["pp"], lab["dp"], lab["tp"]
    fig, axes = plt.subplots(1, pp, figsize=(3.3 * pp, 0.9 + 1.3 * dp), squeeze=False)
    for s, ax in enumerate(axes[0]):
        ranks = [r for r in lab["per_rank"] if r["coords"]["pp"] == s]
        first = ranks[0]
        parts = ["embeddings"] * first["first"] + [f"blocks {first['blocks'][0]}-{first['blocks'][1] - 1}"] + (
            ["head"] if first["last"] else [])
        for r in ranks:
            d, t = r["coords"]["dp"], r["coords"]["tp"]
            ax.add_patch(Rectangle((t, dp - 1 - d), 0.92, 0.88, facecolor=f"C{s}", alpha=0.25, edgecolor=f"C{s}"))
            ax.text(t + 0.46, dp - 1 - d + 0.44,
                    f"rank {r['rank']}\n{r['local_elements']:,} elements\ngrad err {r['grad_rel_err']:.0e}",
                    ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.05, tp)
        ax.set_ylim(-0.05, dp)
        ax.set_xticks([t + 0.46 for t in range(tp)], [f"tp {t}" for t in range(tp)])
        ax.set_yticks([dp - 1 - d + 0.44 for d in range(dp)], [f"dp {d}" for d in range(dp)])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"stage {s}: {' + '.join(parts)}", fontsize=9)
    fig.suptitle(f"{lab['world_size']} ranks as pp x dp x tp = {pp} x {dp} x {tp}", fontsize=10)
    fig.tight_layout()
    return fig
