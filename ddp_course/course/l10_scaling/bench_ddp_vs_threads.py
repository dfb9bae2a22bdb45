"""DDP with N CPU processes x 1 thread against one process with N threads, same global batch.

    python -m ddp_course.bench ddp_vs_threads
    python -m ddp_course.bench ddp_vs_threads --steps=100 --repeats=3 --out=/tmp/bench

Runs ``torchrun --standalone --nproc_per_node=N -m ddp_course.train --strategy=ddp --threads=1``
with batch/N sequences per rank, and ``python -m ddp_course.train --threads=N`` with the whole
batch, for the same number of steps (both started by ``ddp_course.launch.run``); reads tokens_per_s
(steady state, first log interval left out) from each run's summary.json. Writes
``<out>/ddp_vs_threads.json``; each run's folder is ``<out>/ddp_vs_threads/<kind>_<repeat>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError

DDP_VS_THREADS_CPU = "the question is whether N processes with DDP beat one process with N threads on the same cores"
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "log_interval", "corpus")


def _validate(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a comparison, before any process starts."""
    harness.positive(opts, "steps", "repeats", "nproc", "batch", "log_interval")
    if opts["nproc"] < 2:
        raise BenchError("--nproc must be at least 2 for a DDP run.")
    if opts["batch"] % opts["nproc"]:
        raise BenchError(f"--batch={opts['batch']} must divide evenly over --nproc={opts['nproc']} ranks.")
    if opts["steps"] <= opts["log_interval"]:
        raise BenchError(f"--steps={opts['steps']} must exceed --log_interval={opts['log_interval']}: "
                         "the first interval is warm-up and is not counted in tokens_per_s.")


