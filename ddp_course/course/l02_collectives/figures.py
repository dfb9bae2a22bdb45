"""Figures for lesson 02: what each rank holds before and after a collective, the barrier's
timeline, the ring all-reduce's schedule, and the measured all-reduce curve.

The per-rank figures read the JSON that ``ddp_course.course.l02_collectives.collectives`` writes (one dict per rank).
Colour says where data came from: each rank has its own colour, grey-violet marks a value combined
from several ranks, and hatched cells are buffers the API leaves unspecified.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter

from ddp_course.course import plots

MIXED = "#b9a7d6"  # a value reduced over several ranks
MIXED_2 = "#d9c59a"  # ... over a second group of ranks (sub-groups)
EMPTY = "#f2f2f2"


def rank_colour(rank: int) -> tuple[float, float, float, float]:
    """A light version of matplotlib's C<rank> colour (text stays readable on it)."""
    import matplotlib.colors as mcolors

    r, g, b = mcolors.to_rgb(f"C{rank % 10}")
    return (0.55 * r + 0.45, 0.55 * g + 0.45, 0.55 * b + 0.45, 1.0)


def _find(per_rank: Sequence[dict], name: str) -> list[dict]:
    recs = []
    for res in sorted(per_rank, key=lambda d: d["rank"]):
        match = [c for c in res["collectives"] if c["name"] == name]
        if not match:
            names = ", ".join(c["name"] for c in res["collectives"])
            raise KeyError(f"no collective {name!r} in rank {res['rank']}'s results; there are: {names}")
        recs.append(match[0])
    return recs


