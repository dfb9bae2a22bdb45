"""Every collective of torch.distributed, with what each rank holds before and after.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l02_collectives.collectives --out_dir=runs/02_collectives

Each rank joins the process group, then runs, in the same order as every other rank:
all_reduce (SUM, AVG, MAX), broadcast, reduce, all_gather, gather, scatter, reduce_scatter, an
all_reduce inside sub-groups (even and odd ranks), and a barrier that ranks reach at different
times. The inputs are small integer-valued tensors made from a fixed seed, so every rank can also
compute what every other rank started with -- and therefore what each collective must produce.
Each rank checks its own results against that and writes ``collectives_rank<R>.json`` into
``--out_dir``: per collective the call, ``before``, ``after``, the expected ``after`` and ``ok``.

Options (``--key=value``): ``--out_dir``, ``--device`` (auto | cpu | cuda), ``--timeout_s`` (the
process-group timeout), ``--barrier_delay_s`` (rank r reaches the barrier r times this late).

Where a backend lacks an operation (gloo had no ``ReduceOp.AVG`` and no reduce_scatter in older
PyTorch releases), the program shows the same result through the path the backend does support
and says so in the record's ``note``. What the API accepts is not what the backend runs: the
reduce_scatter record's ``executed`` lists the backend's own operations under the call, as PyTorch's
profiler names them (``gloo:all_reduce``, ...), and its ``native`` is True only when one of them is a
reduce-scatter (None when the profiler saw no backend operation to tell by).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags

DEFAULTS: dict[str, Any] = {"out_dir": "runs/collectives", "device": "auto", "timeout_s": 60.0,
                            "barrier_delay_s": 0.3}
PROG = "python -m ddp_course.course.l02_collectives.collectives"
N = 4  # elements per rank in the reductions and broadcast
K = 2  # elements per chunk in gather, scatter, all_gather and reduce_scatter


def reduce_inputs(world_size: int, n: int = N, seed: int = 0) -> torch.Tensor:
    """(world_size, n): row r is what rank r puts into all_reduce / reduce / broadcast.

    Small integers stored as floats: their sums are exact, so the expected results are exact too.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (world_size, n), generator=g).float()


def chunk_inputs(world_size: int, k: int = K) -> torch.Tensor:
    """(world_size, k): row r is rank r's piece for (all_)gather: 10*r + j, so its origin is readable."""
    return (10 * torch.arange(world_size).unsqueeze(1) + torch.arange(k)).float()


def _values(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else [float(v) for v in t.detach().cpu().reshape(-1)]


def _unsupported(exc: Exception) -> bool:
    """Does this error say the backend lacks the operation (rather than that something broke)?"""
    text = str(exc).lower()
    return any(s in text for s in ("not supported", "unsupported", "cannot use", "does not support",
                                   "not implemented", "notimplemented"))


def record(name: str, title: str, call: str, before: torch.Tensor | None, after: torch.Tensor | None,
           expected: torch.Tensor | None, *, after_defined: bool = True, chunk: int = 0, note: str = "",
           native: bool = True, **extra: Any) -> dict[str, Any]:
    """One collective as data. ``after_defined=False``: the API leaves that buffer unspecified here."""
    ok = True
    if after_defined and expected is not None:
        ok = after is not None and torch.equal(after.detach().cpu().reshape(-1), expected.reshape(-1).cpu())
    return {"name": name, "title": title, "call": call, "before": _values(before), "after": _values(after),
            "expected": _values(expected) if after_defined else None, "after_defined": after_defined,
            "chunk": chunk, "ok": ok, "native": native, "note": note, **extra}


BACKEND_EVENT_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "xccl:")  # the profiler's names of a backend's own work


