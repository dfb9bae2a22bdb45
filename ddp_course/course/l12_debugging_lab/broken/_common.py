"""What every program of the debugging lab shares: strict flags, a per-rank record, a tiny model, and
the CPU.

Every program runs on the CPU with gloo, on any machine, by design (``CPU_BY_DESIGN``; rank 0 prints
it first, through :func:`cpu_setup` or :func:`announce_cpu`). Each program writes ``rank<R>.json``
into ``--out_dir`` and rewrites it after every event, so what a rank did and saw is on disk even
when the job then hangs, times out or is killed: the symptom is data the notebook reads, never a
log it scrapes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ddp_course.cli import parse_flags
from ddp_course.course import tiny
from ddp_course.course.tiny import VOCAB
from ddp_course.metrics import write_json

# Joining the process group waits for every rank to start; on a busy machine starting Python and torch
# can take minutes, so the rendezvous (and every collective that is not the bug) gets a generous timeout.
# It is not what stops a job that truly hangs: the lab's launcher does that, by the CPU the job's
# processes use (``broken.IDLE_S``). The programs that hang on purpose run the collectives of the bug in
# a group of their own with the short ``--timeout_s``, and only once every rank has arrived (:func:`together`).
INIT_TIMEOUT_S = 600.0
# Why the lab stays on the CPU: the bugs that hang are made to end in a process-group timeout, which
# gloo reports as an error every rank catches and records; under NCCL the watchdog would abort the
# processes instead. The other bugs (data, seeds, no_sync, saving) show the same on any device.
CPU_BY_DESIGN = ("the debugging lab's hangs end in gloo timeouts, errors each rank records (NCCL's watchdog "
                 "would abort the processes instead), and its other bugs look the same on any device")


def announce_cpu(rank: int) -> None:
    """Rank 0 prints why the lab runs on the CPU (for a program that joins its group by hand)."""
    if rank == 0:
        print(f"debugging lab: CPU with gloo by design: {CPU_BY_DESIGN}", flush=True)


@contextmanager
def cpu_setup(timeout_s: float, threads: int = 1) -> Iterator[Any]:
    """``ddp_course.dist.setup`` on the CPU with gloo, the lab's one device; rank 0 prints why first.

    The line does not start with ``[``, so :func:`ddp_course.course.l12_debugging_lab.broken.symptom` leaves it out.
    """
    from ddp_course.dist import log, setup

    with setup(device="cpu", timeout_s=timeout_s, threads=threads, because=CPU_BY_DESIGN) as info:  # by design
        log(f"debugging lab: {info.device_reason}")
        yield info


def flags(argv: list[str], defaults: dict[str, Any], prog: str) -> dict[str, Any]:
    """``parse_flags`` over the options every program has (``--out_dir``, ``--timeout_s``) and its own
    ``defaults``; a bad flag raises ``FlagError``, which the program's ``@command`` turns into exit code 2."""
    return parse_flags(argv, {"out_dir": "runs/broken", "timeout_s": INIT_TIMEOUT_S, **defaults}, prog)


@contextmanager
def started(argv: list[str], defaults: dict[str, Any], prog: str) -> Iterator[tuple[dict[str, Any], Any, Record]]:
    """A program's opening: its options (:func:`flags`), the process group on the CPU with ``--timeout_s``
    (:func:`cpu_setup`) and this rank's :class:`Record`: ``with started(...) as (opts, info, rec):``."""
    opts = flags(argv, defaults, prog)
    with cpu_setup(opts["timeout_s"]) as info:  # by design: see CPU_BY_DESIGN
        yield opts, info, Record(opts["out_dir"], info.rank)


class Record:
    """This rank's record: ``note(key=value)`` stores and writes ``<out_dir>/rank<R>.json`` at once."""

    def __init__(self, out_dir: str | os.PathLike, rank: int | None = None):
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.path = Path(out_dir) / f"rank{self.rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(),
                                     "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                                            "LOCAL_WORLD_SIZE", "GROUP_RANK")}}
        self.t_phase = time.perf_counter()
        self.write()

    def note(self, **values: Any) -> None:
        """Store ``values``; a ``phase=...`` value also restarts the clock that :meth:`error` reads."""
        if "phase" in values:
            self.t_phase = time.perf_counter()
        self.data.update(values)
        self.write()

    def error(self, exc: BaseException, where: str) -> None:
        """Store the exception that ended a phase: type, first lines of its message, seconds since the
        phase began (for a timeout: about the time spent waiting)."""
        msg = str(exc).strip()
        self.note(error={"where": where, "type": type(exc).__name__, "message": msg[:2000],
                         "seconds": round(time.perf_counter() - self.t_phase, 2)})

    def write(self) -> None:
        write_json(self.path, self.data)  # atomic: a rank killed mid-write leaves the last full record


def together() -> None:
    """Wait until every rank is here, on the default group (its generous timeout): a rank that a busy
    machine slowed down arrives late, but it arrives, and the short timeout of the phase that follows
    only ever measures the bug."""
    import torch.distributed as dist

    dist.barrier()


def roll_call(timeout_s: float = INIT_TIMEOUT_S) -> None:
    """Wait until every process torchrun started (``WORLD_SIZE`` of its environment) has reached this
    call, through torchrun's own store (``MASTER_ADDR``:``MASTER_PORT``), for at most ``timeout_s``.

    For a program whose bug is in joining the process group itself: its short timeout then starts
    once all the ranks that exist are there, however slowly a busy machine started them.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=timeout_s))
    store.set(f"debugging_lab/roll_call/{rank}", "here")
    store.wait([f"debugging_lab/roll_call/{r}" for r in range(world)])


def short_group(timeout_s: float):
    """A process group of all ranks whose collectives give up after ``timeout_s`` seconds.

    Created right after the (generously timed) rendezvous, when every rank is present, so only the
    collectives issued on it -- the bug -- run against the short timeout.
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def tiny_model(seed: int = 0, n_embd: int = 32) -> torch.nn.Module:
    """The course's tiny MiniGPT (``course.tiny``) at the lab's size, identical on every rank (same seed)."""
    return tiny.tiny_model(seed, block_size=16, n_layer=1, n_head=2, n_embd=n_embd)


def token_batch(index: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``index`` of a fixed stream of random token windows (the same for every caller)."""
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    t = torch.randint(0, VOCAB, (batch, 17), generator=g)
    return t[:, :-1], t[:, 1:]
