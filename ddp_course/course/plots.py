"""The figures the notebooks draw. Each takes finished runs (or plain numbers) and returns the figure."""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt


def new_axes(ax, figsize: tuple[float, float]):
    """``(None, ax)`` for the axes a caller passed in, else ``(fig, ax)``: a new figure of ``figsize``
    with one axes. Every figure function takes an optional ``ax``, to draw into a grid of panels."""
    if ax is not None:
        return None, ax
    return plt.subplots(figsize=figsize)


def finish(fig, ax):
    """The figure to return: ``fig`` laid out tightly when this function made it, else ``ax``'s own."""
    if fig is not None:
        fig.tight_layout()
    return fig or ax.figure


def _label_runs(runs) -> dict:
    if isinstance(runs, Mapping):
        return dict(runs)
    return {f"{r.overrides.get('strategy', r.module)} x{r.nproc}": r for r in runs}


def loss_curves(runs, *, val: bool = True, title: str = "Loss", ax=None, logy: bool = False):
    """Training loss (solid) and validation loss (dots) against the optimizer step, one colour per run."""
    runs = _label_runs(runs)
    fig, ax = new_axes(ax, (7, 4))
    for i, (label, run) in enumerate(runs.items()):
        colour = f"C{i}"
        steps, loss = run.series("loss")
        ax.plot(steps, loss, color=colour, label=f"{label} train", lw=1.6,
                ls="-" if i % 2 == 0 else "--")
        if val:
            vs, vl = run.series("val_loss")
            if vs:
                ax.plot(vs, vl, "o", color=colour, ms=5, label=f"{label} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / char)")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return finish(fig, ax)


def bars(values: Mapping[str, float], *, ylabel: str, title: str = "", ax=None, fmt: str = "{:,.0f}"):
    """One bar per entry, its value written on top."""
    fig, ax = new_axes(ax, (6, 3.5))
    names, vals = list(values), list(values.values())
    rects = ax.bar(names, vals, color=[f"C{i}" for i in range(len(vals))])
    for rect, v in zip(rects, vals):
        ax.annotate(fmt.format(v), (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.margins(y=0.15)
    return finish(fig, ax)


def throughput(runs, *, title: str = "Training throughput", ax=None):
    """Steady-state tokens/s of each run (from its summary.json)."""
    runs = _label_runs(runs)
    return bars({k: r.summary["tokens_per_s"] for k, r in runs.items()}, ylabel="tokens / s", title=title, ax=ax)
