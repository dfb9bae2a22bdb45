"""Distributed set-up and tear-down, owned by one place.

``with setup(device="auto") as info:`` reads the environment torchrun sets (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), chooses the backend and device, joins the
process group with a short timeout, and always destroys the group on the way out -- also when the
body raises. Without torchrun's environment it runs as a single process with no process group.

Nothing here changes global state at import time.
"""

from __future__ import annotations

import atexit
import gc
import os
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class DeviceError(RuntimeError):
    """The requested device cannot be used on this machine. The message says what to use instead."""


@dataclass(frozen=True)
class DistInfo:
    """Who this process is. Handed down explicitly; there is no module-level state."""

    rank: int = 0  # global rank, 0 .. world_size-1
    local_rank: int = 0  # rank on this node; picks the GPU
    world_size: int = 1  # processes in the job
    local_world_size: int = 1  # processes on this node
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # "gloo" or "nccl"; None without a process group
    device_reason: str = ""  # one line saying why this device was chosen

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def cpu_count() -> int:
    """Cores this process may use (respects CPU affinity and container limits where visible)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Test-only: lets several ranks share one GPU through gloo with CUDA tensors, so that the DDP code
# path with CUDA tensors can be exercised on a machine with a single GPU. Never the course's own
# choice: NCCL refuses two ranks on one GPU, and a timing taken this way says nothing about NCCL.
SHARED_GPU_VAR = "DDP_COURSE_TEST_GLOO_SHARED_GPU"


def shared_gpu_for_tests() -> bool:
    """True when ``DDP_COURSE_TEST_GLOO_SHARED_GPU=1`` is set (the tests' one-GPU option, see above)."""
    return os.environ.get(SHARED_GPU_VAR) == "1"


def choose_device(requested: str, local_world_size: int = 1) -> tuple[torch.device, str, str]:
    """Return (device type, backend, reason) for ``--device`` given the processes on this node.

    CUDA with NCCL only when every local rank has a GPU of its own: NCCL refuses two ranks on one
    GPU, so with fewer GPUs than local ranks the course uses CPU with gloo and says so. Only the
    test-only ``DDP_COURSE_TEST_GLOO_SHARED_GPU=1`` changes that: the ranks then share the GPUs with
    gloo (CUDA tensors, never NCCL).
    """
    have_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if have_cuda else 0
    if requested not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"--device={requested!r} is not one of auto, cpu, cuda.")
    if requested == "cpu":
        return torch.device("cpu"), "gloo", "CPU with gloo (requested with --device=cpu)"
    if have_cuda and n_gpu >= local_world_size:
        return torch.device("cuda"), "nccl", f"CUDA with NCCL ({n_gpu} GPU(s), one per process)"
    if have_cuda and shared_gpu_for_tests():
        return (torch.device("cuda"), "gloo",
                f"CUDA with gloo: {local_world_size} processes sharing {n_gpu} GPU(s) ({SHARED_GPU_VAR}=1, "
                "a test-only option: NCCL refuses two ranks on one GPU)")
    if requested == "cuda":
        if not have_cuda:
            raise DeviceError(
                "--device=cuda was requested but PyTorch sees no CUDA GPU on this machine "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False). Use --device=auto "
                "(falls back to CPU with gloo) or --device=cpu; on a GPU machine, install a CUDA build "
                "of PyTorch (see the README).")
        raise DeviceError(
            f"--device=cuda with {local_world_size} processes on this node, but only {n_gpu} GPU(s): "
            "NCCL needs one GPU per process. Launch with --nproc_per_node="
            f"{n_gpu} or use --device=cpu (gloo) to run {local_world_size} processes on the CPU.")
    if have_cuda:
        return (torch.device("cpu"), "gloo",
                f"CPU with gloo: {local_world_size} processes but {n_gpu} GPU(s), and NCCL needs one GPU each")
    return torch.device("cpu"), "gloo", "CPU with gloo: no CUDA GPU visible"


