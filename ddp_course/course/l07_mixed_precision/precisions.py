"""The same training once per precision, one run after the other, in one process.

    python -m ddp_course.course.l07_mixed_precision.precisions --precisions=fp32,bf16,fp16 --out_dir=runs/07 --max_steps=60

Each run is the course's training loop, ``ddp_course.train.main``, with the ``ddp_course.train``
flags given here, ``--precision`` set in turn to each of ``--precisions`` and ``--out_dir`` to
``<out_dir>/<precision>``. Every run builds its own model, optimizer, scaler and data from ``--seed``,
so each folder holds what ``python -m ddp_course.train --precision=P --out_dir=<out_dir>/P ...``
would write there (``config.json``, ``metrics.jsonl``, ``summary.json``), with the same losses: the
runs share nothing but the process, which starts Python and torch once instead of once per
precision. One-process strategies only (``single``); under DDP it is one torchrun job per precision.

Sharing the process has one visible effect: on a CPU the peak memory in each ``summary.json`` is the
process's peak resident set *so far* (it cannot be reset between runs), not the run's own. Lesson 07
compares memory with ``python -m ddp_course.bench amp``, which measures each precision in a fresh
process.

``runs(job, precisions)`` turns the finished job into one ``ddp_course.launch.Run`` per precision.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ddp_course import parallel
from ddp_course.cli import FlagError, command
from ddp_course.config import PRECISIONS, parse_cli
from ddp_course.data import CorpusError
from ddp_course.dist import DeviceError
from ddp_course.launch import TRAIN_MODULE, Run
from ddp_course.train import main as train_main

PROG = "python -m ddp_course.course.l07_mixed_precision.precisions"
DEFAULT_PRECISIONS = "fp32,bf16,fp16"


def split_precisions(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the precisions of ``--precisions=a,b``, the other arguments: ``ddp_course.train`` flags)."""
    given = [a for a in argv if a.startswith("--precisions=")]
    rest = [a for a in argv if not a.startswith("--precisions=")]
    if len(given) > 1:
        raise FlagError(f"{PROG}: --precisions is given twice.")
    value = given[0].split("=", 1)[1] if given else DEFAULT_PRECISIONS
    names = [p.strip() for p in value.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISIONS]
    if bad or not names or len(set(names)) != len(names):
        raise FlagError(f"{PROG}: --precisions must list each of {', '.join(PRECISIONS)} at most once, "
                        f"comma-separated (got {value!r}), e.g. --precisions=fp32,bf16.")
    if any(a.startswith("--precision=") or a == "--precision" for a in rest):
        raise FlagError(f"{PROG}: give the precisions with --precisions=fp32,bf16,... (each run sets --precision).")
    return names, rest


def runs(job: Run, precisions: list[str]) -> dict[str, Run]:
    """One ``Run`` per precision of a finished job of this program: its ``.series``, ``.summary``, ...."""
    return {p: Run(TRAIN_MODULE, 1, job.command, Path(job.out_dir) / p, job.returncode, job.output, job.elapsed_s,
                   {**job.overrides, "precision": p})
            for p in precisions}


@command  # bad input (FlagError, ConfigError): one line "error: ..." and exit code 2
def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    precisions, rest = split_precisions(argv)
    cfg = parse_cli(rest)
    if parallel.plan_for(cfg).needs_process_group:
        raise FlagError(f"{PROG}: --strategy={cfg.strategy} needs a process group; this program runs one-process "
                        f"strategies ({', '.join(parallel.one_process())}). Under DDP, launch ddp_course.train once per precision.")
    for p in precisions:
        try:
            train_main(cfg.replace(precision=p, out_dir=str(Path(cfg.out_dir) / p)))
        except (DeviceError, CorpusError) as exc:  # what ddp_course.train also answers with exit code 2
            raise FlagError(f"{PROG}: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
