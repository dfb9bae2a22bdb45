"""Parallelism techniques, one module each, all with the same interface::

    wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module

The model arrives on its device, built identically on every rank (same seed). Adding a technique
is adding one file here: ``TrainConfig`` lists the modules of this package as the valid strategies.
"""

from __future__ import annotations

import contextlib
import importlib

import torch.nn as nn


def wrap(model: nn.Module, info, cfg) -> nn.Module:
    """Apply ``cfg.strategy`` (``ddp_course.parallel.<strategy>.wrap``) to the model."""
    module = importlib.import_module(f"{__name__}.{cfg.strategy}")
    return module.wrap(model, info, cfg)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP / DataParallel / torch.compile wrappers (for saving, sampling)."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, DataParallel
            model = model.module
        else:
            return model


def sync_context(model: nn.Module, sync: bool):
    """``model.no_sync()`` on a micro-step that must not all-reduce, else a no-op context.

    DDP reads the flag when the *forward* runs, so the forward of every non-final micro-step must be
    inside this context, not only its backward.
    """
    if not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