def choose_study_device(requested: str, nprocs: Sequence[int]) -> tuple[str, list[int], str]:
    """One device for a benchmark that runs one job per process count in ``nprocs``.

    Returns (``"cpu"`` or ``"cuda"``, the process counts to run, reason). Every job of a study runs
    on the same kind of device: with ``auto``, a study whose small jobs fit on the GPUs but whose
    large ones do not would otherwise compare a GPU with a CPU. So ``auto`` keeps the process counts
    that get a GPU each when at least two of them do (the others are left out, and the reason says
    so); otherwise every job runs on the CPU. ``cuda`` needs a GPU per process for every count.
    Raises :class:`DeviceError` as :func:`choose_device` does.
    """
    sizes = sorted(set(nprocs))
    picks = {n: choose_device(requested, n) for n in sizes}
    kinds = {n: p[0].type for n, p in picks.items()}
    largest = picks[sizes[-1]]
    if len(set(kinds.values())) == 1:
        return kinds[sizes[-1]], sizes, largest[2]
    on_gpu = [n for n in sizes if kinds[n] == "cuda"]
    left = [n for n in sizes if kinds[n] != "cuda"]
    n_gpu = torch.cuda.device_count()
    if len(on_gpu) >= 2:
        return "cuda", on_gpu, (f"{picks[on_gpu[-1]][2]}; left out {', '.join(map(str, left))} process(es): "
                                f"{n_gpu} GPU(s), and NCCL needs one GPU per process")
    return "cpu", sizes, (f"CPU with gloo for every job: {n_gpu} GPU(s) cannot give each of {sizes[-1]} processes "
                          "its own, and a study on mixed devices would compare the devices, not the process counts")


