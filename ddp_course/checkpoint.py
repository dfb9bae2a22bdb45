"""Checkpoints: the full training state, written atomically, in two formats behind one interface.

What a checkpoint holds (both formats):

- ``model``: the model's state by parameter name, unwrapped (no DDP ``module.`` prefix), so it
  loads into a plain MiniGPT; ``optimizer``: AdamW's moments and step counts, keyed by the same names;
- ``step``: optimizer steps done -- the LR schedule follows from it;
- the job's parts that save themselves, each under its name (:class:`TrainState`): the training job's
  are ``scaler`` (the fp16 GradScaler's scale and growth tracker, when it has one) and ``position``
  (``data.DataPosition``: where the data stream stands: samples seen, epoch, batch inside the epoch);
- ``rng``: the Python, torch (and CUDA) generator states of *every* rank, gathered to rank 0;
- ``shape`` and ``world_size``: the model options and number of ranks it was made with.

Two formats (``--ckpt_format``), one interface (:func:`save`, :func:`latest`, :func:`resume`):

- ``full``: ``checkpoints/step_0000100.pt``, one file written by rank 0 with ``torch.save``;
- ``sharded``: ``checkpoints/step_0000100/``, written with ``torch.distributed.checkpoint`` (DCP):
  every rank writes its part (``__<rank>_0.distcp``), rank 0 the index (``.metadata``) and
  ``meta.pt`` (everything that is not a model or optimizer tensor).

Both load at any world size (the data-parallel state is replicated, so every rank reads all of it).

Atomic: a checkpoint is written under a ``.tmp`` name and renamed when complete; the ``latest``
pointer is replaced after that, and old checkpoints are deleted last (``keep_last``). A process
killed in the middle of a save leaves a ``.tmp`` leftover (removed by the next save) and the
previous checkpoint, still complete and still pointed to.

Safe: everything is read with ``torch.load(weights_only=True)`` -- tensors and plain Python values
only. DCP's own index is a pickle; it is read with an unpickler that admits only DCP's metadata
classes. A truncated or missing file, or a checkpoint of another model shape, raises
:class:`CheckpointError` naming the file and the problem.

Collectives: :func:`save`, :func:`save_final` and :func:`resume` are collectives -- every rank
must call them, in the same order. Only rank 0 touches the files of the ``full`` format, but the
gathers and barriers around the writing are outside any ``if rank == 0``: a collective that only
rank 0 enters waits forever for the others (the classic checkpoint hang).

States: how a model's and optimizer's states are read and put back is the strategy's decision.
Every function that touches them requires a plan (``TrainState.plan``, or ``plan=``), anything with
:class:`States`'s four methods: the training job hands its own (``parallel.Strategy``, which holds what its strategy kept while wrapping,
such as FSDP x TP's tensor-parallel size); code that holds only a wrapped model hands
``parallel.strategy_of(model)``. :data:`DCP` is ``torch.distributed.checkpoint``'s ``get_state_dict``
and ``set_state_dict``, right for a plain model and for DDP, FSDP and FSDP1 (the strategies that keep
PyTorch's defaults); ZeRO-1, FSDP x TP and the pipeline bring their own. This module never looks a plan up: it does
not import ``parallel``, and it keeps no table of models.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.dist import DistInfo

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint is slow to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions

T = TypeVar("T")

FORMATS = ("full", "sharded")
POINTER = "latest"
FINAL = "final.pt"
META = "meta.pt"  # inside a sharded checkpoint: step, shape, world size, rng, each part (the job's: position, scaler)
_NAME = re.compile(r"^step_(\d+)(\.pt)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used. The message names the file and the problem."""


class States(Protocol):
    """What a checkpoint needs from a strategy: its states, keyed by parameter name, and a way back.

    ``parallel.Strategy`` is one (a strategy module may override each; the table in
    ``parallel/__init__.py``); :data:`DCP`, PyTorch's own, is its default and a plain model's plan.
    """

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]: ...
    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                        options: StateDictOptions | None = None) -> None: ...
    def model_state_dict(self, model: nn.Module, options: StateDictOptions | None = None) -> dict: ...
    def has_state(self, optimizer: torch.optim.Optimizer) -> bool: ...


