"""Launching with ``torch.multiprocessing.spawn`` instead of torchrun, and its one hard rule.

    python -m ddp_course.course.l04_ddp.spawn_demo --nproc=2 --out_dir=runs/spawn_demo

``main`` starts ``--nproc`` processes with ``mp.spawn(worker, ...)``. Each runs ``worker(rank, ...)``:
it joins a gloo process group by a TCP address the parent chose (spawn sets no RANK, WORLD_SIZE,
MASTER_ADDR or MASTER_PORT: the program must do the rendezvous itself), all-reduces its rank, and
writes ``spawn_rank<R>.json`` into ``--out_dir``.

The rule: ``spawn`` starts *fresh* interpreters and sends them the function to run **by name**
(pickle stores ``module.function``, not code). The child imports that module to find the function.
A function defined in a notebook lives in ``__main__`` of the kernel, which the child cannot import,
so the child dies with ``AttributeError: Can't get attribute ...`` before your code runs.
:func:`try_spawn` runs ``mp.spawn`` with a deadline and captures the children's error output, so a
notebook can show that failure without hanging.

The workers join with gloo and all-reduce a CPU tensor on any machine, by design (``CPU_BY_DESIGN``,
printed in the first line): the demo is about starting processes, not about a device.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_course.cli import command, parse_flags
from ddp_course.metrics import write_json
from ddp_course.paths import show

PROG = "python -m ddp_course.course.l04_ddp.spawn_demo"
DEFAULTS = {"nproc": 2, "out_dir": "runs/spawn_demo", "timeout_s": 30.0}
CPU_BY_DESIGN = "the demo is about how mp.spawn starts processes and where they meet, which is the same on any device"


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float = 30.0) -> None:
    """One process of the job. ``mp.spawn`` passes the rank first, then the ``args`` tuple."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))  # by design: CPU with gloo (CPU_BY_DESIGN)
    try:
        ranks_sum = torch.tensor([float(rank)])
        dist.all_reduce(ranks_sum, op=dist.ReduceOp.SUM)  # 0 + 1 + ... + (W-1) on every rank
        report = {"rank": rank, "world_size": dist.get_world_size(), "pid": os.getpid(), "all_reduce_sum": ranks_sum.item(),
                  "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}}
        write_json(Path(out_dir) / f"spawn_rank{rank}.json", report)
        print(f"[rank {rank}] pid {os.getpid()}: all_reduce of the ranks = {ranks_sum.item():.0f}", flush=True)
    finally:
        dist.destroy_process_group()


@dataclass
class SpawnAttempt:
    ok: bool
    exit_codes: list[int | None]
    error: str  # what mp.spawn raised in the parent ("" when ok)
    child_output: str  # what the children wrote to stderr (their tracebacks)
    elapsed_s: float


def try_spawn(fn: Callable, args: tuple = (), nprocs: int = 2, timeout: float = 60.0) -> SpawnAttempt:
    """``mp.spawn(fn, args, nprocs)`` with a deadline; the children's stderr is captured, not lost.

    The children inherit file descriptor 2, which is pointed at a temporary file for the duration
    (a notebook kernel's stderr is not the cell). On overrun every child is killed.
    """
    start = time.monotonic()
    error, ctx = "", None
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
            while not ctx.join(timeout=0.5):
                if time.monotonic() - start > timeout:
                    error = f"TimeoutError: the processes did not finish within {timeout:.0f}s and were killed"
                    break
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException from join()
            error = f"{type(exc).__name__}: {str(exc).strip()}"
        finally:
            if ctx is not None:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                    p.join(5)
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        child_output = err.read().decode(errors="replace")
    codes = [p.exitcode for p in ctx.processes] if ctx is not None else []
    return SpawnAttempt(ok=not error, exit_codes=codes, error=error, child_output=child_output,
                        elapsed_s=time.monotonic() - start)


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    port = free_port()
    print(f"mp.spawn: {opts['nproc']} processes, rendezvous tcp://127.0.0.1:{port}; CPU with gloo by design: "
          f"{CPU_BY_DESIGN}", flush=True)
    # The guard below matters: spawn's children import this module; without `if __name__ ==
    # "__main__"` they would each call mp.spawn again.
    mp.spawn(worker, args=(opts["nproc"], port, opts["out_dir"], opts["timeout_s"]), nprocs=opts["nproc"], join=True)
    print(f"all {opts['nproc']} processes finished; reports in {show(opts['out_dir'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