COLLECTIVE_TIMEOUT_VAR = "DDP_COURSE_COLLECTIVE_TIMEOUT_S"  # at most this many seconds per collective (setup)
# CPU threads per process when the program does not choose (threads=0), instead of the cores divided by
# the node's processes: a test suite that runs two jobs at once on two cores gives each one core's worth
# (OpenMP threads that wait for a core another job holds spin, and cost that job its time too).
THREADS_VAR = "DDP_COURSE_THREADS"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextmanager
def setup(device: str = "auto", timeout_s: float = 120.0, threads: int = 0, because: str = "") -> Iterator[DistInfo]:
    """Join the process group torchrun prepared (or run as one process) and always leave it.

    ``because`` is the reason a program pins ``device="cpu"`` on any machine; it becomes the
    ``device_reason`` ("CPU with gloo by design: ..."), which the program prints in its first line.
    ``timeout_s`` is how long a collective waits for a rank that does not come; a job's environment
    can shorten it (``DDP_COURSE_COLLECTIVE_TIMEOUT_S``: a grader does, so that a learner's hang is
    answered in seconds). Issues no collective except the rendezvous inside ``init_process_group``.
    """
    if because and device != "cpu":
        raise ValueError(f"because= gives the reason for pinning the CPU; pass device='cpu' (got {device!r}).")
    env = os.environ
    distributed = launched_by_torchrun()
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))

    dev_type, backend, reason = choose_device(device, local_world_size)
    if env.get(COLLECTIVE_TIMEOUT_VAR):
        timeout_s = min(timeout_s, float(env[COLLECTIVE_TIMEOUT_VAR]))
    if because:
        reason = f"CPU with gloo by design: {because}"
    if dev_type.type == "cuda":
        # Pin by LOCAL_RANK: global RANK would point past the last GPU on the second node. (Ranks share
        # the GPUs only under the test-only gloo option, where backend is gloo.)
        index = local_rank if backend == "nccl" else local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        torch_device = torch.device("cuda", index)
    else:
        torch_device = torch.device("cpu")
        n = threads or int(env.get(THREADS_VAR) or 0) or max(1, cpu_count() // local_world_size)
        torch.set_num_threads(n)
        reason += f", {n} thread(s) per process"

    if not distributed:
        reason = reason.replace(" with gloo", "").replace(" with NCCL", "") + " (one process, no process group)"
        _install_exit_hook()  # no group to release: only the quick exit
    else:
        with clean_exit():
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
    info = DistInfo(rank=rank, local_rank=local_rank, world_size=world_size,
                    local_world_size=local_world_size, device=torch_device,
                    backend=backend if distributed else None, device_reason=reason)
    try:
        yield info
    finally:
        if dist.is_available() and dist.is_initialized():
            _hold_groups()  # the groups made since (a device mesh's) are released in order at exit too
            dist.destroy_process_group()


# --- A clean exit (workaround for PyTorch; the one place it lives) -----------------------------
#
# What went wrong: about one finished 2-rank gloo job in ten died *after* its last line with
# "terminate called without an active exception" (SIGABRT, exit -6). A backtrace of the dying
# thread shows a gloo worker ("pt_gloo_runloop") destroying a finished all-reduce while the main
# thread is already in Py_FinalizeEx:
#
#   ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState -> SafePyObject decref
#   -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> forced unwind -> std::terminate
#
# 1. Every backward stashes a Python object (a contextvars.Context) in the thread-local state
#    (torch.autograd.graph._engine_run_backward). DDP's and FSDP's gradient collectives start
#    *during* backward, so each such work captures that object, and the gloo worker that ran it
#    drops it afterwards, which needs the GIL. A worker that asks for the GIL once the interpreter
#    is finalizing is ended by pthread_exit from inside a noexcept destructor: std::terminate.
# 2. Gloo joins its workers only when the process group object is destroyed, and after a DDP
#    model was built it never is: DDP imports torch.distributed.nn.functional, whose functions
#    take ``group=group.WORLD`` as a default argument, evaluated at import time -- ten references
#    to the live default group that nothing releases (destroy_process_group only forgets it).
#    So the workers outlive the interpreter, and whether one is still dropping a work when
#    finalization starts is a race (it also depends on output buffering, hence PYTHONUNBUFFERED).
#    Upstream reports of the same abort: pytorch/pytorch#190489 (gloo, "terminate called without
#    an active exception" at exit) and the abandoned pytorch/pytorch#179291 (an atexit
#    destroy_process_group for the same crash).
#
# The workaround ends the group in order, while the interpreter is whole:
# - import torch.distributed.nn.functional *before* init_process_group, so its defaults bind to
#   None (the functions then use the default group at call time, as documented);
# - keep one reference to each process group (the default one and those made later, e.g. by a
#   device mesh), and at exit (atexit runs before finalization)
#   collect garbage -- DDP/FSDP modules of functions that have returned, reference cycles
#   included -- and then drop that last reference. ProcessGroup's Python holder releases the GIL
#   while the C++ object is destroyed, so the gloo workers finish their pending work and are
#   joined. Dropping it from a C++ owner (DDP's Reducer) with the GIL held could deadlock instead.
#
# Then a quick exit (not a workaround: only time). gc.freeze() moves every object still alive out
# of the garbage collector's reach, so the collections the interpreter runs while it finalizes skip
# them. An optimizer's first call imports torch._dynamo (about 285,000 objects in all), and those
# collections then took about 0.7 s of every process's exit: a 2-rank DDP job of 2 steps went from
# 4.81 s to 4.07 s (median of 6 launches each, alternated). Nothing is lost: objects are still freed
# by reference counting as the modules are cleared, the collection just before the freeze has
# already finalized the garbage, and the course closes its files with ``with``.
#
# The quick exit is skipped where an extension built with nanobind is loaded (triton 3.9 and later,
# with PyTorch 2.15's CUDA wheels): nanobind reports every object of its own that the interpreter did
# not free as a leak, about 30 lines per process, and frozen objects are never freed
# (``quick_exit_is_quiet``).
#
# Which PyTorch needs it: without the guard, a finished 2-rank DDP job's gloo workers were still
# alive at exit on 2.11, 2.12, 2.13, 2.14 and 2.15 (tests/core/test_clean_exit.py); on 2.10 the same job had
# joined them by itself. The guard is harmless there, so it runs on every version; the test that
# shows why it exists expects the leftover workers from EXIT_GUARD_NEEDED_FROM on, none before.
#
# ``DDP_COURSE_EXIT_REPORT=1`` makes each rank print how many gloo threads are left after this
# (tests assert 0); ``DDP_COURSE_NO_EXIT_GUARD=1`` turns the workaround off, for the test that
# shows it is still needed (python -m ddp_course.bench clean_exit is the stress check).

EXIT_GUARD_NEEDED_FROM = (2, 11)  # (major, minor): the first PyTorch whose gloo workers outlive the interpreter
_HELD_GROUPS: list[object] = []
_DRAIN_S = 0.2  # seconds with the GIL released, only when a group outlives its release
_EXIT_HOOK_INSTALLED = False


def gloo_threads() -> int:
    """Gloo threads alive in this process (Linux; 0 where /proc is not readable)."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:
            continue
        n += "gloo" in name
    return n


def _at_exit() -> None:
    """Release the process groups in order, then freeze what is left (see the comment above)."""
    gc.collect()  # modules of functions that have returned, including those in reference cycles
    _HELD_GROUPS.clear()  # the last reference: the group is destroyed and its workers joined
    left = gloo_threads()
    if left:
        # Something else still owns the group, so its workers were not joined: FSDP2's fully_shard
        # keeps a C++ reference we could not release (no Python referrer; PyTorch 2.13). Give a
        # worker that is still dropping a finished work the GIL before finalization starts.
        time.sleep(_DRAIN_S)
    if quick_exit_is_quiet():
        gc.freeze()  # after the collection above: the frozen objects are the live ones, none of them garbage
    if os.environ.get("DDP_COURSE_EXIT_REPORT") == "1":
        _write_line(f"[exit] rank {os.environ.get('RANK', '0')}: gloo threads left: {left}, "
                    f"objects frozen: {gc.get_freeze_count()}")


def quick_exit_is_quiet() -> bool:
    """Whether freezing at exit prints nothing (see the comment above ``EXIT_GUARD_NEEDED_FROM``).

    A frozen object is never collected, so one in a reference cycle outlives the interpreter, and
    extensions built with nanobind report each such object of theirs as a leak when the interpreter
    ends. Triton is one from 3.9 on (PyTorch 2.15's CUDA wheels bring it, and torch._dynamo imports
    it): every rank of a finished job printed about 30 lines of "nanobind: leaked ...". Where triton
    is loaded the exit is left to the interpreter: slower, and silent.
    """
    return "triton" not in sys.modules


def _install_exit_hook() -> None:
    global _EXIT_HOOK_INSTALLED
    if not _EXIT_HOOK_INSTALLED:
        atexit.register(_at_exit)
        _EXIT_HOOK_INSTALLED = True


@contextmanager
def clean_exit() -> Iterator[None]:
    """Wrap ``dist.init_process_group(...)`` in this so that the job ends cleanly (see above).

    ``with clean_exit(): dist.init_process_group("gloo")`` -- ``setup()`` does it for you; code
    that joins a group by hand (ddp_recipe, exercise 04's harness) wraps its own call.
    """
    if not _guard_off():
        import torch.distributed.nn.functional  # noqa: F401  (before init: see the comment above)
    _install_exit_hook()
    yield
    _hold_groups()


def exit_guard_needed(version: str | None = None) -> bool:
    """True if this PyTorch (or ``version``, e.g. "2.13.0+cpu") leaves gloo workers alive at exit
    without the guard (see the comment above ``EXIT_GUARD_NEEDED_FROM``)."""
    major, minor = (int(x) for x in (version or torch.__version__).split(".")[:2])
    return (major, minor) >= EXIT_GUARD_NEEDED_FROM


def _guard_off() -> bool:
    return os.environ.get("DDP_COURSE_NO_EXIT_GUARD") == "1"


def _hold_groups() -> None:
    """Keep a reference to every live process group until exit (see the comment above)."""
    if _guard_off() or not (dist.is_available() and dist.is_initialized()):
        return
    # No public API lists the groups; pg_map is the registry destroy_process_group empties.
    groups = [dist.group.WORLD, *dist.distributed_c10d._world.pg_map]
    _HELD_GROUPS.extend(g for g in groups if g is not None and all(g is not h for h in _HELD_GROUPS))


def current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def log(msg: str, *, all_ranks: bool = False) -> None:
    """Print from rank 0 only; with ``all_ranks=True`` every rank prints, prefixed ``[rank N]``."""
    rank = current_rank()
    if all_ranks:
        _write_line(f"[rank {rank}] {msg}")
    elif rank == 0:
        _write_line(msg)


def _write_line(text: str) -> None:
    # One write per line: ranks share the launcher's pipe, and print() writes the text and the
    # newline separately, so another rank's line could land between them.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def seed_everything(seed: int) -> None:
    """Seed Python and torch (CPU and every CUDA device) with the same value."""
    random.seed(seed)
    torch.manual_seed(seed)


# Held while a block draws from torch's global RNG under ``seeded``. That RNG is one per process, not
# one per thread: two threads that seed it and then draw (two graders' in-process references, graded
# two jobs at a time) interleave their draws, and each builds a model no other process would.
_GLOBAL_RNG = threading.RLock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global RNG seeded with ``seed`` (``torch.manual_seed``) while no
    other thread in ``seeded`` draws from it: what the block draws (a model's initial weights, say)
    then depends on ``seed`` alone, as in a process of its own. The RNG is left as the block leaves it.
    """
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        yield


def all_reduce_mean(value: torch.Tensor | float, info: DistInfo) -> float:
    """Average a scalar over ranks with one all_reduce (SUM then divide). Every rank must call it."""
    t = torch.as_tensor(value, dtype=torch.float64 if info.device.type == "cpu" else torch.float32,
                        device=info.device).detach().clone()
    if info.is_distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return float(t.item())