@contextlib.contextmanager
def _stderr_dropped() -> Iterator[None]:
    """File descriptor 2 sent to the null device for the block: the profiler of this PyTorch writes a line
    of its own there as it starts and stops (``USDT: ... profiler_start``), below Python's sys.stderr."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def backend_ops(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``call()``'s result, and the backend operations the profiler saw under it (sorted names, e.g.
    ``["gloo:all_reduce"]``): what the process group ran, whatever the API call was called. Only the
    profiler's start and stop are kept off stderr; what ``call`` itself writes there is not."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _stderr_dropped():
        prof.start()
    try:
        result = call()
    finally:
        with _stderr_dropped():
            prof.stop()
    return result, sorted({e.key for e in prof.key_averages() if e.key.startswith(BACKEND_EVENT_PREFIXES)})


def runs_reduce_scatter(executed: list[str]) -> bool | None:
    """Whether the backend ran a reduce-scatter of its own (None: no backend operation seen to tell by)."""
    return any("reduce_scatter" in op for op in executed) if executed else None


def run_collectives(rank: int, world: int, device: torch.device, delay_s: float) -> list[dict[str, Any]]:
    """Issue every collective once, in the same order on every rank; return one record each."""
    def mine(t: torch.Tensor) -> torch.Tensor:
        return t.clone().to(device)

    return [*all_reduces(rank, world, mine), *rooted(rank, world, mine), *gathers(rank, world, mine),
            *scatters(rank, world, device, mine), *subgroup(rank, world, mine),
            *barrier_timing(rank, world, device, delay_s)]


def all_reduces(rank: int, world: int, mine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """all_reduce with SUM, AVG (or SUM / world_size where the backend has no AVG) and MAX."""
    R = reduce_inputs(world)  # every rank's inputs, known to all ranks (same seed)
    out: list[dict[str, Any]] = []

    # --- all_reduce: every rank ends with the reduction of all ranks' tensors -----------------
    x = mine(R[rank])
    before = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    out.append(record("all_reduce_sum", "all_reduce(SUM)", "dist.all_reduce(x, op=dist.ReduceOp.SUM)",
                      before, x, R.sum(0)))

    x = mine(R[rank])
    note, native = "", True
    try:
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as exc:  # raised before any data moves, on every rank alike
        if not _unsupported(exc):
            raise
        x = mine(R[rank])
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= world
        native = False
        note = (f"the {dist.get_backend()} backend of this PyTorch has no ReduceOp.AVG "
                f"({str(exc).splitlines()[0][:120]}); shown as SUM then / world_size (DDP averages gradients "
                "the same way: divide by the world size, all-reduce with SUM)")
    out.append(record("all_reduce_avg", "all_reduce(AVG)",
                      "dist.all_reduce(x, op=dist.ReduceOp.AVG)" if native else
                      "dist.all_reduce(x, op=dist.ReduceOp.SUM); x /= world_size",
                      mine(R[rank]), x, R.mean(0), note=note, native=native))

    x = mine(R[rank])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    out.append(record("all_reduce_max", "all_reduce(MAX)", "dist.all_reduce(x, op=dist.ReduceOp.MAX)",
                      mine(R[rank]), x, R.max(0).values))
    return out


def rooted(rank: int, world: int, mine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """The collectives with one root: broadcast from rank 0, reduce to rank 0."""
    R = reduce_inputs(world)
    out: list[dict[str, Any]] = []

    # --- broadcast: rank 0's tensor overwrites everyone's ---------------------------------------
    x = mine(R[rank])
    dist.broadcast(x, src=0)
    out.append(record("broadcast", "broadcast(src=0)", "dist.broadcast(x, src=0)", mine(R[rank]), x, R[0]))

    # --- reduce: only the destination's buffer is defined afterwards ----------------------------
    x = mine(R[rank])
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    out.append(record("reduce", "reduce(SUM, dst=0)", "dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)",
                      mine(R[rank]), x, R.sum(0) if rank == 0 else None, after_defined=rank == 0,
                      note="" if rank == 0 else "not the destination: the API leaves this buffer unspecified "
                                                "(it may hold partial sums); never read it"))
    return out


def gathers(rank: int, world: int, mine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """all_gather, and gather to rank 0: every rank's piece, in rank order."""
    C = chunk_inputs(world)
    out: list[dict[str, Any]] = []

    # --- all_gather: every rank ends with every rank's piece, in rank order ---------------------
    piece = mine(C[rank])
    gathered = [torch.empty_like(piece) for _ in range(world)]
    dist.all_gather(gathered, piece)
    out.append(record("all_gather", "all_gather", "dist.all_gather(out_list, x)", piece, torch.cat(gathered),
                      C.reshape(-1), chunk=K))

    # --- gather: only the destination receives the pieces ---------------------------------------
    piece = mine(C[rank])
    dst_list = [torch.empty_like(piece) for _ in range(world)] if rank == 0 else None
    dist.gather(piece, gather_list=dst_list, dst=0)
    out.append(record("gather", "gather(dst=0)", "dist.gather(x, gather_list=out_list if rank == 0 else None, dst=0)",
                      piece, torch.cat(dst_list) if dst_list is not None else None,
                      C.reshape(-1) if rank == 0 else None, after_defined=rank == 0, chunk=K,
                      note="" if rank == 0 else "not the destination: receives nothing"))
    return out