class _DCPStates:
    """PyTorch's own: ``torch.distributed.checkpoint.state_dict``'s functions (imported when called: slow)."""

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer, options=options)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                        options: StateDictOptions | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)

    def model_state_dict(self, model: nn.Module, options: StateDictOptions | None = None) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=options)

    def has_state(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer holds state yet (before its first step reading it would create it)."""
        return bool(optimizer.state)


DCP: States = _DCPStates()  # PyTorch's state dicts: the plan of a plain, DDP, FSDP or FSDP1 model


class Stateful(Protocol):
    """A part of a job that saves and restores itself: a GradScaler, ``data.DataPosition``, ..."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# the keys a checkpoint keeps for itself: a part cannot take one of them as its name
RESERVED = ("format", "step", "shape", "world_size", "torch", "rng", "model", "optimizer", "path")


@dataclass
class TrainState:
    """A job's state as a checkpoint sees it: what :func:`save` writes and :func:`resume` puts back.

    ``model`` and ``optimizer`` are read and restored through ``plan`` (the strategy's, see
    :class:`States`); ``parts`` save themselves, each under its name (``"scaler"``, ``"position"``):
    every rank holds the same state of them, and rank 0's is saved. ``step`` is the number of
    optimizer steps done; :func:`resume` sets it. ``shape`` (``GPTConfig.shape()``) is recorded by a
    save and checked by a resume (None: not checked).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: States
    shape: dict[str, int] | None = None
    step: int = 0
    parts: dict[str, Stateful] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(set(self.parts) & set(RESERVED))
        if taken:
            raise ValueError(f"a checkpoint keeps {taken} for itself; give the part another name")


# --- where checkpoints live ------------------------------------------------------------------------

def ckpt_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_path(out_dir: str | os.PathLike, step: int, fmt: str = "full") -> Path:
    """``step_0000100.pt`` (full) or ``step_0000100/`` (sharded) under ``out_dir/checkpoints``."""
    _check_format(fmt)
    return ckpt_dir(out_dir) / (f"step_{step:07d}.pt" if fmt == "full" else f"step_{step:07d}")


def format_of(path: str | os.PathLike) -> str:
    """``sharded`` for a checkpoint directory, ``full`` for a file."""
    return "sharded" if Path(path).is_dir() else "full"


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Committed checkpoints (no ``.tmp`` leftovers), oldest first."""
    d = ckpt_dir(out_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or None when there is no pointer yet."""
    d = ckpt_dir(out_dir)
    pointer = d / POINTER
    if not pointer.exists():
        return None
    path = d / pointer.read_text(encoding="utf-8").strip()
    if not path.exists():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist (deleted by hand?). "
                              f"Write the name of one of {[p.name for p in list_checkpoints(out_dir)]} into it, "
                              "or start without --resume.")
    return path


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"checkpoint format {fmt!r} is not one of {', '.join(FORMATS)}.")


# --- random number generators ----------------------------------------------------------------------

def rng_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """This process's generator states: Python's, torch's CPU one, and its GPU's when it trains on one."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | str = "cpu") -> None:
    if "python" in state:
        random.setstate(_to_python_state(state["python"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    device = torch.device(device)
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _to_python_state(s: Sequence[Any]) -> tuple[Any, ...]:
    # weights_only loading gives lists back where random.getstate() had tuples
    return tuple(tuple(x) if isinstance(x, list) else x for x in s)


def _gather_rng(info: DistInfo) -> list[dict[str, Any]] | None:
    """Every rank's generator states, on rank 0 (None elsewhere). A collective: every rank calls it.

    Ranks can differ (dropout seeded per rank, data workers), so each rank's own state is kept.
    """
    mine = rng_state(info.device)
    if not info.is_distributed:
        return [mine]
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


# --- writing ----------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not possible on every platform (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_save(obj: Any, path: Path) -> None:
    """torch.save to ``<path>.tmp``, flushed to disk, then renamed over ``path`` (never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_leftovers(d: Path) -> None:
    """Delete ``.tmp`` leftovers of a save that was killed before it finished (rank 0)."""
    for p in d.glob("*.tmp"):
        _remove(p)


def _commit(path: Path, keep_last: int) -> None:
    """Rank 0, after the checkpoint is complete under its final name: move ``latest``, then prune."""
    d = path.parent
    tmp = d / (POINTER + ".tmp")
    tmp.write_text(path.name + "\n", encoding="utf-8")
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, d / POINTER)
    _fsync_dir(d)
    if keep_last > 0:
        for old in [p for p in list_checkpoints(d.parent) if p != path][:-(keep_last - 1) or None]:
            _remove(old)


def _full_options(device: torch.device) -> StateDictOptions:
    """Full (unsharded) tensors, what one file holds: copied to the CPU and kept on rank 0 only when
    the model lives on an accelerator.

    A PyTorch workaround, here only: on the CPU, ``cpu_offload`` makes FSDP1's ``FlatParamHandle.to_cpu``
    (torch/distributed/fsdp/_flat_param.py) "move" the gathered flat parameter to the CPU, a no-op that
    keeps the same storage, then free that storage while the state dict's views still point into it:
    ``--strategy=fsdp1`` died with a segmentation fault in the first full checkpoint and in final.pt
    (pytorch/pytorch#188989, fixed by #188990). On the CPU the tensors are in CPU memory already, so
    nothing is lost without it; every rank then holds the full tensors, and rank 0 writes them.
    ``tests/core/test_every_strategy.py`` fails without this.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")


def save(out_dir: str | os.PathLike, state: TrainState, info: DistInfo, *, fmt: str = "full",
         keep_last: int = 2) -> Path | None:
    """Save ``state`` (after ``state.step`` optimizer steps); returns the path on rank 0, else None.

    A collective: every rank must call it. ``full``: rank 0 writes one file while the others wait at
    the closing barrier. ``sharded``: every rank writes its part with DCP. Either way the checkpoint
    is committed by a rename and the ``latest`` pointer moves after it.
    """
    _check_format(fmt)
    if state.shape is None:
        raise ValueError("checkpoint.save needs the model's shape (TrainState.shape, GPTConfig.shape()): "
                         "a resume checks it")
    d = ckpt_dir(out_dir)
    path = checkpoint_path(out_dir, state.step, fmt)
    model, optimizer, plan = state.model, state.optimizer, state.plan
    meta = {"format": fmt, "step": int(state.step), "shape": dict(state.shape), "world_size": info.world_size,
            "torch": str(torch.__version__), **{name: part.state_dict() for name, part in state.parts.items()}}
    rng = _gather_rng(info)  # every rank takes part; rank 0 receives the list
    if fmt == "full":
        model_sd, optim_sd = plan.state_dict(model, optimizer, _full_options(info.device))  # every rank (FSDP gathers)
        if info.is_main:
            d.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(d)
            _atomic_save({**meta, "rng": rng, "model": model_sd, "optimizer": optim_sd}, path)
            _commit(path, keep_last)
    else:
        import torch.distributed.checkpoint as dcp

        if info.is_main:
            d.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(d)
        if info.is_distributed:
            dist.barrier()  # nobody writes into the folder before rank 0 has cleared old leftovers
        tmp = path.with_name(path.name + ".tmp")
        model_sd, optim_sd = plan.state_dict(model, optimizer)
        with warnings.catch_warnings():  # one process without a process group: DCP says so, we know
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp,
                     no_dist=not info.is_distributed)
        # dcp.save returns once every rank's part and the .metadata index are written
        if info.is_main:
            _atomic_save({**meta, "rng": rng}, tmp / META)
            if path.is_dir():  # the same step saved again (a re-run into the same out_dir): a folder is not
                os.replace(path, path.with_name(path.name + ".old.tmp"))  # replaced by a rename; moved aside first
            os.replace(tmp, path)
            _remove(path.with_name(path.name + ".old.tmp"))
            _fsync_dir(d)
            _commit(path, keep_last)
    if info.is_distributed:
        dist.barrier()  # nobody continues (or exits) before the checkpoint is committed
    return path if info.is_main else None


def save_final(out_dir: str | os.PathLike, step: int, model: nn.Module, info: DistInfo, *, plan: States
               ) -> Path | None:
    """Write ``final.pt`` (the unwrapped model's parameters after ``step`` steps), atomically, by rank 0.

    A collective (every rank calls it). Cheap: the model only, no optimizer.
    """
    model_sd = plan.model_state_dict(model, _full_options(info.device))
    path = Path(out_dir) / FINAL
    if info.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save({"step": int(step), "model": model_sd}, path)
    if info.is_distributed:
        dist.barrier()
    return path if info.is_main else None


# --- reading ----------------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _torch_load(path: Path, device: torch.device | str, what: str) -> dict[str, Any]:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} does not exist.") from None
    except pickle.UnpicklingError as exc:
        why = [ln.strip() for ln in str(exc).splitlines() if "WeightsUnpickler error" in ln] or [_first_line(exc)]
        raise CheckpointError(f"{what} {path} holds more than tensors and plain Python values, so it is "
                              f"refused (weights_only=True): {why[0][:300]}. Only load checkpoints you "
                              "trust, and write them with ddp_course.checkpoint.") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as exc:
        raise CheckpointError(f"{what} {path} is truncated or corrupt and cannot be read ({_first_line(exc)}). "
                              "Delete it and resume from an earlier one, or start without --resume.") from None


def _check_shape(path: Path, state: dict[str, Any], shape: dict[str, int] | None) -> None:
    if shape is None:
        return
    saved = state.get("shape") or {}
    diff = {k: (saved.get(k), v) for k, v in shape.items() if saved.get(k) != v}  # the keys: GPTConfig.shape
    if diff:
        desc = ", ".join(f"{k}: checkpoint {a} vs this run {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {path} was made for another model shape ({desc}). "
                              "Resume with the same model options, or use a fresh --out_dir.")


def load(path: str | os.PathLike, device: torch.device | str = "cpu", shape: dict[str, int] | None = None
         ) -> dict[str, Any]:
    """Read a checkpoint safely and check it fits ``shape``; no process group needed.

    A ``full`` file gives everything (model, optimizer, rng, ...); a ``sharded`` folder gives its
    ``meta.pt`` (step, shape, world size, rng, each part's state): its tensors load in place with :func:`resume`.
    """
    path = Path(path)
    if path.is_dir():
        state = _torch_load(path / META, "cpu", "checkpoint part")
    else:
        state = _torch_load(path, device, "checkpoint")
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path} is not a ddp_course checkpoint (it has no 'step'); was it written "
                              "by ddp_course.checkpoint.save?")
    _check_shape(path, state, shape)
    return state


def _restore_full(saved: dict[str, Any], state: TrainState, path: Path) -> None:
    """Put a ``full`` checkpoint's model and optimizer states into ``state``'s (every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    try:
        state.plan.load_state_dict(state.model, state.optimizer, saved["model"], saved["optimizer"],
                                   StateDictOptions(full_state_dict=True))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path} does not fit this model and optimizer ({_first_line(exc)}). "
                              "Resume with the same options it was saved with, or use a fresh --out_dir.") from None


def _restore_rest(saved: dict[str, Any], state: TrainState | None, info: DistInfo | None) -> None:
    """The parts that save themselves (those the checkpoint holds), and this rank's generators."""
    for name, part in (state.parts.items() if state is not None else ()):
        if saved.get(name) is not None:
            part.load_state_dict(saved[name])
    rng = saved.get("rng")
    if isinstance(rng, dict):  # one state for everybody
        rng = [rng]
    if rng:
        rank = info.rank if info is not None else 0
        # a rank that did not exist when the checkpoint was saved starts from rank 0's generators
        set_rng_state(rng[rank] if rank < len(rng) else rng[0], info.device if info is not None else "cpu")


def _check_sharded_files(path: Path) -> None:
    """Every part the DCP index names exists and is long enough: a precise error before DCP reads."""
    for name in (".metadata", META):
        if not (path / name).is_file():
            raise CheckpointError(f"sharded checkpoint {path} is incomplete: {name} is missing. Delete the folder "
                                  "and resume from an earlier checkpoint, or start without --resume.")
    metadata = _read_dcp_metadata(path)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        part = path / rel
        if not part.is_file():
            raise CheckpointError(f"sharded checkpoint {path} is incomplete: its part {rel} is missing "
                                  "(every rank writes one). Delete the folder and resume from an earlier checkpoint.")
        if part.stat().st_size < size:
            raise CheckpointError(f"sharded checkpoint {path} is corrupt: its part {rel} has "
                                  f"{part.stat().st_size} bytes but the index expects at least {size}. Delete the "
                                  "folder and resume from an earlier checkpoint.")


# DCP's index (.metadata) is a pickle: admit only DCP's own metadata classes and torch's basic types.
_DCP_MODULES = {"torch.distributed.checkpoint.metadata"}
_DCP_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES or (module, name) in _DCP_NAMES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def _read_dcp_metadata(path: Path):
    md = path / ".metadata"
    try:
        with open(md, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, OSError) as exc:
        raise CheckpointError(f"sharded checkpoint {path}: its index {md.name} is truncated, corrupt or not "
                              f"DCP's ({_first_line(exc)}). Delete the folder and resume from an earlier "
                              "checkpoint.") from None


def _safe_reader_and_planner(path: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_dcp_metadata(Path(self.path))
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # DCP's default: weights_only=False
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader(path), SafePlanner()


def resume(path: str | os.PathLike, state: TrainState, info: DistInfo) -> dict[str, Any]:
    """Load a checkpoint of either format into ``state``, on every rank; returns its metadata.

    A collective: every rank must call it. The world size may differ from the one that saved it.
    The model may be wrapped (DDP) or plain; with no process group it loads in this one process.
    Restores the parameters and the optimizer (through ``state.plan``), every part the checkpoint
    holds, this rank's RNG states, and ``state.step``; the returned dict is the checkpoint's
    metadata (step, shape, world size, the parts' states, rng) and its ``path``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    if path.is_file():
        saved = load(path, "cpu", state.shape)  # CPU copies; load_state_dict moves them to each rank's device
        _restore_full(saved, state, path)
        meta = {k: v for k, v in saved.items() if k not in ("model", "optimizer")}
    else:
        meta = _load_sharded(path, state, info)
    _restore_rest(meta, state, info)
    state.step = int(meta["step"])
    return meta | {"path": str(path)}


def _load_sharded(path: Path, state: TrainState, info: DistInfo) -> dict[str, Any]:
    """DCP fills the model's and optimizer's tensors in place; returns ``meta.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _check_sharded_files(path)
    meta = load(path, "cpu", state.shape)
    model, optimizer, plan = state.model, state.optimizer, state.plan
    model_sd, optim_sd = plan.state_dict(model, optimizer)  # the structure DCP fills in place
    sd = {"model": model_sd, "optimizer": optim_sd}
    reader, planner = _safe_reader_and_planner(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, storage_reader=reader, planner=planner, no_dist=not info.is_distributed)
        plan.load_state_dict(model, optimizer, sd["model"], sd["optimizer"])
    except CheckpointException as exc:  # a BaseException in DCP: the failures of every rank
        first = next(iter(exc.failures.values()))[0] if exc.failures else exc
        raise CheckpointError(f"sharded checkpoint {path} cannot be loaded into this model "
                              f"({_first_line(first)}).") from None
    except (RuntimeError, KeyError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"sharded checkpoint {path} does not fit this model and optimizer "
                              f"({_first_line(exc)}).") from None
    return meta


def restore_rng_after_first(batches: Iterator[T], meta: dict[str, Any], info: DistInfo) -> Iterator[T]:
    """Yield from ``batches``, putting the saved RNG states back once the first batch has been drawn.

    A DataLoader draws its base seed from the global torch generator whenever an iterator starts. The
    uninterrupted run started this epoch's iterator at the epoch's beginning; a run resumed mid-epoch
    starts one at its first batch -- one extra draw that would shift every later dropout mask. So the
    saved states are restored again right after that draw.
    """
    first = next(batches)
    _restore_rest({"rng": meta.get("rng")}, None, info)
    yield first
    yield from batches


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, plan: States) -> str:
    """A short SHA-256 of the model's full tensors (and the optimizer's state, if given), bit for bit.

    Two fingerprints are equal only if every parameter (and every AdamW moment and step count) is
    identical to the last bit. Entries are keyed by unwrapped names and taken as full tensors, so a
    plain, a DDP and an FSDP model holding the same numbers agree. A collective for a sharded model
    (FSDP gathers the full tensors): every rank calls it.
    """
    import hashlib

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    h = hashlib.sha256()

    def feed(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                h.update(str(k).encode())
                feed(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                feed(v)
        else:
            h.update(repr(obj).encode())

    full = StateDictOptions(full_state_dict=True)  # whole tensors on every rank
    if optimizer is None or not plan.has_state(optimizer):  # (an empty state would be initialised by the call)
        feed(plan.model_state_dict(model, full))
    else:
        model_sd, optim_sd = plan.state_dict(model, optimizer, full)
        feed(model_sd)
        feed(optim_sd["state"])
    return h.hexdigest()[:16]


def sharded_layout(path: str | os.PathLike) -> dict[str, list[str]]:
    """Which file of a sharded checkpoint holds which entry: ``{"__0_0.distcp": ["model.tok_emb.weight", ...]}``.

    Read from DCP's index (``.metadata``) with the restricted unpickler; no process group needed.
    """
    metadata = _read_dcp_metadata(Path(path))
    layout: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        layout.setdefault(info.relative_path, []).append(index.fqn)
    return {k: sorted(v) for k, v in sorted(layout.items())}
