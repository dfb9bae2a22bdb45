"""How the lessons word a comparison of two noisy timings, so that the sentence follows the numbers.

A notebook that compares two times (or two speeds) prints each one's median *and* its range over the
repeats, then one of three verdicts: the first is faster, it is slower, or the ranges overlap and this
machine does not resolve a difference. "Faster" needs every repeat of one to beat every repeat of
the other: with a handful of repeats on a shared machine, that is the least the data can support.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

UNRESOLVED = "no difference this machine resolves (the ranges overlap)"


def stats(xs: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the repeats (at least one)."""
    if not xs:
        raise ValueError("stats() needs at least one repeat")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def compare(a: Sequence[float], b: Sequence[float], *, higher_is_faster: bool = False) -> dict[str, Any]:
    """``a`` against ``b``: ``ratio`` of medians (a / b), and ``verdict`` "faster", "slower" or UNRESOLVED.

    Times by default (lower is faster); speeds such as tokens/s with ``higher_is_faster=True``.
    """
    sa, sb = stats(a), stats(b)
    if sa["max"] < sb["min"]:
        below = True
    elif sa["min"] > sb["max"]:
        below = False
    else:
        below = None
    verdict = UNRESOLVED if below is None else ("faster" if below != higher_is_faster else "slower")
    return {"a": sa, "b": sb, "ratio": sa["median"] / sb["median"], "verdict": verdict,
            "resolved": below is not None}


def fmt(s: dict[str, float], unit: str = "ms", scale: float = 1.0, digits: int = 1) -> str:
    """'12.3 ms (11.9-13.0 over 5)': the median and the range of the repeats."""
    f = f"{{:,.{digits}f}}"
    return (f"{f.format(s['median'] * scale)} {unit} "
            f"({f.format(s['min'] * scale)}-{f.format(s['max'] * scale)} over {s['n']})")


def sentence(name_a: str, a: Sequence[float], name_b: str, b: Sequence[float], *, unit: str = "ms",
             scale: float = 1.0, digits: int = 1, higher_is_faster: bool = False) -> str:
    """One line: both medians with their ranges, the ratio, and the verdict."""
    c = compare(a, b, higher_is_faster=higher_is_faster)
    return (f"{name_a} {fmt(c['a'], unit, scale, digits)} vs {name_b} {fmt(c['b'], unit, scale, digits)}: "
            f"{c['ratio']:.2f}x, " + (f"{name_a} {c['verdict']}" if c["resolved"] else c["verdict"]))
