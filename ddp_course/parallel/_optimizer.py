"""Not a strategy (its name starts with _): the course's AdamW, which every strategy builds.

The default ``build_optimizer`` of ``ddp_course/parallel/__init__.py`` is :func:`adamw`; FSDP1 hands
it the dimensions its flat shards hide, ZeRO-1 wraps the same groups and settings. A strategy imports
this module, never the package's ``__init__`` (which imports the strategies: that would be a loop).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def decay_groups(model: nn.Module, cfg: Any, ndims: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """AdamW's two parameter groups: weight decay on matrices (2-D or more), none on biases and gains.

    ``ndims``: each parameter's number of dimensions by its name in ``model.named_parameters()``, when
    the wrapper shows them otherwise than the model defined them (FSDP1's flat 1-D shards).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if (ndims[name] if ndims is not None else p.dim()) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_options(cfg: Any, device: torch.device) -> dict[str, Any]:
    """The course's AdamW settings: ``cfg.lr``, betas (0.9, 0.95), the fused kernel on CUDA.

    On CPU, PyTorch's default path (one tensor at a time) is kept, so CPU results stay comparable
    across the torch versions the course supports.
    """
    return {"lr": cfg.lr, "betas": (0.9, 0.95), "fused": device.type == "cuda"}


def adamw(model: nn.Module, cfg: Any, device: torch.device, ndims: dict[str, int] | None = None
          ) -> torch.optim.AdamW:
    """The default optimizer: AdamW over :func:`decay_groups` with :func:`adamw_options`."""
    return torch.optim.AdamW(decay_groups(model, cfg, ndims), **adamw_options(cfg, device))
