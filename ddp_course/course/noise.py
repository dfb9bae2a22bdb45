"""How the lessons word a comparison of two noisy timings, so that the sentence follows the numbers.

A notebook that compares two times (or two speeds) prints each one's median *and* its range over the
repeats, then one of three verdicts: the first is faster, it is slower, or the ranges overlap and this
machine does not resolve a difference. "Faster" needs every repeat of one to beat every repeat of
the other: with a handful of repeats on a shared machine, that is the least the data can support.

Some measurements cannot be read at all: repeats of the same work that differ several-fold, or a
speed-up larger than the processes (or cores) that produced it. Something else had the machine, and
any verdict would describe that, not the code. :func:`disturbed` recognises both, and every verdict
here (:func:`compare`, :func:`sentence`, :func:`ranking`) then prints :data:`DISTURBED` with the reason
in its place. No committed notebook output may carry that line (the notebook tests check).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_course.bench import DISTURBED_SPAN
from ddp_course.bench import span as bench_span  # max / min of the repeats

UNRESOLVED = "no difference this machine resolves (the ranges overlap)"
DISTURBED = "disturbed run: rerun before reading it"
SPREAD_LIMIT = DISTURBED_SPAN  # the course's one threshold, justified beside it in ddp_course/bench.py
# n processes on c cores can at most do min(n, c) times the work of one: a median speed-up may exceed
# that bound by timer noise and cache effects, not by 10%.
SPEEDUP_SLACK = 1.1


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def disturbed(series: Mapping[str, Sequence[float]] | None = None, *, speedup: float | None = None,
              workers: int | None = None, cores: int | None = None) -> str | None:
    """None when the measurement can be read; else :data:`DISTURBED` and why.

    - ``series``: repeats of the same work under a name each (times or speeds); a series whose
      largest repeat is more than :data:`SPREAD_LIMIT` times its smallest is disturbed.
    - ``speedup`` with ``workers``: a speed-up of ``workers`` processes (or threads) over one that is
      above ``min(workers, cores)`` (``cores`` defaults to :func:`usable_cores`), with
      :data:`SPEEDUP_SLACK` for timer noise, is not possible on this machine.
    """
    reasons = []
    for name, xs in (series or {}).items():
        if xs and (span := bench_span(list(xs))) > SPREAD_LIMIT:
            reasons.append(f"the repeats of {name} span {span:.1f}x, where repeats of the same work "
                           f"stay within {SPREAD_LIMIT:g}x")
    if speedup is not None and workers is not None:
        cores = usable_cores() if cores is None else cores
        bound = min(workers, cores)
        if speedup > bound * SPEEDUP_SLACK:
            reasons.append(f"a {speedup:.2f}x speed-up from {workers} processes on {cores} cores, where at most "
                           f"{bound}x is possible")
    return f"{DISTURBED} ({'; '.join(reasons)})" if reasons else None


def stats(xs: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the repeats (at least one)."""
    if not xs:
        raise ValueError("stats() needs at least one repeat")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def compare(a: Sequence[float], b: Sequence[float], *, higher_is_faster: bool = False,
            workers: int | None = None, names: tuple[str, str] = ("a", "b")) -> dict[str, Any]:
    """``a`` against ``b``: ``ratio`` of medians (a / b), and ``verdict`` "faster", "slower" or UNRESOLVED,
    or the :func:`disturbed` line (``resolved`` False) when the repeats cannot be read.

    Times by default (lower is faster); speeds such as tokens/s with ``higher_is_faster=True``.
    ``workers``: ``a`` ran on that many processes and ``b`` on one, so its speed-up is bounded.
    """
    sa, sb = stats(a), stats(b)
    ratio = sa["median"] / sb["median"]
    speedup = ratio if higher_is_faster else 1 / ratio
    bad = disturbed(dict(zip(names, (a, b))), speedup=speedup if workers else None, workers=workers)
    if bad:
        return {"a": sa, "b": sb, "ratio": ratio, "verdict": bad, "resolved": False, "disturbed": True}
    if sa["max"] < sb["min"]:
        below = True
    elif sa["min"] > sb["max"]:
        below = False
    else:
        below = None
    verdict = UNRESOLVED if below is None else ("faster" if below != higher_is_faster else "slower")
    return {"a": sa, "b": sb, "ratio": ratio, "verdict": verdict, "resolved": below is not None,
            "disturbed": False}


def fmt(s: dict[str, float], unit: str = "ms", scale: float = 1.0, digits: int = 1) -> str:
    """'12.3 ms (11.9-13.0 over 5)': the median and the range of the repeats."""
    f = f"{{:,.{digits}f}}"
    return (f"{f.format(s['median'] * scale)} {unit} "
            f"({f.format(s['min'] * scale)}-{f.format(s['max'] * scale)} over {s['n']})")


def sentence(name_a: str, a: Sequence[float], name_b: str, b: Sequence[float], *, unit: str = "ms",
             scale: float = 1.0, digits: int = 1, higher_is_faster: bool = False, workers: int | None = None) -> str:
    """One line: both medians with their ranges, the ratio, and the verdict (or why there is none)."""
    c = compare(a, b, higher_is_faster=higher_is_faster, workers=workers, names=(name_a, name_b))
    return (f"{name_a} {fmt(c['a'], unit, scale, digits)} vs {name_b} {fmt(c['b'], unit, scale, digits)}: "
            f"{c['ratio']:.2f}x, " + (f"{name_a} {c['verdict']}" if c["resolved"] else c["verdict"]))


def ranking(named: Mapping[str, Sequence[float]], *, unit: str = "ms", scale: float = 1.0, digits: int = 1,
            higher_is_faster: bool = False) -> dict[str, Any]:
    """The best of several configurations, named only when this machine resolves it.

    ``best`` has the best median; ``resolved`` when every repeat of it beats every repeat of each
    other one; ``tied``: the others whose ranges overlap its own. ``verdict`` is the line to print.
    """
    if len(named) < 2:
        raise ValueError("ranking() needs at least two configurations")
    s = {k: stats(v) for k, v in named.items()}
    sign = -1.0 if higher_is_faster else 1.0
    best = min(s, key=lambda k: sign * s[k]["median"])
    tied = [k for k in s if k != best and compare(named[best], named[k], higher_is_faster=higher_is_faster)["verdict"]
            != "faster"]
    bad = disturbed(named)
    if bad:
        verdict = bad
    elif tied:
        others = tied[0] if len(tied) == 1 else f"{', '.join(tied[:-1])} and {tied[-1]}"
        verdict = (f"best median: {best}, {fmt(s[best], unit, scale, digits)}; its range overlaps "
                   f"{'that' if len(tied) == 1 else 'those'} of {others}: no difference this machine resolves "
                   f"between them")
    else:
        verdict = (f"fastest: {best}, {fmt(s[best], unit, scale, digits)}, every repeat ahead of every repeat "
                   f"of the others")
    return {"best": best, "resolved": not tied and not bad, "tied": tied, "verdict": verdict, "stats": s,
            "disturbed": bool(bad)}
