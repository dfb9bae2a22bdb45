"""Scaling of ``ddp_course.train`` over 1, 2 and 4 processes: speedup, efficiency, and where a step's time goes.

    python -m ddp_course.bench scaling                       # 1, 2 and 4 processes
    python -m ddp_course.course.l10_scaling.bench_scaling --nprocs=1,2 --steps=20 --out=/tmp/bench

For each process count n it starts one job, ``torchrun --standalone --nproc_per_node=n -m
ddp_course.course.l10_scaling.bench_scaling --worker=true ...``. Every rank of the job runs the course's training
loop (``ddp_course.train.run_training``, the loop ``python -m ddp_course.train`` runs) twice on the
same MiniGPT:

- **weak scaling**: ``--micro_batch_size`` sequences per rank, so the global batch grows with n and
  the ideal is n times the tokens per second of one process;
- **strong scaling**: a fixed global batch of ``--global_batch`` sequences split over the ranks, so
  each rank's share shrinks with n; the ideal is again n times the throughput (the same step in 1/n
  of the time).

One process trains with ``--strategy=single`` (the baseline: no DDP, no process group work), more
with ``--strategy=ddp``. Tokens per second come from each run's ``summary.json`` (the steady part of
training: the first logging interval, with its warm-up, is left out).

    speedup(n)    = tokens_per_s(n) / tokens_per_s(1)
    efficiency(n) = speedup(n) / n

Then the same job times the phases of a training step on the weak-scaling batch, with timers around
each phase of the course's step: **data** (the next batch from the course's DataLoader), **forward**,
**backward**, **optimizer** (AdamW step and zero_grad). Backward under DDP holds both the gradient
computation and whatever part of the gradient all-reduce it could not overlap, so the bench also
times backward inside ``no_sync()`` (no all-reduce at all), alternating with the normal step:

    waiting on communication = backward (synchronised) - backward (inside no_sync)

and, for scale, one all-reduce of the whole gradient (the fastest of 20): the communication there
would be if none of it overlapped. DDP's own timers (``_get_ddp_logging_data()``: forward, backward
compute, backward communication and their overlap, sampled by DDP on some iterations) are stored
beside them as a second opinion. Each phase is the median over ``--phase_steps`` steps, from the
slowest rank (a step ends when the last rank is done).

``--device=auto`` (default) runs every job on the GPUs with NCCL when each process gets a GPU of its
own -- leaving out the process counts that would not, as long as two are left -- and every job on the
CPU with gloo otherwise (``ddp_course.dist.choose_study_device``: one study, one kind of device).
The first line says which. On the CPU each process uses ``--threads`` threads (default 1), so n
processes want n cores: on a machine with fewer cores than processes x threads the bench says so,
and the figures then include waiting for a core. Prints a table and writes ``<out>/scaling.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError
from ddp_course.course.l02_collectives.bench_allreduce import fastest_allreduce

NAME = "scaling"

OPTIONS: dict[str, tuple[Any, str]] = {
    "nprocs": ("1,2,4", "process counts to run (comma-separated); each is one torchrun job; 1 must be among them"),
    "micro_batch_size": (8, "weak scaling: sequences per rank per step"),
    "global_batch": (8, "strong scaling: sequences per step over all ranks (divisible by every process count)"),
    "steps": (20, "optimizer steps of each training run"),
    "log_interval": (5, "steps per metrics row; the first interval is warm-up and not counted"),
    "phase_steps": (8, "timed steps of each kind (synchronised, inside no_sync) for the phase breakdown"),
    "n_layer": (2, "transformer blocks"), "n_head": (4, "attention heads"), "n_embd": (64, "model width"),
    "block_size": (64, "tokens per sequence"),
    "threads": (1, "CPU threads per process"),
    "device": ("auto", "auto (GPUs when each process of a job gets one, else CPU; one device for every job) | cpu | cuda"),
    "corpus": ("tinyshakespeare", "tinyshakespeare | offline | a path"),
    "seed": (1337, "model init and data order"),
    "timeout_s": (300.0, "wall-clock limit of each job (all its processes are stopped after it)"),
}

PHASES = ("data", "forward", "backward_compute", "comm_wait", "optimizer")


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a study; ``nprocs`` becomes a sorted list."""
    opts["nprocs"] = sorted(set(harness.int_list(opts, "nprocs", "1,2,4")))
    if not opts["nprocs"] or opts["nprocs"][0] != 1:
        raise OptionError(f"--nprocs must include 1 (the baseline every speedup divides by); got {opts['nprocs']}.")
    harness.positive(opts, "micro_batch_size", "global_batch", "steps", "log_interval", "phase_steps", "threads")
    if opts["steps"] <= opts["log_interval"]:
        raise OptionError(f"--steps={opts['steps']} must exceed --log_interval={opts['log_interval']}: the first "
                          "interval is warm-up and is left out of tokens/s.")
    bad = [n for n in opts["nprocs"] if opts["global_batch"] % n]
    if bad:
        raise OptionError(f"--global_batch={opts['global_batch']} does not split evenly over {bad} process(es); "
                          f"use a multiple of {max(opts['nprocs'])}.")
    if opts["n_embd"] % opts["n_head"]:
        raise OptionError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")


