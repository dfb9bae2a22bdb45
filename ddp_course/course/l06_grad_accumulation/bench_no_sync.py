"""Step time of gradient accumulation with and without ``no_sync``, across K and world sizes.

    python -m ddp_course.course.l06_grad_accumulation.bench_no_sync                       # K = 1, 2, 4, 8 on 1 and 2 processes
    python -m ddp_course.course.l06_grad_accumulation.bench_no_sync --ks=1,4 --world_sizes=2 --rounds=7 --out=/tmp/bench
    python -m ddp_course.bench no_sync                            # the same, through the bench command

For each world size W it starts one job, ``torchrun --standalone --nproc_per_node=W -m
ddp_course.course.l06_grad_accumulation.bench_no_sync --worker=true ...``. Every rank wraps the same MiniGPT in DDP and times
the course's own ``ddp_course.train.train_step`` -- K micro-batches, clipping, one AdamW step --
with ``no_sync=True`` (one all-reduce per optimizer step) and ``no_sync=False`` (one per micro-batch),
in alternating order, ``--rounds`` times; a step's time is the slowest rank's. Before timing, a
second DDP copy with a communication hook checks that the two modes really all-reduce 1 and K times
per step, and the bench times one all-reduce of the whole gradient (the fastest of 30), which is
what ``no_sync`` saves on each of the K - 1 non-final micro-steps. Last, one step at the largest K is
profiled in each mode (``skipped_work``): the operators a step without ``no_sync`` runs in excess,
with their own time, say what the saving is made of.

World size 1 still runs DDP (a process group of one): what ``no_sync`` saves there is DDP's own
bookkeeping, not communication. ``--device=auto`` (default) runs every job on the GPUs with NCCL when
each rank gets a GPU of its own -- leaving out the world sizes that would not, as long as two are
left -- and every job on the CPU with gloo otherwise (``ddp_course.dist.choose_study_device``: one
bench, one kind of device); the first line says which. On a CPU each rank uses ``--threads`` threads
(default 1), so more ranks than cores (4 on a 2-core machine) oversubscribe the CPU: the bench says
so and the times then include waiting for a core.

Prints a table and writes ``<out>/no_sync.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError, OptionError
from ddp_course.course.l02_collectives.bench_allreduce import fastest_allreduce

NAME = "no_sync"


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a measurement; ``ks`` and ``world_sizes`` become lists."""
    for key in ("ks", "world_sizes"):
        opts[key] = harness.int_list(opts, key, "1,2,4")
        if not opts[key] or min(opts[key]) < 1:
            raise OptionError(f"--{key}={','.join(map(str, opts[key]))!r} must list integers of at least 1.")
    harness.positive(opts, "rounds", "steps", "micro_batch_size", "block_size", "threads")
    harness.positive(opts, "warmup", least=0)
    if opts["n_embd"] % opts["n_head"]:
        raise OptionError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")


def parse_options(argv: list[str]) -> dict[str, Any]:
    """The options of ``--key=value`` arguments, checked; raises :class:`ddp_course.bench.OptionError`."""
    return harness.parse_options(NAME, argv)


# --------------------------------------------------------------------------------------------------
# one rank of a job

# The rows of DDP's reducer and its collective: the steps lesson 06 names (the copy into the bucket with
# its division, torch::distributed::reducer::mul_out; the all-reduce; the copy back into .grad). They are
# kept whatever their rank by time: on a CPU the division's own label is cheap and ranks below the top.
REDUCER_ROWS = ("torch::distributed::reducer::", "torch.distributed.ddp.reducer::", "c10d::")


def skipped_work(step, repeats: int = 5, top: int = 8) -> dict[str, Any]:
    """What a step without ``no_sync`` runs that a step with it does not: ``step(no_sync)`` is profiled
    ``repeats`` times in each mode (``torch.profiler``, CPU); the operators that run more often without
    it are ranked by the self time (their own, without their children) they add per step, and the first
    ``top`` are kept, with every row of DDP's reducer (``REDUCER_ROWS``) wherever it ranks. Each row:
    ``name``, ``calls`` and ``self_ms`` per step in both modes, and the difference. Every rank must call it
    (the steps all-reduce)."""
    from torch.profiler import ProfilerActivity, profile

    per_mode = {}
    for no_sync in (True, False):
        step(no_sync)  # untimed, outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step(no_sync)
        per_mode[no_sync] = {e.key: (e.count / repeats, e.self_cpu_time_total / repeats / 1e3)
                             for e in prof.key_averages()}
    rows = []
    for name in set(per_mode[True]) | set(per_mode[False]):
        (c_ns, t_ns), (c_s, t_s) = per_mode[True].get(name, (0, 0.0)), per_mode[False].get(name, (0, 0.0))
        if c_s == c_ns:
            continue  # run as often in both modes: not work that no_sync skips (its time differs by noise)
        rows.append({"name": name, "calls_no_sync": c_ns, "calls_sync": c_s, "self_ms_no_sync": t_ns,
                     "self_ms_sync": t_s, "extra_ms": t_s - t_ns})
    total = {mode: sum(t for _, t in ops.values()) for mode, ops in per_mode.items()}
    rows.sort(key=lambda r: -r["extra_ms"])
    kept = [r for i, r in enumerate(rows) if i < top or r["name"].startswith(REDUCER_ROWS)]
    return {"total_self_ms_no_sync": total[True], "total_self_ms_sync": total[False], "ops": kept}


