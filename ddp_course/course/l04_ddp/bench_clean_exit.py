"""Finished jobs must exit 0: launch tiny jobs again and again and count abnormal exits.

    python -m ddp_course.bench clean_exit --launches=200   # after a torch upgrade (target: 0 of 200)

A stress check of ``ddp_course.dist.clean_exit``, the exit workaround lesson 04 shows: without it,
gloo's threads can outlive the interpreter and abort a process that finished its work. Each launch
is one ``ddp_course.launch.run`` job; the folders of abnormal exits are kept under
``<out>/clean_exit``. Writes ``<out>/clean_exit.json``; exits 1 when any launch ended abnormally.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError

TINY_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "micro_batch_size": 4}
CLEAN_EXIT_JOBS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (module, its options); each job gets a folder of its own (--out_dir)
    "train": ("ddp_course.train", {"strategy": "ddp", "max_steps": 5, "eval_interval": 0, "eval_batches": 2,
                                   **TINY_MODEL}),
    "profile": ("ddp_course.course.l05_inside_ddp.ddp_profile",
                {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "micro_batch_size": 4, "trace_steps": 1,
                 "steps": 2, "rounds": 1, "warmup": 2, "bucket_cap_mb": 0.01}),
}


def _jobs(opts: dict[str, Any]) -> list[str]:
    """The job names of ``--jobs``; raises OptionError on an unknown one."""
    jobs = [j.strip() for j in opts["jobs"].split(",") if j.strip()]
    unknown = [j for j in jobs if j not in CLEAN_EXIT_JOBS]
    if unknown or not jobs:
        raise OptionError(f"--jobs: unknown job(s) {unknown}; choose from {', '.join(CLEAN_EXIT_JOBS)}.")
    return jobs


def _launch(job: str, nproc: int, out: Path, timeout_s: float) -> tuple[int | str, str]:
    """One job: its exit code ("timeout" when it was stopped) and its output."""
    from ddp_course.launch import LaunchTimeout, run

    module, flags = CLEAN_EXIT_JOBS[job]
    try:  # OMP_NUM_THREADS=1: the job's ranks share the cores, as the launcher's jobs do
        r = run(module, nproc, out_dir=out, timeout=timeout_s, progress=False, echo="none", use_torchrun=True,
                check=False, env=harness.job_env(OMP_NUM_THREADS="1"), **flags)
    except LaunchTimeout as exc:
        return "timeout", exc.run.output
    return r.returncode, r.output


@harness.bench("clean_exit",
               launches=(20, "jobs to launch, alternating between the jobs in --jobs"),
               jobs=("train,profile", f"comma-separated, from: {', '.join(CLEAN_EXIT_JOBS)}"),
               nproc=(2, "ranks per job"),
               timeout_s=(120.0, "wall-clock limit of one job (a job past it counts as abnormal: a hang)"))
def clean_exit(opts: dict[str, Any]) -> dict[str, Any]:
    """Launch tiny finished jobs again and again and count abnormal exits (target: 0 of 200)."""
    from tqdm.auto import tqdm

    from ddp_course.metrics import load_average

    harness.positive(opts, "launches", "nproc")
    jobs = _jobs(opts)
    root = Path(opts["out"]) / "clean_exit"
    abnormal: list[dict[str, Any]] = []
    counts = {j: 0 for j in jobs}
    t0 = time.perf_counter()
    bar = tqdm(range(opts["launches"]), desc="clean_exit", unit="job")
    for i in bar:
        job = jobs[i % len(jobs)]
        out = root / f"{i:04d}_{job}"
        rc, output = _launch(job, opts["nproc"], out, opts["timeout_s"])
        counts[job] += 1
        if rc != 0:
            abnormal.append({"launch": i, "job": job, "returncode": rc, "out_dir": str(out),
                             "tail": output.splitlines()[-15:]})
            bar.set_postfix(abnormal=len(abnormal))
        else:
            shutil.rmtree(out, ignore_errors=True)  # keep only the folders of abnormal exits
    wall = time.perf_counter() - t0
    bar.close()
    print(f"abnormal exits: {len(abnormal)} of {opts['launches']} "
          f"({', '.join(f'{n} {j}' for j, n in counts.items())}; {wall:.0f} s, load {load_average()})")
    for a in abnormal:
        print(f"\n--- launch {a['launch']} ({a['job']}) exited {a['returncode']}; its last lines:")
        print("\n".join("    " + line for line in a["tail"]))
    return {"launches": opts["launches"], "jobs": counts, "abnormal": abnormal, "wall_s": round(wall, 1),
            "load": load_average(), "torch": torch.__version__, "pass": not abnormal}


_, main = harness.entry_points("clean_exit")

if __name__ == "__main__":
    sys.exit(main())