def _colours(name: str, rank: int, side: str, n_values: int, chunk: int, rec: dict) -> list:
    """Colour of each cell of one rank's row: by origin of the data."""
    if side == "before":
        if name == "scatter":  # rank 0's pieces, coloured by the rank each is meant for
            return [rank_colour(i // chunk) for i in range(n_values)]
        return [rank_colour(rank)] * n_values
    if name in ("all_gather", "gather"):
        return [rank_colour(i // chunk) for i in range(n_values)]
    if name == "scatter":
        return [rank_colour(rank)] * n_values
    if name == "broadcast":
        return [rank_colour(0)] * n_values
    if name == "subgroup_all_reduce" and 0 not in rec.get("group_ranks", [0]):
        return [MIXED_2] * n_values  # reduced over the other group
    return [MIXED] * n_values  # reductions


def _grid(ax, rows: list[tuple[list[float] | None, list, str, bool]], width: int, chunk: int, title: str) -> None:
    """rows: (values or None, colours, label when empty, defined) per rank."""
    n = len(rows)
    for r, (vals, colours, empty_label, defined) in enumerate(rows):
        y = n - 1 - r
        if vals is None:
            ax.add_patch(Rectangle((0, y + 0.08), width, 0.84, facecolor=EMPTY, edgecolor="#cccccc"))
            ax.text(width / 2, y + 0.5, empty_label, ha="center", va="center", fontsize=8, color="#777777",
                    style="italic")
            continue
        for i, v in enumerate(vals):
            ax.add_patch(Rectangle((i, y + 0.08), 1, 0.84, facecolor=colours[i] if defined else EMPTY,
                                   edgecolor="white" if defined else "#bbbbbb", hatch=None if defined else "///",
                                   lw=1.0))
            ax.text(i + 0.5, y + 0.5, f"{v:g}", ha="center", va="center", fontsize=8,
                    color="black" if defined else "#888888")
        if chunk:
            for b in range(chunk, len(vals), chunk):
                ax.plot([b, b], [y + 0.04, y + 0.96], color="black", lw=1.6)
        if not defined:
            ax.text(len(vals) + 0.15, y + 0.5, "unspecified", va="center", fontsize=7, color="#888888",
                    style="italic")
    ax.set_xlim(0, width + (1.6 if any(not d for *_, d in rows) else 0))
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)
    ax.set_title(title, fontsize=9)


def collective(per_rank: Sequence[dict], name: str, *, title: str | None = None):
    """Before | after grids of one collective: one row per rank, one cell per element."""
    recs = _find(per_rank, name)
    chunk = recs[0].get("chunk", 0)
    width = max(max(len(r["before"] or []), len(r["after"] or [])) for r in recs)
    empty_before = {"scatter": "holds only an output buffer"}
    empty_after = {"gather": "receives nothing"}
    before = [(r["before"], _colours(name, k, "before", len(r["before"] or []), chunk, r),
               empty_before.get(name, "nothing"), True) for k, r in enumerate(recs)]
    after = [(r["after"], _colours(name, k, "after", len(r["after"] or []), chunk, r),
              empty_after.get(name, "nothing"), r.get("after_defined", True)) for k, r in enumerate(recs)]
    fig, axes = plt.subplots(1, 2, figsize=(1.2 + 0.42 * width * 2 + 1.2, 0.42 * len(recs) + 0.9),
                             gridspec_kw={"wspace": 0.25})
    _grid(axes[0], before, width, chunk, "before")
    _grid(axes[1], after, width, chunk, "after")
    fig.suptitle(title or recs[0]["call"], fontsize=10, family="monospace", y=1.0)
    fig.subplots_adjust(top=0.78, bottom=0.04, left=0.1, right=0.98)
    return fig


def barrier_timeline(per_rank: Sequence[dict], ax=None):
    """Each rank's 'work' (its delay) then its wait inside dist.barrier(); all leave together."""
    recs = _find(per_rank, "barrier")
    t0 = min(r["arrive"] - r["delay_s"] for r in recs)
    fig, ax = plots.new_axes(ax, (7, 0.45 * len(recs) + 1.2))
    n = len(recs)
    for k, r in enumerate(recs):
        y = n - 1 - k
        start, arrive, leave = r["arrive"] - r["delay_s"] - t0, r["arrive"] - t0, r["leave"] - t0
        ax.barh(y, arrive - start, left=start, color=rank_colour(k), edgecolor="none",
                label="working (sleep)" if k == n - 1 else None)
        ax.barh(y, leave - arrive, left=arrive, color="#dddddd", hatch="..", edgecolor="#999999",
                label="waiting in barrier()" if k == 0 else None)
    last = max(r["arrive"] for r in recs) - t0
    ax.axvline(last, color="black", ls="--", lw=1, label="last rank arrives")
    ax.set_yticks(range(n), [f"rank {k}" for k in reversed(range(n))])
    ax.set_xlabel("seconds since the first rank started its work")
    ax.set_title("dist.barrier(): nobody leaves before the last rank arrives", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return plots.finish(fig, ax)


def ring_schedule(n: int = 4):
    """Which ranks' contributions each chunk holds, on each rank, after every step of a ring all-reduce.

    Reduce-scatter: at step s rank r sends chunk (r - s) mod n to rank r + 1, which adds it into its
    own copy. All-gather: at step s rank r passes the finished chunk (r + 1 - s) mod n on.
    """
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[rank][chunk] = ranks summed in
    states = [("start: rank r holds only its own data", [[set(c) for c in row] for row in held], set())]
    for s in range(n - 1):
        sent = [(r, (r - s) % n, set(held[r][(r - s) % n])) for r in range(n)]
        changed = set()
        for r, c, contents in sent:
            held[(r + 1) % n][c] |= contents
            changed.add(((r + 1) % n, c))
        states.append((f"reduce-scatter step {s + 1}", [[set(c) for c in row] for row in held], changed))
    for s in range(n - 1):
        sent = [(r, (r + 1 - s) % n, set(held[r][(r + 1 - s) % n])) for r in range(n)]
        changed = set()
        for r, c, contents in sent:
            held[(r + 1) % n][c] = contents
            changed.add(((r + 1) % n, c))
        states.append((f"all-gather step {s + 1}", [[set(c) for c in row] for row in held], changed))

    cols = n  # one row of panels per phase (plus the start)
    fig, axes = plt.subplots(2, cols, figsize=(2.1 * cols, 2 * 0.4 * n + 1.5))
    panels = [states[0], *states[1:n]], [None, *states[n:]]
    for row, items in enumerate(panels):
        for col, item in enumerate(items):
            ax = axes[row][col]
            ax.axis("off")
            if item is None:
                continue
            label, grid, changed = item
            for r in range(n):
                for c in range(n):
                    full = len(grid[r][c]) == n
                    face = MIXED if full else (rank_colour(r) if grid[r][c] == {r} else "#e9e2f3")
                    ax.add_patch(Rectangle((c, n - 1 - r), 0.94, 0.9, facecolor=face,
                                           edgecolor="black" if (r, c) in changed else "white",
                                           lw=1.8 if (r, c) in changed else 0.5))
                    txt = "all" if full else "+".join(map(str, sorted(grid[r][c])))
                    ax.text(c + 0.47, n - 1 - r + 0.45, txt, ha="center", va="center", fontsize=7)
            ax.set_xlim(-0.9, n)
            ax.set_ylim(-0.6, n)
            for r in range(n):
                ax.text(-0.1, n - 1 - r + 0.45, f"r{r}", ha="right", va="center", fontsize=7)
            for c in range(n):
                ax.text(c + 0.47, -0.3, f"chunk {c}", ha="center", va="center", fontsize=6, color="#555555")
            ax.set_title(label, fontsize=8)
    fig.suptitle(f"ring all-reduce on {n} ranks: which ranks' data each chunk holds (outlined: just received)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _bytes_label(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:g} {unit}"
        b /= 1024
    return f"{b:g}"


def allreduce_curve(result: dict[str, Any]):
    """Time per all-reduce and algorithm / bus bandwidth against message size, one colour per world size."""
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, job in enumerate(result["jobs"]):
        n = job["world_size"]
        b = [r["bytes"] for r in job["rows"]]
        tag = f"{n} ranks ({job['backend']})" + (", oversubscribed" if job.get("oversubscribed") else "")
        ax_t.plot(b, [r["time_s"] * 1e6 for r in job["rows"]], "o-", color=f"C{i}", label=tag)
        ax_b.plot(b, [r["algbw_GBps"] for r in job["rows"]], "o--", color=f"C{i}", alpha=0.6,
                  label=f"algbw, {n} ranks")
        ax_b.plot(b, [r["busbw_GBps"] for r in job["rows"]], "o-", color=f"C{i}",
                  label=f"busbw = algbw x {job['bus_factor']:.2f}, {n} ranks")
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes_label(v)))
        ax.tick_params(axis="x", labelrotation=35, labelsize=8)
        ax.set_xlabel("message size per rank")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax_t.set_ylabel("time per all_reduce (µs)")
    ax_t.set_title("all_reduce time vs message size")
    ax_b.set_ylabel("GB/s")
    ax_b.set_title("algorithm and bus bandwidth")
    fig.tight_layout()
    return fig
