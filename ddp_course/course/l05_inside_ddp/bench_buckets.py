"""Step time of a DDP training step against the gradient bucket size (``bucket_cap_mb``).

    python -m ddp_course.course.l05_inside_ddp.bench_buckets                          # 2 ranks, caps 0.05 .. 25 MB
    python -m ddp_course.course.l05_inside_ddp.bench_buckets --caps=0.1,1,25 --rounds=5 --out=/tmp/bench
    python -m ddp_course.bench buckets                               # the same, through the bench command

Starts one job, ``torchrun --standalone --nproc_per_node=N -m ddp_course.course.l05_inside_ddp.ddp_profile
--mode=sweep ...``: every rank wraps the same MiniGPT in DDP once per bucket size, counts the
all-reduces of one step (one per bucket), then times forward + backward + SGD step for each size,
``--rounds`` rounds of ``--steps`` steps in alternating order (a step counts when the slowest rank is
done). ``--device=auto`` (default) runs on the GPUs with NCCL when every rank has one, else on the
CPU with gloo; the first line says which. Small buckets start communicating early (more overlap with backward) but pay a fixed cost
per message; one big bucket waits for the whole backward. Where the optimum lies depends on the
machine, which is why this is measured here rather than quoted.

Prints a table and writes ``<out>/buckets.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ddp_course.paths import show

NAME = "buckets"
DEFAULTS: dict[str, Any] = {
    "caps": "0.05,0.1,0.25,0.5,1,2,25",
    "nproc": 2,
    "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "micro_batch_size": 8,
    "steps": 8, "rounds": 3, "warmup": 3, "threads": 1,
    "device": "auto",
    "seed": 1337,
    "timeout_s": 600.0,
    "out": "bench_results",
}
HELP = {
    "caps": "bucket sizes to time, in MB (comma-separated)",
    "nproc": "DDP ranks",
    "n_layer": "transformer blocks", "n_head": "attention heads", "n_embd": "model width",
    "block_size": "tokens per sequence", "micro_batch_size": "sequences per rank per step",
    "steps": "steps per timed measurement", "rounds": "timed rounds, bucket sizes in alternating order",
    "warmup": "untimed steps per bucket size first (at least 2: DDP rebuilds its buckets after step 1)",
    "threads": "CPU threads per rank (on the CPU)",
    "device": "auto (NCCL on GPUs when each rank has one, else gloo on CPU) | cpu | cuda",
    "seed": "model init and data",
    "timeout_s": "wall-clock limit of the job (all its processes are stopped after it)",
    "out": "directory for buckets.json and the job's folder",
}


class BenchError(RuntimeError):
    """The benchmark cannot run or its result is not valid. The message says why."""


def usage() -> str:
    lines = [__doc__.strip(), "", "options:"]
    lines += [f"  --{k}={v!s:<28} {HELP[k]}" for k, v in DEFAULTS.items()]
    return "\n".join(lines)


def parse_options(argv: list[str]) -> dict[str, Any]:
    from ddp_course.course.l05_inside_ddp.ddp_common import FlagError, float_list, parse_flags

    try:
        opts = parse_flags(argv, DEFAULTS, prog="python -m ddp_course.course.l05_inside_ddp.bench_buckets")
        float_list(opts["caps"], "caps")
    except FlagError as exc:
        raise BenchError(str(exc)) from None
    for key in ("nproc", "steps", "rounds", "threads", "micro_batch_size", "block_size"):
        if opts[key] < 1:
            raise BenchError(f"--{key} must be at least 1 (got {opts[key]}).")
    if opts["device"] not in ("auto", "cpu", "cuda"):
        raise BenchError(f"--device must be auto, cpu or cuda (got {opts['device']!r}).")
    if opts["nproc"] < 2:
        raise BenchError("--nproc must be at least 2: with one rank there is nothing to all-reduce.")
    if opts["warmup"] < 2:
        raise BenchError("--warmup must be at least 2: DDP rebuilds its buckets after the first step.")
    if opts["n_embd"] % opts["n_head"]:
        raise BenchError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")
    return opts


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"{'bucket_cap_mb':>13}  {'all-reduces/step':>16}  {'ms/step (median)':>16}  {'min':>7}  {'max':>7}"]
    for r in rows:
        lines.append(f"{r['bucket_cap_mb']:>13g}  {r['allreduces_per_step']:>16}  {r['median_ms']:>16.1f}  "
                     f"{r['min_ms']:>7.1f}  {r['max_ms']:>7.1f}")
    best = min(rows, key=lambda r: r["median_ms"])
    lines.append(f"\nfastest: bucket_cap_mb={best['bucket_cap_mb']:g} ({best['median_ms']:.1f} ms per step); "
                 f"model gradients {result['model_bytes'] / 2**20:.2f} MB; {result['world_size']} ranks, "
                 f"{result['backend']} on {result['device']}"
                 + (f", {result['threads_per_rank']} thread(s) each" if result["device"] == "cpu" else ""))
    return "\n".join(lines)


def run_options(opts: dict[str, Any], echo: str = "none") -> dict[str, Any]:
    from ddp_course.dist import DeviceError, choose_device
    from ddp_course.launch import LaunchError, run

    out = Path(opts["out"])
    job_dir = out / NAME
    lab = {k: opts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size", "steps", "rounds",
                                "warmup", "threads", "device", "seed")}
    try:
        _, _, reason = choose_device(opts["device"], opts["nproc"])  # what every rank of the job will choose
    except DeviceError as exc:
        raise BenchError(str(exc)) from None
    print(f"[{NAME}] {opts['nproc']} ranks, {reason}; bucket sizes {opts['caps']} MB, {opts['rounds']} rounds of "
          f"{opts['steps']} steps each", flush=True)
    (job_dir / "sweep.json").unlink(missing_ok=True)
    try:
        run("ddp_course.course.l05_inside_ddp.ddp_profile", nproc=opts["nproc"], out_dir=job_dir, timeout=opts["timeout_s"],
            progress=False, echo=echo, mode="sweep", bucket_caps=opts["caps"], **lab)
    except LaunchError as exc:
        raise BenchError(str(exc)) from None
    path = job_dir / "sweep.json"
    if not path.is_file():
        raise BenchError(f"the sweep job finished but wrote no {path}")
    sweep = json.loads(path.read_text(encoding="utf-8"))
    from ddp_course.metrics import environment

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    result = {"bench": NAME, "options": opts, "rows": sweep["rows"], "model_bytes": sweep["model_bytes"],
              "world_size": sweep["world_size"], "backend": sweep["backend"], "device": sweep["device"],
              "device_reason": sweep["device_reason"],
              "threads_per_rank": sweep["threads_per_rank"], "cpu_count": os.cpu_count(), "load_average": load,
              "environment": environment()}
    print(table(result), flush=True)
    from ddp_course.metrics import write_json

    write_json(out / f"{NAME}.json", result)
    print(f"[{NAME}] wrote {show(out / f'{NAME}.json')}", flush=True)
    return result


def run_bench(**overrides: Any) -> dict[str, Any]:
    """From Python: ``run_bench(caps="0.1,1,25", rounds=3)``; returns the result dict."""
    return run_options(parse_options([f"--{k}={v}" for k, v in overrides.items()]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        opts = parse_options(argv)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run_options(opts, echo="rank0")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
