"""DataParallel against DistributedDataParallel on the same GPUs: throughput and per-GPU peak memory.

    python -m ddp_course.course.l03_data_parallel.bench_dp_vs_ddp
    python -m ddp_course.course.l03_data_parallel.bench_dp_vs_ddp --steps=100 --n_layer=8 --gpus=2 --out=/tmp/bench

Needs two or more CUDA GPUs. It trains the same MiniGPT twice with ``ddp_course.train`` (through
``ddp_course.course.l03_data_parallel.train_gpu_memory``, which also records every GPU's peak memory), with the same
global batch, seed and number of steps:

- ``--strategy=dp``: ONE process (no torchrun) that drives all N GPUs with nn.DataParallel;
- ``--strategy=ddp``: torchrun with N processes, one GPU each, batch / N sequences per process.

It prints a table (tokens/s, peak memory of each GPU, final loss) and writes
``<out>/dp_vs_ddp.json``. On a machine with fewer than two CUDA GPUs it is refused as bad input before
anything starts: one ``error:`` line saying why, exit 2 (lesson 03 asks ``skip_reason()`` first and
shows the mechanism on CPU tensors instead).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ddp_course import bench as harness
from ddp_course.bench import BenchError

NAME = "dp_vs_ddp"
LAB = "ddp_course.course.l03_data_parallel.train_gpu_memory"


def skip_reason(gpus_wanted: int = 0) -> str | None:
    """Why this machine cannot run the comparison, or None when it can."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        seen = "no CUDA GPU" if n == 0 else "one CUDA GPU"
        return (f"DP vs DDP needs at least 2 CUDA GPUs and PyTorch sees {seen} on this machine "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). nn.DataParallel does "
                "nothing without CUDA devices (or another accelerator it supports; the course uses CUDA), so "
                "there is nothing real to measure here; lesson 03 shows the mechanism by hand on CPU tensors "
                "instead.")
    if gpus_wanted == 1 or gpus_wanted > n:
        return f"--gpus={gpus_wanted} but the comparison needs 2..{n} GPUs on this machine."
    return None


def _check(opts: dict[str, Any]) -> None:
    """Bad input, before anything starts: a machine without the GPUs the comparison needs (asking for it
    there is asking for what this machine cannot give), or a batch or step count it cannot use."""
    reason = skip_reason(opts["gpus"])
    if reason is not None:
        raise harness.OptionError(reason)
    n = opts["gpus"] or torch.cuda.device_count()
    if opts["batch"] % n:
        raise harness.OptionError(f"--batch={opts['batch']} must divide evenly over {n} GPUs (DDP gives each "
                                  f"process batch / {n}); try --batch={max(n, opts['batch'] // n * n)}.")
    if opts["steps"] <= opts["log_interval"]:
        raise harness.OptionError(f"--steps={opts['steps']} must exceed --log_interval={opts['log_interval']}: the "
                                  "first interval is warm-up and is not counted in tokens/s.")


def _memory(out_dir: Path) -> dict[int, int]:
    """GPU index -> peak bytes allocated, from every process's gpu_memory_rank<R>.json."""
    peaks: dict[int, int] = {}
    for path in sorted(out_dir.glob("gpu_memory_rank*.json")):
        for gpu, m in json.loads(path.read_text(encoding="utf-8"))["gpus"].items():
            peaks[int(gpu)] = max(peaks.get(int(gpu), 0), int(m["peak_allocated_bytes"]))
    return dict(sorted(peaks.items()))


@harness.bench(NAME, check=_check,
               steps=(60, "optimizer steps of each run"),
               log_interval=(10, "steps per metrics row; the first interval (warm-up) is left out of tokens/s"),
               batch=(64, "sequences per optimizer step in both runs (DDP: batch / gpus per process)"),
               gpus=(0, "GPUs to use (0 = every visible one)"),
               n_layer=(6, "transformer blocks"), n_head=(6, "attention heads"), n_embd=(384, "model width"),
               block_size=(256, "tokens per sequence"), precision=("fp32", "fp32 | bf16 | fp16"),
               corpus=("tinyshakespeare", "tinyshakespeare | offline | a path"),
               timeout_s=(600.0, "wall-clock limit of each run (the job is stopped after it)"),
               echo=("rank0", "rank0 | all | none: the runs' output shown while they run"))
