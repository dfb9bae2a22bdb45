"""Grader of exercise 02 (``lessons/exercises/02_ring_allreduce.py``): a ring all-reduce by hand.

Runs the script for real with torchrun on 2 and on 4 processes. Each rank prints one ``RESULT``
line: per message size, whether each chunk equals ``dist.all_reduce``'s, the sums of its input and
output, and how many messages and elements it sent through ``ring.exchange``. The grader checks
the values (the script's own comparison, and independently that every rank's output sums to the
sum of all ranks' inputs) and the traffic (2 (n - 1) messages of about N / n elements), and says
what the pattern of wrong chunks points to.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddp_course.check import Verdict, run_exercise

EXERCISE = "02_ring_allreduce.py"  # the script this grades: lessons/exercises/02_ring_allreduce.py
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): which chunk a
# rank sends, adds into and receives at step s (the indices), and which chunk it finishes.
GIVEAWAYS = ("(r - s) % n", "(r - s - 1) % n", "(r + 1 - s) % n", "(r - s) mod n", "(r - s - 1) mod n",
             "chunk (r + 1) % n", "chunk (r + 1) mod n")

WORLD_SIZES = (2, 4)


def _tail(output: str, n: int = 10) -> str:
    """The end of the first failing rank's traceback (torch prefixes its lines ``[rankN]:``), else the output's."""
    lines = output.splitlines()
    by_rank: dict[int, list[str]] = {}
    for line in lines:
        m = re.match(r"^\[rank(\d+)\]:(.*)$", line)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append(m.group(2))
    if by_rank:
        rank = min(by_rank)
        return f"Rank {rank}'s traceback ends:\n" + "\n".join(by_rank[rank][-n:])
    return "Last lines of the output:\n" + "\n".join(lines[-n:])


def _crash_hint(output: str) -> str:
    if "Timed out" in output or "timed out" in output:
        return (" A rank waited for a message that never came (the process-group timeout fired): every rank "
                "must call ring.exchange the same number of times, n - 1 per phase.")
    if "doesn't match expected size" in output or "size mismatch" in output.lower():
        return (" A rank received a chunk of a different size than it expected: at each step, the chunk rank r "
                "sends must be the chunk its right-hand neighbour receives into (same index, same length).")
    return ""


def _wrong_values(n: int, rows: list[dict], size: dict) -> str:
    """Explain the pattern of wrong chunks for one message size (``rows``: one RESULT per rank)."""
    s = size["size"]
    per_rank = {row["rank"]: next(x for x in row["results"] if x["size"] == s) for row in rows}
    good = {r: [i for i, ok in enumerate(x["chunks_ok"]) if ok] for r, x in per_rank.items()}
    bad_rank = min(r for r, x in per_rank.items() if not x["values_ok"])
    x = per_rank[bad_rank]
    head = (f"with {n} processes and a message of {s} elements, rank {bad_rank}'s result differs from "
            f"dist.all_reduce by up to {x['max_err']:.3g} (chunks right: {good[bad_rank] or 'none'} of 0..{n - 1}).")
    n_nonempty = min(n, s)
    # Chunks cut with s // n leave the last s % n elements out of the ring: only sizes that do not
    # divide by n go wrong, and on every rank alike -- checked first, since it too can leave each rank
    # one right chunk (the same one on every rank, where a missing all-gather leaves a different one).
    divisible = [y["size"] for y in rows[0]["results"] if y["size"] % n == 0]
    if all(y["values_ok"] for y in rows[0]["results"] if y["size"] in divisible) and s % n:
        return (head + f" Sizes that divide by {n} are right and this one ({s}) is not: the last {s % n} "
                       f"element(s) never went round the ring. Cut the chunks with x.tensor_split(n), which "
                       "allows lengths that differ by one (and empty chunks), not with a length of size // n.")
    distinct = len({tuple(g) for g in good.values()}) == len(good)
    if all(len(g) == 1 for r, g in good.items()) and n_nonempty == n and distinct:
        return (head + " Every rank holds exactly one fully summed chunk, a different one on each rank -- that is "
                       "where the reduce-scatter phase ends. The all-gather phase is missing, or it does not "
                       "write what it receives into x.")
    return (head + " Check the indices: in reduce-scatter, the chunk a rank adds into at step s is the one its "
                   "left-hand neighbour sent at step s; in all-gather, a rank passes on the chunk it has just "
                   "completed. Work the indices out by hand for n = 3.")


def grade(path: str | Path, timeout: float = 120) -> Verdict:
    """The ring all-reduce must equal dist.all_reduce on every size, with 2 and 4 processes, and send
    2 (n - 1) chunks per rank."""
    traffic = []
    for n in WORLD_SIZES:
        rows = run_exercise(path, n, "ring_all_reduce()", timeout, hint=_crash_hint,
                            tail=lambda output: "\n" + _tail(output))
        if isinstance(rows, Verdict):
            return rows
        rows.sort(key=lambda row: row["rank"])
        sizes = rows[0]["results"]
        for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]["size"]):  # the largest shows patterns best
            size = sizes[k]
            if not all(row["results"][k]["values_ok"] for row in rows):
                return Verdict(False, _wrong_values(n, rows, size))
            # Independent of the script's own comparison: the output must sum to the sum of all inputs.
            # Float32 rounding of sums of n ~unit terms is ~1e-7 relative per element; 1e-5 of the total
            # magnitude is far above that and far below one missing chunk (a sum of ~N/n unit terms).
            total_in = sum(row["results"][k]["in_sum"] for row in rows)
            tol = 1e-5 * sum(row["results"][k]["in_abs"] for row in rows) + 1e-6
            off = [row["rank"] for row in rows if abs(row["results"][k]["out_sum"] - total_in) > tol]
            if off:
                return Verdict(False, f"with {n} processes and {size['size']} elements, rank {off[0]}'s output sums "
                                      f"to {rows[off[0]]['results'][k]['out_sum']:.6g} but all inputs together sum "
                                      f"to {total_in:.6g}: the result is not the sum over ranks.")
        silent = [row["rank"] for row in rows if all(x["sent"] == 0 for x in row["results"])]
        if silent:
            return Verdict(False, f"the values are right, but with {n} processes rank {silent[0]} sent nothing "
                                  "through ring.exchange: build the result from exchange() calls, not from a "
                                  "torch.distributed collective.")
        for row in rows:
            for x in row["results"]:
                if not x["traffic_ok"]:
                    lo, hi = x["sent_bounds"]
                    return Verdict(False, f"the values are right, but with {n} processes and {x['size']} elements "
                                          f"rank {row['rank']} made {x['messages']} exchange() calls sending "
                                          f"{x['sent']} elements; a ring all-reduce makes 2(n-1) = {2 * (n - 1)} "
                                          f"calls of one chunk each ({lo}..{hi} elements in all). Send one chunk "
                                          "per step, not the whole tensor.")
        big = rows[0]["results"][-1]
        traffic.append(f"{big['sent'] / big['size']:.2f}x with {n} ranks (2(n-1)/n = {2 * (n - 1) / n:.2f})")
    return Verdict(True, f"your ring all-reduce equals dist.all_reduce on sizes "
                         f"{', '.join(str(x['size']) for x in sizes)} with {' and '.join(map(str, WORLD_SIZES))} "
                         f"processes; for {big['size']} elements each rank sent {' and '.join(traffic)} the message.")
