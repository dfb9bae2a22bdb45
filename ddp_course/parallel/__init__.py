"""Parallelism techniques, one module each, all with the same interface::

    wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module

The model arrives on its device, built identically on every rank (same seed). Adding a technique
is adding one file here: ``TrainConfig`` lists the modules of this package as the valid strategies.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """Apply ``cfg.strategy`` (``ddp_course.parallel.<strategy>.wrap``) to the model."""
    module = importlib.import_module(f"{__name__}.{cfg.strategy}")
    return module.wrap(model, info, cfg)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / DataParallel / FSDP1 / torch.compile wrappers (for saving, sampling).

    FSDP2 shards in place: the model is its own plain self, but its parameters are shards; use
    :func:`gathered` for a copy with full parameters.
    """
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, DataParallel
            model = model.module
        else:
            return model


def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` on a micro-step that must not all-reduce, else a no-op context.

    DDP reads the flag when the *forward* runs, so the forward of every non-final micro-step must be
    inside this context, not only its backward. FSDP2 has no ``no_sync()``: its analogue is
    ``set_requires_gradient_sync(False)`` (no reduce-scatter; unsharded gradients accumulate locally).
    """
    if not sync and hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp2_no_sync(model)
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp2_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; returns the norm before clipping as a plain tensor.

    Sharded gradients need the norm over every rank's shard: FSDP2's are DTensors, whose norm
    torch.nn.utils.clip_grad_norm_ reduces across ranks; FSDP1's are plain local shards, so it has a
    method of its own (torch.nn.utils.clip_grad_norm_ would clip each rank by its shard's norm).
    """
    if hasattr(model, "clip_grad_norm_"):  # FSDP1
        return model.clip_grad_norm_(max_norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor (FSDP2) -> tensor


def param_ndims(model: nn.Module) -> dict[str, int]:
    """Each parameter's number of dimensions as the model defined it, keyed by ``model.named_parameters()``.

    Most wrappers show the parameters as they are. FSDP1 shows flat 1-D shards instead, so its
    ``wrap`` records the real numbers, taken before wrapping, in the wrapper's public ``param_ndims``
    attribute; this function returns that record when there is one. The optimizer's weight-decay
    groups (``train.build_optimizer``) are decided from it.
    """
    recorded = getattr(model, "param_ndims", None)
    if recorded is not None:
        return dict(recorded)
    return {name: p.dim() for name, p in model.named_parameters()}


def is_sharded(model: nn.Module) -> bool:
    """True for FSDP (FSDP2's DTensor parameters, or an FSDP1 wrapper)."""
    from torch.distributed.tensor import DTensor

    return hasattr(model, "_fsdp_wrapped_module") or any(isinstance(p, DTensor) for p in model.parameters())


def gathered(model: nn.Module) -> nn.Module:
    """The model with full parameters, for sampling: itself when replicated, a plain copy when sharded.

    For FSDP this is a collective (the full parameters are all-gathered): every rank must call it.
    """
    if not is_sharded(model):
        return unwrap(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ddp_course.model import MiniGPT

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.random.fork_rng(devices=[]):  # building a model draws its initial weights: leave the RNG alone
        copy = MiniGPT(unwrap(model).cfg).to(next(iter(state.values())).device)
    copy.load_state_dict(state)
    return copy