def _kinds(opts: dict[str, Any]) -> dict[str, tuple[dict[str, Any], int]]:
    """{kind: (training flags, threads)} of the two runs, each checked by the course's config."""
    from ddp_course.config import ConfigError, from_dict

    n = opts["nproc"]
    common = {k: opts[k] for k in MODEL_KEYS} | {"max_steps": opts["steps"], "eval_interval": 0, "eval_batches": 1}
    common["device"] = "cpu"  # by design: processes against threads on one CPU (DDP_VS_THREADS_CPU)
    kinds = {
        "ddp": ({**common, "strategy": "ddp", "threads": 1, "micro_batch_size": opts["batch"] // n}, 1),
        "threads": ({**common, "strategy": "single", "threads": n, "micro_batch_size": opts["batch"]}, n),
    }
    for flags, _ in kinds.values():
        try:
            from_dict(flags)  # refuse bad values here, before any process starts
        except ConfigError as exc:
            raise BenchError(str(exc)) from None
    return kinds


def _one_run(kind: str, flags: dict[str, Any], threads: int, nproc: int, out_dir: Path,
             timeout_s: float) -> dict[str, Any]:
    """Train once with ``ddp_course.train``; its tokens/s, wall time and final loss."""
    r = harness.launch("ddp_course.train", nproc if kind == "ddp" else 1, what=f"the {kind} run", timeout=timeout_s,
                       out_dir=out_dir, use_torchrun=kind == "ddp", env={"OMP_NUM_THREADS": str(threads)}, **flags)
    summary = r.summary
    if summary is None:
        raise BenchError(f"the {kind} run finished but wrote no {out_dir / 'summary.json'}; its output:\n"
                         f"{r.output[-2000:]}")
    return {"kind": kind, "tokens_per_s": float(summary["tokens_per_s"]), "wall_s": r.elapsed_s,
            "final_loss": summary.get("final_loss"), "out_dir": str(out_dir)}


@harness.bench("ddp_vs_threads",
               steps=(60, "optimizer steps of each run"), repeats=(1, "runs of each kind, alternating order"),
               nproc=(2, "DDP ranks (1 thread each) = threads of the single process"),
               batch=(16, "sequences per optimizer step in both runs (DDP: batch / nproc per rank)"),
               n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(128, "model width"),
               block_size=(64, "tokens per sequence"),
               log_interval=(10, "steps per metrics row (the first is warm-up)"),
               corpus=("tinyshakespeare", "tinyshakespeare | offline | a path"),
               timeout_s=(600.0, "wall-clock limit of each run (all its processes are stopped after it)"))
def ddp_vs_threads(opts: dict[str, Any]) -> dict[str, Any]:
    """DDP with N CPU processes x 1 thread against one process with N threads, same global batch."""
    from ddp_course.metrics import load_average

    _validate(opts)
    kinds = _kinds(opts)
    n = opts["nproc"]
    base_dir = Path(opts["out"]).resolve() / "ddp_vs_threads"
    label = {"ddp": f"DDP {n} ranks x 1 thread", "threads": f"1 process x {n} threads"}
    print(f"[ddp_vs_threads] CPU with gloo by design: {DDP_VS_THREADS_CPU}", flush=True)
    print(f"[ddp_vs_threads] {label['ddp']} (micro batch {opts['batch'] // n}) vs {label['threads']} "
          f"(micro batch {opts['batch']}); {opts['steps']} steps, {opts['repeats']} run(s) each; "
          f"runs in {base_dir}", flush=True)
    load_at_start = load_average()
    runs = []
    for r in range(opts["repeats"]):
        for kind in (("ddp", "threads") if r % 2 == 0 else ("threads", "ddp")):
            flags, threads = kinds[kind]
            row = {"round": r + 1, **_one_run(kind, flags, threads, n, base_dir / f"{kind}_{r + 1}", opts["timeout_s"])}
            runs.append(row)
            print(f"[ddp_vs_threads] round {r + 1}/{opts['repeats']}: {label[kind]:<24} {row['tokens_per_s']:>10,.0f} "
                  f"tok/s (final loss {row['final_loss'] or float('nan'):.4f}, {row['wall_s']:.1f} s wall)", flush=True)
    return _report(opts, runs, label, load_at_start)


def _report(opts: dict[str, Any], runs: list[dict[str, Any]], label: dict[str, str],
            load_at_start: list[float] | None) -> dict[str, Any]:
    """The table, the noise warning and the result."""
    from ddp_course.metrics import load_average

    tps = {k: [x["tokens_per_s"] for x in runs if x["kind"] == k] for k in label}
    ddp_med, thr_med = harness.median(tps["ddp"]), harness.median(tps["threads"])
    ratio = ddp_med / thr_med if thr_med > 0 else float("nan")
    not_slower = ratio >= 1.0
    print()
    print(f"{'run':<26}  {'tokens/s (median)':>17}")
    print(f"{label['ddp']:<26}  {ddp_med:>17,.0f}")
    print(f"{label['threads']:<26}  {thr_med:>17,.0f}")
    print(f"\nDDP / threads = {ratio:.3f}: DDP is {'not slower' if not_slower else 'slower'} "
          f"on this machine ({os.cpu_count()} CPU(s) visible)")
    spread = max(harness.spread(v) for v in tps.values())
    busy = harness.noise_warning(
        "ddp_vs_threads", max(harness.span(v) for v in tps.values()), "Other processes on the same cores stall the multi-threaded run's OpenMP "
        "barriers and the DDP ranks' collectives differently, so the ratio can swing either way: rerun on an "
        "idle machine with --repeats=3.", load=load_at_start)
    return {"bench": "ddp_vs_threads", "options": opts, "runs": runs, "ddp_tokens_per_s": ddp_med,
            "threads_tokens_per_s": thr_med, "ratio": ratio, "ddp_not_slower": not_slower,
            "cpu_count": os.cpu_count(), "load_average_at_start": load_at_start,
            "load_average_at_end": load_average(), "repeat_spread": spread, "noisy": busy}


_, main = harness.entry_points("ddp_vs_threads")

if __name__ == "__main__":
    sys.exit(main())