def scatters(rank: int, world: int, device: torch.device, mine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """scatter from rank 0, and reduce_scatter (with the fallbacks a backend may need)."""
    out: list[dict[str, Any]] = []

    # --- scatter: the source holds world_size pieces; rank r receives piece r -------------------
    S = torch.arange(1, world * K + 1).float() * 100  # what rank 0 deals out: 100, 200, ...
    recv = torch.zeros(K, device=device)
    src_list = list(mine(S).split(K)) if rank == 0 else None
    dist.scatter(recv, scatter_list=src_list, src=0)
    out.append(record("scatter", "scatter(src=0)", "dist.scatter(x, scatter_list=pieces if rank == 0 else None, src=0)",
                      mine(S) if rank == 0 else None, recv, S[rank * K:(rank + 1) * K], chunk=K,
                      note="" if rank == 0 else "not the source: holds only an output buffer before"))

    # --- reduce_scatter: reduce like all_reduce, but each rank keeps only its own chunk ---------
    RS = reduce_inputs(world, world * K, seed=1)
    x = mine(RS[rank])
    recv = torch.zeros(K, device=device)
    path, note, native = "", "", None
    # PyTorch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns; 2.10 has only it)
    flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        _, executed = backend_ops(lambda: flat(recv, x, op=dist.ReduceOp.SUM))
        path = f"dist.{flat.__name__}(out, x, op=SUM)"
    except (RuntimeError, ValueError) as exc:
        if not _unsupported(exc):
            raise
        first = str(exc).splitlines()[0][:120]
        try:
            _, executed = backend_ops(lambda: dist.reduce_scatter(recv, list(x.split(K)), op=dist.ReduceOp.SUM))
            path = "dist.reduce_scatter(out, list(x.split(k)), op=SUM)"
            note = f"the flat-tensor variant is not supported here ({first}); the list variant is"
        except (RuntimeError, ValueError) as exc2:
            if not _unsupported(exc2):
                raise
            full = x.clone()
            _, executed = backend_ops(lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM))
            recv = full[rank * K:(rank + 1) * K].clone()
            path = "dist.all_reduce(x, op=SUM); out = x[rank*k:(rank+1)*k]"
            note = (f"the {dist.get_backend()} backend of this PyTorch has no reduce_scatter "
                    f"({str(exc2).splitlines()[0][:120]}); shown via all_reduce, keeping this rank's chunk -- "
                    "the same result, moving about twice the data a real reduce_scatter moves")
            native = False
    if native is None:
        native = runs_reduce_scatter(executed)
        if native is False:  # the API took the call, and the backend ran something else under it
            ran = f"the {dist.get_backend()} backend ran it as {', '.join(executed)}, no reduce-scatter of its own" + (
                ": an all-reduce of the whole buffer, of which each rank keeps its chunk -- the result of a "
                "reduce_scatter, with all-reduce's traffic" if any("all_reduce" in op for op in executed) else "")
            note = f"{note}; {ran}" if note else ran
    out.append(record("reduce_scatter", "reduce_scatter(SUM)", path, x, recv,
                      RS.sum(0)[rank * K:(rank + 1) * K], chunk=K, note=note, native=native, executed=executed))
    return out


