"""FSDP1: ``FullyShardedDataParallel``, PyTorch's first FSDP, kept for comparison with FSDP2.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=fsdp1

Each transformer block is wrapped in its own ``FullyShardedDataParallel`` (``ModuleWrapPolicy``),
the root in another. Unlike FSDP2, FSDP1 concatenates a unit's parameters into one flat 1-D
``FlatParameter`` and shards that: a rank's shard can end in the middle of a tensor, and with
``use_orig_params=True`` (needed here so that the optimizer sees one parameter per tensor) the
parameters it exposes are 1-D views into the local shard, some of them empty.

The same options as ``strategy=fsdp`` map to FSDP1's ``ShardingStrategy``:

================================  ==================  ========================
reshard_after_forward             true                false
================================  ==================  ========================
fsdp_shard_size = 0 (all ranks)   ``FULL_SHARD``      ``SHARD_GRAD_OP``
fsdp_shard_size = divisor         ``HYBRID_SHARD``    ``_HYBRID_SHARD_ZERO2``
================================  ==================  ========================

Two traps handled here:

- On the CPU, FSDP1 refuses to start without ``device_id=torch.device("cpu")`` ("FSDP needs a
  non-CPU accelerator device"): the course passes the device explicitly.
- ``HYBRID_SHARD`` with one rank per shard group (``fsdp_shard_size=1``) silently stops
  synchronising: FSDP1 turns the unit into ``NO_SHARD`` but reduces the gradients over the one-rank
  shard group only, so every replica trains on its own data (pytorch/pytorch#154888, not fixed in
  FSDP1). The course refuses that combination; FSDP2 does it right (``strategy=fsdp``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.parallel import _optimizer, fsdp

OPTIONS = fsdp.OPTIONS  # the same options as FSDP2's, mapped to FSDP1's (the table above)
HELPERS = ("sharding_strategy",)  # public, not a hook: lesson 09 uses it


def sharding_strategy(info: DistInfo, cfg: TrainConfig) -> ShardingStrategy:
    """FSDP1's ShardingStrategy for these options (the table above); refuses the unsynchronised hybrid case."""
    replicas, shard = fsdp.shard_layout(info, cfg)
    if replicas > 1 and shard == 1:
        raise ConfigError(
            f"--strategy=fsdp1 with --fsdp_shard_size=1 on {info.world_size} ranks would be HYBRID_SHARD with one rank "
            "per shard group, and FSDP1 then silently stops synchronising gradients: it reduces them over the "
            "one-rank shard group only, so each rank trains its own model on its own data while the job looks "
            "healthy (pytorch/pytorch#154888, not fixed in FSDP1). Use --strategy=ddp (that is what one rank per "
            "shard group means), --strategy=fsdp with --fsdp_shard_size=1 (FSDP2 all-reduces across the replicas "
            "correctly), or a shard size of 2 or more.")
    if replicas > 1:
        return ShardingStrategy.HYBRID_SHARD if cfg.reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if cfg.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig, *, state: dict[str, Any]) -> nn.Module:
    """Wrap each transformer block, then the root, in FullyShardedDataParallel; returns the root wrapper."""
    strategy = sharding_strategy(info, cfg)  # refuse before any collective
    offload = fsdp.cpu_offload(info, cfg)
    ndims = {id(p): p.dim() for p in model.parameters()}  # before FSDP1 flattens them (see below)
    hybrid = strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    mp = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
          if cfg.fsdp_mixed_precision else None)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}), sharding_strategy=strategy,
                   device_id=info.device,  # explicit: on the CPU FSDP1 refuses to guess it
                   device_mesh=fsdp.device_mesh(info, cfg) if hybrid else None, use_orig_params=True,
                   mixed_precision=mp, cpu_offload=CPUOffload(offload_params=True) if offload else None)
    # FSDP1 shows each parameter (the same object, use_orig_params) as a flat 1-D view of this rank's
    # shard; the optimizer's weight-decay groups need the real number of dimensions: kept in the plan's
    # state by the wrapper's parameter names, read by build_optimizer below.
    state["param_ndims"] = {name: ndims[id(p)] for name, p in wrapped.named_parameters()}
    return wrapped


def build_optimizer(model: FSDP, cfg: Any, device: torch.device, *, state: dict[str, Any]) -> torch.optim.AdamW:
    """The course's AdamW, its weight-decay groups decided by the dimensions recorded before wrapping."""
    return _optimizer.adamw(model, cfg, device, ndims=state["param_ndims"])


def sync_context(model: FSDP, sync: bool) -> contextlib.AbstractContextManager:
    """FSDP1 keeps DDP's ``no_sync()`` (unsharded gradients accumulate until the final micro-step)."""
    return contextlib.nullcontext() if sync else model.no_sync()


def clip_grad_norm_(model: FSDP, max_norm: float) -> torch.Tensor:
    """FSDP1's own method: the norm over every rank's flat shard (``torch.nn.utils.clip_grad_norm_``
    would clip each rank by its own shard's norm)."""
    return model.clip_grad_norm_(max_norm)


def unwrap(model: FSDP) -> nn.Module:
    """The root module inside the outer wrapper (its blocks stay wrapped: use ``gathered`` for a copy)."""
    return model.module


gathered = fsdp.gathered  # the full state dict of either FSDP is keyed by the plain model's names
