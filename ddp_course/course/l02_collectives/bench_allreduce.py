"""All-reduce time against message size on this machine, with algorithm and bus bandwidth.

    python -m ddp_course.course.l02_collectives.bench_allreduce                          # 256 B .. 64 MiB on 2 and 4 processes
    python -m ddp_course.course.l02_collectives.bench_allreduce --world_sizes=2 --max_bytes=1048576 --out=/tmp/bench
    python -m ddp_course.bench allreduce                               # the same, through the bench command

For each world size n it starts one job, ``torchrun --standalone --nproc_per_node=n -m
ddp_course.course.l02_collectives.bench_allreduce --worker=true ...``: gloo on the CPU, or NCCL when every rank has a
GPU of its own (``--device=auto``). For each message size (``--min_bytes`` up to ``--max_bytes``,
times ``--factor``) every rank first checks that one all-reduce (SUM) of a float32 tensor gives the
right answer, then times ``--repeats`` blocks of back-to-back all-reduces; the number of calls per
block is chosen by rank 0 so that a block lasts about ``--block_s`` seconds. A block's time is the
slowest rank's (an all-reduce is finished when the last rank has its result); the reported time is
the median over blocks.

    algorithm bandwidth  algbw = bytes / time            (bytes of one rank's tensor)
    bus bandwidth        busbw = algbw * 2 (n - 1) / n

A ring all-reduce makes every rank send and receive 2 (n - 1) / n times the message, so busbw is the
rate at which the busiest link actually moved data -- comparable across world sizes, and against
the hardware's link bandwidth (the convention of NVIDIA's nccl-tests).

Prints a table per world size and writes ``<out>/allreduce.json`` (``--out`` defaults to
``bench_results``). On a CPU, more processes than cores (4 on a 2-core machine) oversubscribe it:
the bench says so, and those times include waiting for a core.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError, OptionError

NAME = "allreduce"


def bus_factor(n: int) -> float:
    """2 (n - 1) / n: what a ring all-reduce sends (and receives) per rank, in units of the message."""
    return 2 * (n - 1) / n


def message_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Message sizes in bytes, whole float32 elements: min, min*factor, ... up to max."""
    sizes, b = [], max(4, -(-min_bytes // 4) * 4)
    while b <= max_bytes:
        sizes.append(b)
        b *= factor
    return sizes


def fastest_allreduce(numel: int, device: Any, calls: int = 32, skip: int = 2) -> float:
    """Seconds of one all-reduce of ``numel`` float32 zeros: the fastest of ``calls - skip`` timed calls,
    each after a barrier. A fixed amount of work, so the fastest is its cost and the rest interference;
    the first ``skip`` calls set up the connection's buffers. Lessons 06 and 10 use it for scale: what
    one gradient-sized all-reduce costs with nothing to overlap it."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    flat = torch.zeros(numel, device=device)
    times = []
    for i in range(calls):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        sync()
        if i >= skip:
            times.append(time.perf_counter() - t0)
    return min(times)


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a measurement; ``world_sizes`` becomes a list of integers."""
    opts["world_sizes"] = harness.int_list(opts, "world_sizes", "2,4")
    if not opts["world_sizes"] or min(opts["world_sizes"]) < 2:
        raise OptionError(f"--world_sizes must list sizes of 2 or more processes (got {opts['world_sizes']}): "
                          "an all-reduce over one process moves nothing.")
    harness.positive(opts, "min_bytes", "max_bytes", "repeats", "max_iters")
    harness.positive(opts, "factor", least=2)
    if opts["max_bytes"] < opts["min_bytes"]:
        raise OptionError(f"--max_bytes={opts['max_bytes']} is smaller than --min_bytes={opts['min_bytes']}.")
    if opts["block_s"] <= 0 or opts["warmup"] < 0:
        raise OptionError("--block_s must be positive and --warmup 0 or more.")
    harness.choice(opts, "device", ("auto", "cpu", "cuda"))


# --------------------------------------------------------------------------------------------------
# one rank of a job

def worker(opts: dict[str, Any]) -> None:
    """Time all_reduce(SUM) for every message size; rank 0 writes ``<out_dir>/worker.json``."""
    import torch
    import torch.distributed as dist

    from ddp_course.dist import log, setup

    if "RANK" not in os.environ:
        raise BenchError("the worker runs under torchrun; start the bench with `python -m ddp_course.bench allreduce`.")
    with setup(device=opts["device"], timeout_s=max(60.0, opts["timeout_s"])) as info:
        n, dev = info.world_size, info.device

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        log(f"[{NAME}] world size {n}: {info.device_reason}")
        rows = []
        for nbytes in message_sizes(opts["min_bytes"], opts["max_bytes"], opts["factor"]):
            numel = nbytes // 4
            # 1. the work is right: rank r contributes r + 1, so every element must become n (n + 1) / 2
            check = torch.full((numel,), float(info.rank + 1), device=dev)
            dist.all_reduce(check)
            want = n * (n + 1) / 2
            if not bool((check == want).all()):
                raise BenchError(f"all_reduce of {nbytes} bytes gave {check.flatten()[:4].tolist()}..., expected {want}")
            del check
            # 2. warm-up, then rank 0 sizes the blocks from one timed call (the slowest rank's time)
            x = torch.zeros(numel, device=dev)  # zeros stay zeros: no overflow however often it is summed
            dist.barrier()
            probes = []
            for _ in range(max(1, opts["warmup"])):  # the median warm-up call, so one hiccup cannot size the blocks
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync()
                probes.append(time.perf_counter() - t0)
            probe = slowest(statistics.median(probes))
            iters = torch.tensor([min(opts["max_iters"], max(1, round(opts["block_s"] / max(probe, 1e-7))))],
                                 device=dev)
            dist.broadcast(iters, src=0)  # every rank must run the same number of calls
            iters = int(iters.item())
            # 3. timed blocks
            times = []
            for _ in range(opts["repeats"]):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                sync()
                times.append(slowest(time.perf_counter() - t0) / iters)
            t = statistics.median(times)
            algbw = nbytes / t
            rows.append({"bytes": nbytes, "elements": numel, "iters": iters, "time_s": t, "times_s": times,
                         "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * bus_factor(n) / 1e9})
        if info.is_main:
            from ddp_course.metrics import write_json

            write_json(Path(opts["out_dir"]) / "worker.json",
                       {"world_size": n, "backend": info.backend, "device": str(dev),
                        "device_reason": info.device_reason, "bus_factor": bus_factor(n), "rows": rows})


# --------------------------------------------------------------------------------------------------
# the bench: one job per world size, then the table

def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" or b == int(b) else f"{b:.1f} {unit}"
        b /= 1024
    return f"{b} B"


@harness.bench(NAME, check=_check, worker=worker,
               world_sizes=("2,4", "processes per job (comma-separated); each is one torchrun job"),
               min_bytes=(256, "smallest message, bytes per rank (rounded up to whole float32 elements)"),
               max_bytes=(64 * 2**20, "largest message, bytes per rank"),
               factor=(4, "each message size is this many times the previous one"),
               repeats=(5, "timed blocks per size; the median block is reported"),
               block_s=(0.05, "target length of one timed block, seconds (sets the calls per block)"),
               max_iters=(2000, "at most this many all-reduces per block"),
               warmup=(5, "untimed all-reduces per size first (connections, allocations); they size the blocks"),
               device=("auto", "auto (NCCL on GPUs when each rank has one, else gloo on CPU) | cpu | cuda"),
               timeout_s=(300.0, "wall-clock limit of each job (all its processes are stopped after it)"))
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the bench with parsed options; returns the result written to ``<out>/allreduce.json``."""
    from ddp_course.dist import cpu_count

    base = Path(opts["out"]).resolve()
    cores = cpu_count()
    device, world_sizes, reason = harness.study_device(opts["device"], opts["world_sizes"])
    opts = {**opts, "device": device, "world_sizes": world_sizes}  # one kind of device for every job
    print(f"[{NAME}] {reason}", flush=True)
    sizes = message_sizes(opts["min_bytes"], opts["max_bytes"], opts["factor"])
    print(f"[{NAME}] all_reduce(SUM) of float32 tensors, {_fmt_bytes(sizes[0])} .. {_fmt_bytes(sizes[-1])} "
          f"({len(sizes)} sizes) on {', '.join(map(str, opts['world_sizes']))} processes; "
          f"{opts['repeats']} blocks of ~{opts['block_s']:g} s per size", flush=True)
    worker_opts = {k: opts[k] for k in ("min_bytes", "max_bytes", "factor", "repeats", "block_s", "max_iters",
                                        "warmup", "device", "timeout_s")}
    jobs = []
    for n in opts["world_sizes"]:
        res, r, oversubscribed = harness.worker_job(NAME, n, base / f"{NAME}_w{n}", timeout=opts["timeout_s"],
                                                    on_cpu=device == "cpu", **worker_opts)
        jobs.append({**res, "oversubscribed": oversubscribed, "wall_s": r.elapsed_s})

    for job in jobs:
        n = job["world_size"]
        print(f"\nworld size {n} ({job['backend']} on {job['device']}; busbw = algbw x 2({n}-1)/{n} = "
              f"algbw x {job['bus_factor']:.2f})" + ("  [oversubscribed]" if job["oversubscribed"] else ""))
        print(f"{'message':>10}  {'calls/block':>11}  {'time':>11}  {'algbw GB/s':>10}  {'busbw GB/s':>10}")
        for row in job["rows"]:
            print(f"{_fmt_bytes(row['bytes']):>10}  {row['iters']:>11}  {row['time_s'] * 1e6:>8.1f} us  "
                  f"{row['algbw_GBps']:>10.3f}  {row['busbw_GBps']:>10.3f}")
    return {"bench": NAME, "options": opts, "device_reason": reason, "cpu_count": cores, "jobs": jobs}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
