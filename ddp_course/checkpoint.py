"""Full-state checkpoints: written by rank 0, atomically, loaded by every rank.

A checkpoint holds the unwrapped model (so it loads into a plain MiniGPT), the optimizer, the
GradScaler, the step (from which the LR schedule and the data position follow), the model shape it
was made with, and RNG states. Files are written under a temporary name and renamed; the ``latest``
pointer is replaced last, so a process killed mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.parallel import unwrap

SHAPE_KEYS = ("block_size", "n_layer", "n_head", "n_embd", "vocab_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used. The message names the file and the problem."""


def ckpt_dir(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(out_dir, step: int, model, optimizer, scaler, info, shape: dict[str, int], keep_last: int = 2) -> Path | None:
    """Rank 0 writes ``step_<N>.pt`` and moves ``latest`` to it; every rank waits at a barrier.

    Every rank must call this (the barrier is a collective); only rank 0 touches the disk.
    """
    path = None
    if info.is_main:
        d = ckpt_dir(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"step_{step:07d}.pt"
        state = {
            "step": step,
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "shape": dict(shape),
            "world_size": info.world_size,
            "rng": _rng_state(),
        }
        _atomic_save(state, path)
        pointer = d / "latest"
        tmp = d / "latest.tmp"
        tmp.write_text(path.name + "\n", encoding="utf-8")
        os.replace(tmp, pointer)
        for old in sorted(d.glob("step_*.pt"))[:-keep_last] if keep_last > 0 else []:
            old.unlink(missing_ok=True)
    if info.is_distributed:
        dist.barrier()
    return path


def latest(out_dir) -> Path | None:
    d = ckpt_dir(out_dir)
    pointer = d / "latest"
    if not pointer.exists():
        return None
    path = d / pointer.read_text(encoding="utf-8").strip()
    return path if path.exists() else None


def load(path: str | os.PathLike, device: torch.device, shape: dict[str, int] | None = None) -> dict[str, Any]:
    """Load a checkpoint safely (``weights_only=True``) and check it fits the model shape."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist.") from None
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt and cannot be read "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Delete it and resume "
                              "from an earlier one, or start without --resume.") from None
    if shape is not None:
        diff = {k: (state["shape"].get(k), shape[k]) for k in SHAPE_KEYS
                if k in shape and state["shape"].get(k) != shape[k]}
        if diff:
            desc = ", ".join(f"{k}: checkpoint {a} vs this run {b}" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {path} was made for another model shape ({desc}). "
                                  "Resume with the same model options, or use a fresh --out_dir.")
    return state


def restore(state: dict[str, Any], model, optimizer, scaler) -> int:
    """Load a checkpoint's states into the objects; returns the step to continue from."""
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    rng = state.get("rng") or {}
    if "python" in rng:
        random.setstate(_to_python_state(rng["python"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    return int(state["step"])


def _to_python_state(s):
    # weights_only loading gives lists back where random.getstate() had tuples
    return tuple(tuple(x) if isinstance(x, list) else x for x in s)