def dp_vs_ddp(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the comparison and return the result written to ``<out>/dp_vs_ddp.json`` (a machine with fewer
    than two CUDA GPUs is refused before this runs: ``_check``)."""
    out = Path(opts["out"])
    visible = torch.cuda.device_count()
    n = opts["gpus"] or visible
    env = None
    if n < visible:  # only the first n GPUs, for both runs
        ids = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(visible))).split(",")
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[:n])}
    common = {k: opts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "precision", "corpus",
                                   "log_interval")}
    common |= {"max_steps": opts["steps"], "device": "cuda", "eval_interval": 0, "eval_batches": 1}
    base = out / NAME
    print(f"[{NAME}] {n} x {torch.cuda.get_device_name(0)}; MiniGPT {opts['n_layer']} layers x {opts['n_embd']}, "
          f"{opts['block_size']} tokens x {opts['batch']} sequences per step, {opts['precision']}, "
          f"{opts['steps']} steps", flush=True)
    runs = {}
    for kind, nproc, micro in (("dp", 1, opts["batch"]), ("ddp", n, opts["batch"] // n)):
        for stale in (base / kind).glob("gpu_memory_rank*.json"):  # a re-run must not mix in old ranks
            stale.unlink()
        r = harness.launch(LAB, nproc, what=f"the {kind} run", out_dir=base / kind, timeout=opts["timeout_s"],
                           echo=opts["echo"], use_torchrun=kind == "ddp", env=env, strategy=kind,
                           micro_batch_size=micro, **common)
        s = r.summary
        if s is None:
            raise BenchError(f"the {kind} run finished but wrote no summary.json in {r.out_dir}")
        mem = _memory(r.out_dir)
        if sorted(mem) != list(range(n)):
            raise BenchError(f"the {kind} run recorded memory for GPUs {sorted(mem)}, expected 0..{n - 1}")
        runs[kind] = {"processes": nproc, "micro_batch_size": micro, "tokens_per_s": float(s["tokens_per_s"]),
                      "final_loss": s["final_loss"], "wall_time_s": s["wall_time_s"],
                      "peak_allocated_bytes": {str(k): v for k, v in mem.items()}, "out_dir": str(r.out_dir)}

    dp, ddp = runs["dp"], runs["ddp"]
    dp_mem = [dp["peak_allocated_bytes"][str(i)] for i in range(n)]
    ddp_mem = [ddp["peak_allocated_bytes"][str(i)] for i in range(n)]
    others = sum(dp_mem[1:]) / (n - 1)
    result = {"bench": NAME, "skipped": False, "options": opts, "gpus": n, "gpu_name": torch.cuda.get_device_name(0),
              "runs": runs, "ddp_over_dp_tokens_per_s": ddp["tokens_per_s"] / dp["tokens_per_s"],
              "dp_gpu0_over_other_gpus_memory": dp_mem[0] / others if others else float("inf"),
              "final_loss_diff": abs(dp["final_loss"] - ddp["final_loss"])}

    mib = 2**20
    head = f"{'strategy':<9} {'processes':>9} {'tokens/s':>12} " + " ".join(f"{'GPU' + str(i) + ' MiB':>10}" for i in range(n))
    print("\n" + head + f" {'final loss':>10}")
    for kind, mem in (("dp", dp_mem), ("ddp", ddp_mem)):
        row = runs[kind]
        print(f"{kind:<9} {row['processes']:>9} {row['tokens_per_s']:>12,.0f} "
              + " ".join(f"{m / mib:>10,.0f}" for m in mem) + f" {row['final_loss']:>10.4f}")
    print(f"\nDDP / DP throughput = {result['ddp_over_dp_tokens_per_s']:.2f}; under DP, GPU 0 peaks at "
          f"{result['dp_gpu0_over_other_gpus_memory']:.2f}x the mean of the other GPUs")
    return result


def run(echo: str = "rank0", **overrides: Any) -> dict[str, Any]:
    """From Python: ``run(steps=40, out="runs/x", echo="none")``; returns the result (also written as JSON)."""
    return harness.run(NAME, echo=echo, **overrides)


_, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
