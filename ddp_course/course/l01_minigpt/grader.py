"""Grader of exercise 01 (``lessons/exercises/01_global_val_loss.py``)."""

from __future__ import annotations

from pathlib import Path

from ddp_course.check import Verdict, not_complete, results


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """global_mean must give every rank the mean over all windows (2 and 3 ranks)."""
    from ddp_course.launch import run

    for nproc in (2, 3):
        r = run(str(path), nproc=nproc, echo="none", progress=False, timeout=timeout, check=False)
        if "NotImplementedError" in r.output:
            return not_complete("global_mean()", path)
        found = results(r.output)
        if len(found) != nproc:
            tail = "\n".join(r.output.splitlines()[-15:])
            return Verdict(False, f"with {nproc} processes the script did not finish on every rank "
                                  f"(exit code {r.returncode}). Last lines:\n{tail}")
        bad = [x for x in found if not x["ok"]]
        if bad:
            x = bad[0]
            return Verdict(False, f"with {nproc} processes rank {x['rank']} got {x['result']:.6f} but the mean over "
                                  f"all windows is {x['reference']:.6f}. Are you averaging per-rank means? The ranks "
                                  "hold different numbers of windows: all-reduce the sums and the counts.")
    return Verdict(True, "every rank gets the mean over all windows, with 2 and with 3 processes.")