def parse_options(argv: list[str]) -> dict[str, Any]:
    """The options of ``--key=value`` arguments, checked; raises :class:`ddp_course.bench.OptionError`."""
    return harness.parse_options(NAME, argv)


def train_config(opts: dict[str, Any], world_size: int, kind: str, out_dir: str):
    """The TrainConfig of one run: ``kind`` is weak (fixed per-rank batch) or strong (fixed global batch)."""
    from ddp_course.config import TrainConfig

    micro = opts["micro_batch_size"] if kind == "weak" else opts["global_batch"] // world_size
    return TrainConfig(strategy="single" if world_size == 1 else "ddp", device=opts["device"],
                       threads=opts["threads"], corpus=opts["corpus"], block_size=opts["block_size"],
                       n_layer=opts["n_layer"], n_head=opts["n_head"], n_embd=opts["n_embd"],
                       max_steps=opts["steps"], micro_batch_size=micro, log_interval=opts["log_interval"],
                       eval_interval=0, eval_batches=1, seed=opts["seed"], out_dir=out_dir)


# --------------------------------------------------------------------------------------------------
# one rank of a job

def time_phases(cfg, info, n_steps: int) -> dict[str, Any]:
    """Median seconds of each phase of a step on this rank (see the module docstring)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from ddp_course import parallel
    from ddp_course.data import prepare, train_batches
    from ddp_course.dist import seed_everything
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import build_optimizer

    device = info.device
    data = prepare(cfg.corpus, cfg.block_size, cfg.val_fraction, announce=lambda _: None)
    seed_everything(cfg.seed)
    model = parallel.wrap(MiniGPT(GPTConfig.from_train(cfg, data.tokenizer.vocab_size)).to(device), info, cfg)
    optimizer = build_optimizer(model, cfg, device)
    batches = train_batches(data.train, cfg.micro_batch_size, info.rank, info.world_size, cfg.seed)
    is_ddp = hasattr(model, "no_sync")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(synchronised: bool) -> dict[str, float]:
        sync()
        t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device), y.to(device)
        sync()
        t1 = time.perf_counter()
        ctx = model.no_sync() if (is_ddp and not synchronised) else contextlib.nullcontext()
        with ctx:  # inside no_sync the forward and the backward skip the all-reduce entirely
            _, loss = model(x, y)
            sync()
            t2 = time.perf_counter()
            loss.backward()
            sync()
            t3 = time.perf_counter()
        if synchronised:  # the gradients are the averaged ones: step. Otherwise only discard them.
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return {"data": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3, "step": t4 - t0}

    if info.is_distributed:
        dist.barrier()
    for _ in range(3):  # warm-up: allocations, DDP's bucket rebuild after the first backward
        step(True)
        step(False)
    rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for i in range(n_steps):
        for synchronised in ((True, False) if i % 2 == 0 else (False, True)):  # alternate: drift hits both
            rows[synchronised].append(step(synchronised))

    def med(mode: bool, key: str) -> float:
        return harness.median([r[key] for r in rows[mode]])

    local = {
        "data": med(True, "data"),
        "forward": med(True, "forward"),
        "backward_compute": med(False, "backward"),
        # no DDP, no communication: one process's two kinds of steps are the same step
        "comm_wait": max(0.0, med(True, "backward") - med(False, "backward")) if is_ddp else 0.0,
        "optimizer": med(True, "optimizer"),
        "step": med(True, "step"),
        "backward_synchronised": med(True, "backward"),
    }
    # One all-reduce of the whole gradient, for scale: what communication costs with no overlap.
    n_params = sum(p.numel() for p in model.parameters())
    local["allreduce_full_gradient"] = fastest_allreduce(n_params, device, calls=22) if info.is_distributed else 0.0
    # DDP's own timers (the reducer samples some iterations): a second opinion on the same phases
    if is_ddp:
        data_ = model._get_ddp_logging_data()
        for key in ("avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
                    "avg_backward_compute_comm_overlap_time"):
            if key in data_:
                local[f"ddp_{key}"] = data_[key] / 1e9  # nanoseconds -> seconds
    keys = list(local)
    if info.is_distributed:  # the slowest rank decides how long a step takes
        t = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        local = dict(zip(keys, t.tolist()))
    return {**local, "n_params": n_params, "gradient_bytes": 4 * n_params, "steps_timed": n_steps}


def worker(opts: dict[str, Any]) -> None:
    import torch

    from ddp_course.dist import setup
    from ddp_course.train import run_training

    out_dir = Path(opts["out_dir"])
    with setup(opts["device"], opts["timeout_s"], opts["threads"]) as info:
        runs = {}
        for kind in ("weak", "strong"):
            cfg = train_config(opts, info.world_size, kind, str(out_dir / kind))
            if kind == "strong" and cfg.micro_batch_size == runs["weak"]["micro_batch_size"]:
                runs[kind] = {**runs["weak"], "same_run_as": "weak"}  # the same configuration: one run
                continue
            t0 = time.perf_counter()
            summary = run_training(cfg, info)
            runs[kind] = {"micro_batch_size": cfg.micro_batch_size, "global_batch": cfg.global_batch(info.world_size),
                          "tokens_per_s": summary["tokens_per_s"], "final_loss": summary["final_loss"],
                          "wall_s": time.perf_counter() - t0, "run_dir": cfg.out_dir}
        phases = time_phases(train_config(opts, info.world_size, "weak", str(out_dir / "phases")), info,
                             opts["phase_steps"])
        if info.is_main:
            res = {"world_size": info.world_size, "backend": info.backend, "device": str(info.device),
                   "threads": torch.get_num_threads(), "runs": runs, "phases": phases}
            from ddp_course.metrics import write_json

            write_json(out_dir / "worker.json", res)


# --------------------------------------------------------------------------------------------------
# the bench: one job per process count, then the table

@harness.bench(NAME, check=_check, worker=worker, **OPTIONS)
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the bench with parsed options; returns the result written to ``<out>/scaling.json``."""
    base, opts, about = harness.study_start("scaling", opts, "nprocs")  # one device for every job
    print(f"[scaling] {', '.join(map(str, opts['nprocs']))} process(es) x {opts['threads']} thread(s), {about['cpu_count']} core(s) "
          f"visible; MiniGPT {opts['n_layer']} layers x {opts['n_embd']} wide, {opts['block_size']} tokens per sequence; "
          f"weak: {opts['micro_batch_size']} sequences per rank, strong: {opts['global_batch']} per step in all; "
          f"{opts['steps']} steps per run", flush=True)
    worker_opts = {**{k: opts[k] for k in OPTIONS}, "nprocs": ",".join(map(str, opts["nprocs"]))}  # checked again
    jobs = []
    for n in opts["nprocs"]:
        res, r, oversubscribed = harness.worker_job(NAME, n, base / f"{NAME}_n{n}", timeout=opts["timeout_s"],
                                                    use_torchrun=n > 1,  # one process: no agent
                                                    **worker_opts)
        jobs.append({"nproc": n, "oversubscribed": oversubscribed, "job_wall_s": r.elapsed_s, **res})
        print(f"[scaling] {n} process(es): weak {res['runs']['weak']['tokens_per_s']:,.0f} tok/s, "
              f"strong {res['runs']['strong']['tokens_per_s']:,.0f} tok/s ({r.elapsed_s:.1f}s job)", flush=True)

    base_tps = {kind: jobs[0]["runs"][kind]["tokens_per_s"] for kind in ("weak", "strong")}
    table = {}
    for kind in ("weak", "strong"):
        table[kind] = []
        for job in jobs:
            run_ = job["runs"][kind]
            speedup = run_["tokens_per_s"] / base_tps[kind]
            table[kind].append({"nproc": job["nproc"], "micro_batch_size": run_["micro_batch_size"],
                                "global_batch": run_["global_batch"], "tokens_per_s": run_["tokens_per_s"],
                                "speedup": speedup, "efficiency": speedup / job["nproc"],
                                "oversubscribed": job["oversubscribed"], "final_loss": run_["final_loss"]})
    phases = [{"nproc": job["nproc"], **{k: v for k, v in job["phases"].items()}} for job in jobs]
    # Strong scaling keeps the global batch: every run trains the same model on the same samples, so
    # the losses agree up to float32 summation order (a check that the runs did the same work).
    strong_losses = [r["final_loss"] for r in table["strong"]]
    strong_gap = max(strong_losses) - min(strong_losses)

    print()
    print(f"{'scaling':<7} {'procs':>5} {'per rank':>8} {'global':>6} {'tokens/s':>10} {'speedup':>8} {'efficiency':>10}")
    for kind in ("weak", "strong"):
        for row in table[kind]:
            print(f"{kind:<7} {row['nproc']:>5} {row['micro_batch_size']:>8} {row['global_batch']:>6} "
                  f"{row['tokens_per_s']:>10,.0f} {row['speedup']:>8.2f} {row['efficiency']:>10.0%}"
                  + ("  [oversubscribed]" if row["oversubscribed"] else ""))
    print()
    print(f"{'procs':>5} " + " ".join(f"{p:>16}" for p in PHASES) + f" {'step':>8}  {'1 all-reduce':>12}   (ms, slowest rank)")
    for p in phases:
        print(f"{p['nproc']:>5} " + " ".join(f"{p[k] * 1e3:>16.2f}" for k in PHASES) + f" {p['step'] * 1e3:>8.2f}  "
              f"{p['allreduce_full_gradient'] * 1e3:>12.2f}")
    print(f"\nstrong scaling: final losses {', '.join(f'{v:.6f}' for v in strong_losses)} "
          f"(largest difference {strong_gap:.1e}: the same global batch trains the same model)")
    return {"bench": NAME, "options": opts, **about,
            "weak": table["weak"], "strong": table["strong"],
            "phases": phases, "jobs": jobs, "strong_final_loss_gap": strong_gap}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
