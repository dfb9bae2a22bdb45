"""The course's command line.

    python -m ddp_course doctor                     what this machine has and what the course will use
    python -m ddp_course run --nproc=2 --strategy=ddp --max_steps=100    a training job via torchrun
    python -m ddp_course bench NAME [--key=value]   a benchmark (python -m ddp_course bench --help)
    python -m ddp_course check NN PATH              grade an exercise script
    python -m ddp_course check                      list every exercise and the command that grades it
    python -m ddp_course multinode --nnodes=2 --nproc=8 [-- TRAIN ARGS]   torchrun lines and a Slurm script
"""

from __future__ import annotations

import sys


def _train_job(argv: list[str]) -> int:
    """`python -m ddp_course run --nproc=N --key=value ...`: ddp_course.train through launch.run."""
    from ddp_course.config import ConfigError, parse_cli
    from ddp_course.launch import LaunchError, run

    nproc = 1
    rest = []
    for arg in argv:
        if arg.startswith("--nproc="):
            nproc = int(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    try:
        cfg = parse_cli(rest)
        given = {a[2:].split("=", 1)[0].replace("-", "_") for a in rest if a.startswith("--")}
        overrides = {k: v for k, v in cfg.to_dict().items() if k in given}
        r = run("ddp_course.train", nproc=nproc, **overrides)
    except (ConfigError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
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

        return doctor()
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
    print(f"error: unknown command {cmd!r}.\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