def subgroup(rank: int, world: int, mine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
    """An all_reduce inside a sub-group (even ranks, odd ranks)."""
    R = reduce_inputs(world)
    out: list[dict[str, Any]] = []

    # --- process groups: new_group is called by EVERY rank, even for groups it is not in --------
    evens = dist.new_group(list(range(0, world, 2)))
    odds = dist.new_group(list(range(1, world, 2)))
    members = list(range(rank % 2, world, 2))
    x = mine(R[rank])
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=evens if rank % 2 == 0 else odds)
    out.append(record("subgroup_all_reduce", "all_reduce(SUM) in a sub-group",
                      "dist.all_reduce(x, group=evens if rank % 2 == 0 else odds)", mine(R[rank]), x,
                      R[members].sum(0), group_ranks=members,
                      note=f"sub-group {members}: ranks {members} only"))
    return out


def barrier_timing(rank: int, world: int, device: torch.device, delay_s: float) -> list[dict[str, Any]]:
    """A barrier after rank r waited r * delay_s seconds: when each rank arrived and left."""
    out: list[dict[str, Any]] = []

    # --- barrier: nobody leaves before the last one arrives --------------------------------------
    dist.barrier()  # line everyone up, so the delays below are the only difference
    time.sleep(rank * delay_s)  # rank r "works" r * delay_s seconds
    arrive = time.time()
    dist.barrier()
    leave = time.time()
    arrivals = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(arrivals, torch.tensor([arrive], dtype=torch.float64, device=device))
    last = max(float(a.item()) for a in arrivals)
    # One machine, one clock: leaving before the last arrival would be a broken barrier.
    # 1 ms allows for time.time() resolution and the order in which the two timestamps were taken.
    out.append({"name": "barrier", "title": "barrier", "call": "dist.barrier()", "arrive": arrive,
                "leave": leave, "last_arrival": last, "waited_s": leave - arrive, "delay_s": rank * delay_s,
                "ok": leave >= last - 1e-3, "note": "", "native": True})
    return out


@command
def main(argv: list[str]) -> int:
    from ddp_course.dist import log, setup
    from ddp_course.metrics import write_json

    opts = parse_flags(argv, DEFAULTS, PROG)
    if "RANK" not in os.environ:
        raise FlagError(f"{PROG} shows collectives between processes: launch it with torchrun, e.g. "
                        "torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l02_collectives.collectives")
    initialized_before = dist.is_initialized()
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        group = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
                 "device": str(info.device), "device_reason": info.device_reason,
                 "initialized_before_setup": initialized_before, "initialized_inside": dist.is_initialized()}
        log(f"process group: backend {group['backend']}, world size {group['world_size']}, {info.device_reason}")
        records = run_collectives(info.rank, info.world_size, info.device, opts["barrier_delay_s"])
    # Leaving the `with` destroyed the process group (ddp_course.dist.setup always does).
    result = {**group, "destroyed_after": not dist.is_initialized(), "torch": torch.__version__,
              "collectives": records}
    write_json(Path(opts["out_dir"]) / f"collectives_rank{info.rank}.json", result)
    bad = [r["name"] for r in records if not r["ok"]]
    log(f"{len(records) - len(bad)}/{len(records)} collectives as expected"
        + (f"; WRONG: {', '.join(bad)}" if bad else ""), all_ranks=True)
    if bad:
        print(f"error: rank {info.rank}: {', '.join(bad)} did not produce the expected result "
              f"(see {opts['out_dir']}/collectives_rank{info.rank}.json).", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
