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

import os
import sys
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError
from ddp_course.course import noise

NAME = "buckets"
LAB = "ddp_course.course.l05_inside_ddp.ddp_profile"


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a sweep, before the job starts."""
    harness.float_list(opts, "caps")
    harness.positive(opts, "nproc", "steps", "rounds", "threads", "micro_batch_size", "block_size")
    harness.choice(opts, "device", ("auto", "cpu", "cuda"))
    if opts["nproc"] < 2:
        raise OptionError("--nproc must be at least 2: with one rank there is nothing to all-reduce.")
    if opts["warmup"] < 2:
        raise OptionError("--warmup must be at least 2: DDP rebuilds its buckets after the first step.")
    if opts["n_embd"] % opts["n_head"]:
        raise OptionError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [f"{'bucket_cap_mb':>13}  {'all-reduces/step':>16}  {'ms/step (median)':>16}  {'min':>7}  {'max':>7}"]
    for r in rows:
        lines.append(f"{r['bucket_cap_mb']:>13g}  {r['allreduces_per_step']:>16}  {r['median_ms']:>16.1f}  "
                     f"{r['min_ms']:>7.1f}  {r['max_ms']:>7.1f}")
    # The winner only when its range clears every other size's (noise.ranking), else which sizes tie.
    best = noise.ranking({f"bucket_cap_mb={r['bucket_cap_mb']:g}": r["step_ms"] for r in rows})
    lines.append(f"\n{best['verdict']}\nmodel gradients {result['model_bytes'] / 2**20:.2f} MB; "
                 f"{result['world_size']} ranks, {result['backend']} on {result['device']}"
                 + (f", {result['threads_per_rank']} thread(s) each" if result["device"] == "cpu" else ""))
    return "\n".join(lines)


@harness.bench(NAME, check=_check,
               caps=("0.05,0.1,0.25,0.5,1,2,25", "bucket sizes to time, in MB (comma-separated)"),
               nproc=(2, "DDP ranks"),
               n_layer=(4, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(128, "model width"),
               block_size=(64, "tokens per sequence"), micro_batch_size=(8, "sequences per rank per step"),
               steps=(8, "steps per timed measurement"),
               rounds=(3, "timed rounds, bucket sizes in alternating order"),
               warmup=(3, "untimed steps per bucket size first (at least 2: DDP rebuilds its buckets after step 1)"),
               threads=(1, "CPU threads per rank (on the CPU)"),
               device=("auto", "auto (NCCL on GPUs when each rank has one, else gloo on CPU) | cpu | cuda"),
               seed=(1337, "model init and data"),
               timeout_s=(600.0, "wall-clock limit of the job (all its processes are stopped after it)"),
               echo=("auto", "rank0 | all | none: the job's output shown as it runs (auto: rank0 on the command "
                             "line, none from Python)"))
def run_options(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the sweep with parsed options; returns the result written to ``<out>/buckets.json``."""
    job_dir = Path(opts["out"]) / NAME
    lab = {k: opts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size", "steps", "rounds",
                                "warmup", "threads", "device", "seed")}
    _, _, reason = harness.device_for(opts["device"], opts["nproc"])
    print(f"[{NAME}] {opts['nproc']} ranks, {reason}; bucket sizes {opts['caps']} MB, {opts['rounds']} rounds of "
          f"{opts['steps']} steps each", flush=True)
    (job_dir / "sweep.json").unlink(missing_ok=True)
    r = harness.launch(LAB, opts["nproc"], what="the sweep job", out_dir=job_dir, timeout=opts["timeout_s"],
                       echo=opts["echo"], mode="sweep", bucket_caps=opts["caps"], **lab)
    sweep = harness.job_result(r, "sweep.json")
    result = {"bench": NAME, "options": opts, "rows": sweep["rows"], "model_bytes": sweep["model_bytes"],
              "world_size": sweep["world_size"], "backend": sweep["backend"], "device": sweep["device"],
              "device_reason": sweep["device_reason"],
              "threads_per_rank": sweep["threads_per_rank"], "cpu_count": os.cpu_count()}
    print(table(result), flush=True)
    return result


run_bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