def worker(opts: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_course.config import TrainConfig
    from ddp_course.course.l06_grad_accumulation.no_sync_lab import AllReduceCounter, micro_batch, tiny_model
    from ddp_course.dist import log, setup
    from ddp_course.train import build_optimizer, train_step

    with setup(opts["device"], opts["timeout_s"], opts["threads"]) as info:
        if not info.is_distributed:
            raise SystemExit("error: the worker runs under torchrun; start the bench with "
                             "`python -m ddp_course.course.l06_grad_accumulation.bench_no_sync`.")
        device = info.device
        shape = {k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
        cfg = TrainConfig(strategy="ddp", bucket_cap_mb=opts["bucket_cap_mb"], grad_clip=1.0)
        data = {"micro_batch_size": opts["micro_batch_size"], "block_size": opts["block_size"], "seed": opts["seed"]}
        batches = [tuple(t.to(device) for t in micro_batch(i, info.rank, **data)) for i in range(max(opts["ks"]))]

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        # 1. Same-work check: a separate DDP copy with a counting hook (the timed model has none,
        #    so its all-reduces take DDP's built-in path).
        from ddp_course import parallel

        vddp = parallel.record(DDP(tiny_model(opts["seed"], **shape).to(device), bucket_cap_mb=opts["bucket_cap_mb"],
                                   device_ids=[device.index] if device.type == "cuda" else None), "ddp")
        counter = AllReduceCounter(vddp)
        vopt = build_optimizer(vddp, cfg, device)
        for _ in range(2):  # DDP re-buckets after the first backward; count on the second
            counter.reset()
            train_step(vddp, vopt, None, batches[:1], device=device, precision="fp32", grad_clip=1.0)
        n_buckets = counter.calls
        counts = {}
        for k in opts["ks"]:
            for mode in (True, False):
                counter.reset()
                train_step(vddp, vopt, None, batches[:k], device=device, precision="fp32", grad_clip=1.0,
                           no_sync=mode)
                counts[f"{k}/{'no_sync' if mode else 'sync'}"] = {"bucket_all_reduces": counter.calls,
                                                                  "synced_micro_steps": counter.synced_micro_steps}
        del vddp, vopt

        # 2. One all-reduce of a gradient-sized tensor: the cost no_sync avoids per skipped micro-step.
        model = tiny_model(opts["seed"], **shape).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        allreduce_s = fastest_allreduce(n_params, device, calls=32)

        # 3. Timing the course's train_step.
        ddp = parallel.wrap(model, info, cfg)
        opt = build_optimizer(ddp, cfg, device)

        def timed(k: int, no_sync: bool, n: int) -> float:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                loss, _ = train_step(ddp, opt, None, batches[:k], device=device, precision="fp32",
                                     grad_clip=1.0, no_sync=no_sync)
            loss.item()
            sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"the loss became {loss.item()} (K={k}, no_sync={no_sync})")
            return dt.item() / n

        if opts["warmup"]:
            for k in opts["ks"]:
                for mode in (True, False):
                    timed(k, mode, opts["warmup"])
        times: dict[str, list[float]] = {f"{k}/{m}": [] for k in opts["ks"] for m in ("no_sync", "sync")}
        for r in range(opts["rounds"]):
            order = (True, False) if r % 2 == 0 else (False, True)
            for k in opts["ks"]:
                for mode in order:
                    times[f"{k}/{'no_sync' if mode else 'sync'}"].append(timed(k, mode, opts["steps"]))
            log(f"[no_sync bench] world {info.world_size}: round {r + 1}/{opts['rounds']} done")

        skipped = skipped_work(lambda no_sync: train_step(ddp, opt, None, batches[:max(opts["ks"])], device=device,
                                                          precision="fp32", grad_clip=1.0, no_sync=no_sync))
        if info.is_main:
            out = {"world_size": info.world_size, "backend": info.backend, "device": str(device),
                   "threads": torch.get_num_threads(), "n_params": n_params, "n_buckets": n_buckets,
                   "allreduce_s": allreduce_s, "counts": counts, "step_times_s": times,
                   "skipped_work": {"k": max(opts["ks"]), **skipped}}
            from ddp_course.metrics import write_json

            write_json(Path(opts["out_dir"]) / "worker.json", out)


# --------------------------------------------------------------------------------------------------
# the bench: one job per world size, then the table

@harness.bench(NAME, check=_check, worker=worker,
               ks=("1,2,4,8", "micro-batches per optimizer step to try (comma-separated)"),
               world_sizes=("1,2", "processes per job to try (comma-separated); each is one torchrun job"),
               rounds=(5, "timed rounds; each times every K in both modes, modes in alternating order"),
               steps=(3, "optimizer steps per timed measurement"),
               warmup=(1, "untimed optimizer steps of each (K, mode) first"),
               micro_batch_size=(4, "sequences per micro-batch per rank"),
               block_size=(32, "tokens per sequence"),
               n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(128, "model width"),
               bucket_cap_mb=(25.0, "DDP gradient bucket size"),
               threads=(1, "CPU threads per process"),
               device=("auto", "auto (GPUs when each rank of a job gets one, else CPU; one device for every job) "
                               "| cpu | cuda"),
               seed=(0, "model init and data"),
               timeout_s=(300.0, "wall-clock limit of each job (all its processes are stopped after it)"))
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the bench with parsed options; returns the result written to ``<out>/no_sync.json``."""
    base, opts, about = harness.study_start("no_sync bench", opts, "world_sizes")
    print(f"[no_sync bench] K = {', '.join(map(str, opts['ks']))} on {', '.join(map(str, opts['world_sizes']))} "
          f"process(es), {opts['threads']} thread(s) each, {about['cpu_count']} core(s) visible; MiniGPT {opts['n_layer']} layers x "
          f"{opts['n_embd']} wide, micro-batch {opts['micro_batch_size']} x {opts['block_size']} tokens; "
          f"{opts['rounds']} rounds x {opts['steps']} steps", flush=True)
    worker_opts = {k: opts[k] for k in ("rounds", "steps", "warmup", "micro_batch_size", "block_size", "n_layer",
                                        "n_head", "n_embd", "bucket_cap_mb", "threads", "device", "seed",
                                        "timeout_s")}
    worker_opts["ks"] = ",".join(map(str, opts["ks"]))
    jobs = []
    for w in opts["world_sizes"]:
        res, r, oversubscribed = harness.worker_job(NAME, w, base / f"{NAME}_w{w}", timeout=opts["timeout_s"],
                                                    **worker_opts)
        # The bench is only valid if the two modes do what they claim: 1 vs K all-reduces per step.
        b = res["n_buckets"]
        for k in opts["ks"]:
            got_ns = res["counts"][f"{k}/no_sync"]["bucket_all_reduces"]
            got_s = res["counts"][f"{k}/sync"]["bucket_all_reduces"]
            if got_ns != b or got_s != k * b:
                raise BenchError(f"world size {w}, K={k}: expected {b} and {k * b} bucket all-reduces per step "
                                 f"with and without no_sync, counted {got_ns} and {got_s}.")
        rows = []
        for k in opts["ks"]:
            ns = harness.median(res["step_times_s"][f"{k}/no_sync"])
            s = harness.median(res["step_times_s"][f"{k}/sync"])
            rows.append({"k": k, "no_sync_s": ns, "sync_s": s, "saved_s": s - ns, "saved_frac": (s - ns) / s,
                         "all_reduces_no_sync": 1, "all_reduces_sync": k,
                         "predicted_saved_s": (k - 1) * res["allreduce_s"],
                         "no_sync_rounds_s": res["step_times_s"][f"{k}/no_sync"],
                         "sync_rounds_s": res["step_times_s"][f"{k}/sync"]})
        jobs.append({"world_size": w, "oversubscribed": oversubscribed, "wall_s": r.elapsed_s, **res, "rows": rows})

    print()
    print(f"{'world':>5} {'K':>3}  {'no_sync ms/step':>15}  {'sync ms/step':>12}  {'saved ms':>8}  {'saved':>6}  "
          f"{'(K-1) x all-reduce':>18}  {'all-reduces/step':>16}")
    for job in jobs:
        for row in job["rows"]:
            print(f"{job['world_size']:>5} {row['k']:>3}  {row['no_sync_s'] * 1e3:>15.2f}  {row['sync_s'] * 1e3:>12.2f}  "
                  f"{row['saved_s'] * 1e3:>8.2f}  {row['saved_frac']:>6.1%}  {row['predicted_saved_s'] * 1e3:>15.2f} ms"
                  f"  {row['all_reduces_no_sync']:>7} vs {row['all_reduces_sync']:<3}")
    for job in jobs:
        print(f"world {job['world_size']}: one all-reduce of the {job['n_params']:,}-parameter gradient takes "
              f"{job['allreduce_s'] * 1e3:.2f} ms ({job['n_buckets']} bucket(s), {job['backend']} on {job['device']})"
              + (" [oversubscribed]" if job["oversubscribed"] else ""))
    return {"bench": NAME, "options": opts, **about, "jobs": jobs}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
