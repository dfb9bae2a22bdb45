"""The course's command line.

    python -m ddp_course doctor                     what this machine has and what the course will use
    python -m ddp_course run --nproc=2 --strategy=ddp --max_steps=100    a training job via torchrun
    python -m ddp_course bench NAME [--key=value]   a benchmark (python -m ddp_course bench --help)
    python -m ddp_course check NN [PATH]            grade an exercise script (default: your workspace's copy)
    python -m ddp_course check                      list every exercise and the command that grades it
    python -m ddp_course progress                   where you stand: every exercise's state, and what is next
    python -m ddp_course update                     bring the course's new lessons into your workspace, keeping your work
    python -m ddp_course reset NAME                 the course's copy of one notebook or exercise back (yours kept)
    python -m ddp_course multinode --nnodes=2 --nproc=8 [-- TRAIN ARGS]   torchrun lines and a Slurm script
"""

from __future__ import annotations

import sys
from fractions import Fraction

RUN_PROG = "python -m ddp_course run"
RUN_OPTIONS = {"nproc": (1, "processes torchrun starts on this machine (one per GPU, or a few on a CPU)")}


def oversubscription(nproc: int, cores: int) -> str | None:
    """The warning for a job of more processes than ``cores``, or None: what it costs (never a refusal)."""
    if nproc <= cores:
        return None
    return (f"warning: --nproc={nproc} starts {nproc} processes on {cores} CPU core(s): each gets about "
            f"{Fraction(cores, nproc)} of a core, so a step is slower than with --nproc={cores}, and start-up alone "
            f"costs {nproc} x one process's start-up (each imports torch), shared by {cores} core(s). "
            "Starting it anyway.")


def _split_nproc(argv: list[str]) -> tuple[int, list[str], set[str]]:
    """``--nproc`` (default 1), the other arguments (ddp_course.train's options) and the keys given;
    read in the forms every option of the course takes (:func:`ddp_course.cli.split_flags`)."""
    from ddp_course.cli import FlagError, split_flags
    from ddp_course.config import TrainConfig

    bools = {k for k, v in TrainConfig().to_dict().items() if isinstance(v, bool)}
    nproc, rest, given = None, [], set()
    for key, value, args in split_flags(argv, bools.__contains__):
        if key != "nproc":
            rest += args
            given.add(key)
            continue
        if value is None:
            raise FlagError("--nproc needs a value, e.g. --nproc=2.")
        if nproc is not None:
            raise FlagError("--nproc is given twice.")
        try:
            nproc = int(value)
        except ValueError:
            raise FlagError(f"--nproc expects an integer (got {value!r}), e.g. --nproc=2.") from None
        if nproc < 1:
            raise FlagError(f"--nproc is the number of processes and must be at least 1 (got {nproc}), e.g. --nproc=2.")
    return nproc or 1, rest, given


def _train_job(argv: list[str]) -> int:
    """`python -m ddp_course run --nproc=N --key=value ...`: ddp_course.train through launch.run."""
    from ddp_course.cli import HELP_FLAGS, FlagError
    from ddp_course.config import check_out_dir, help_text, parse_cli
    from ddp_course.dist import cpu_count
    from ddp_course.launch import LaunchError, LaunchRefused, run

    if any(a in HELP_FLAGS for a in argv):
        print(help_text(RUN_PROG, f"{RUN_PROG} --nproc=2 --strategy=ddp --max_steps=100", RUN_OPTIONS))
        return 0
    try:
        nproc, rest, given = _split_nproc(argv)
        cfg = parse_cli(rest)
        if "out_dir" in given:
            check_out_dir(cfg.out_dir)
    except FlagError as exc:  # ConfigError is one
        print(f"error: {exc}", file=sys.stderr)
        return 2
    warning = oversubscription(nproc, cpu_count())
    if warning:
        print(warning, file=sys.stderr, flush=True)
    overrides = {k: v for k, v in cfg.to_dict().items() if k in given}
    try:
        r = run("ddp_course.train", nproc=nproc, **overrides)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, LaunchRefused) else 1
    except ValueError as exc:  # launch.run refuses bad arguments with ValueError (ConfigError is one)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        from ddp_course.doctor import main as doctor

        return doctor(rest)
    if cmd == "run":
        return _train_job(rest)
    if cmd == "bench":
        from ddp_course.bench import main as bench

        return bench(rest)
    if cmd == "multinode":
        from ddp_course.course.l10_scaling.multinode import main as multinode

        return multinode(rest)
    if cmd == "check":
        from ddp_course.check import main as check

        return check(rest)
    if cmd == "progress":
        from ddp_course.check.progress import main as progress

        return progress(rest)
    if cmd in ("update", "reset"):
        from ddp_course.check.update import main as update

        return update(cmd, rest)
    print(f"error: unknown command {cmd!r}; the commands are doctor, run, bench, check, progress, update, reset and "
          "multinode "
          "(python -m ddp_course --help describes each).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
