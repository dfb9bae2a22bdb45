"""ZeRO-1: DDP with ``ZeroRedundancyOptimizer``, the optimizer state sharded over the ranks.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=zero1

The model is wrapped exactly as ``--strategy=ddp`` wraps it (same options, hooks, ``no_sync``): every
rank holds every parameter and, after DDP's all-reduce, every averaged gradient. Only the optimizer
differs. ``torch.distributed.optim.ZeroRedundancyOptimizer`` gives each parameter one owner (a greedy
partition of whole tensors by size, per parameter group); a rank builds AdamW over the parameters it
owns only, so it keeps 1/N of AdamW's two moments, steps its own parameters, and then broadcasts
them to the others. The arithmetic of each update is DDP's, so the weights follow DDP's.

A checkpoint holds the optimizer state in the same form as DDP's (keyed by parameter name, every
parameter's state; ``tests/core/test_checkpoint.py`` compares the two files entry by entry). Saving
first gathers every rank's part to rank 0 (``consolidate_state_dict``, a collective); loading gives
each rank the whole state, of which it keeps the part it owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.parallel import _optimizer, ddp

OPTIONS = ddp.OPTIONS  # its options (TrainConfig fields): the model is wrapped as --strategy=ddp wraps it

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

sync_context = ddp.sync_context  # the model is a DDP: no_sync() skips the all-reduce
unwrap = ddp.unwrap


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> DDP:
    """DistributedDataParallel, as ``--strategy=ddp`` builds it (the optimizer is where ZeRO-1 differs)."""
    return ddp.wrap(model, info, cfg)


def build_optimizer(model: DDP, cfg: Any, device: torch.device) -> ZeroRedundancyOptimizer:
    """The course's AdamW (same groups and settings as every strategy), its state sharded over the ranks."""
    return ZeroRedundancyOptimizer(_optimizer.decay_groups(model, cfg), optimizer_class=torch.optim.AdamW,
                                   **_optimizer.adamw_options(cfg, device))


def has_state(optimizer: ZeroRedundancyOptimizer) -> bool:
    """This rank's AdamW holds state once it has stepped (the wrapper's own ``state`` stays empty)."""
    return bool(optimizer.optim.state)


def _names(model: DDP, optimizer: ZeroRedundancyOptimizer) -> list[str]:
    """The parameter names in the optimizer's global order (its ``state_dict`` numbers them so)."""
    name_of = {id(p): name for name, p in unwrap(model).named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def state_dict(model: DDP, optimizer: ZeroRedundancyOptimizer, options: StateDictOptions | None
               ) -> tuple[dict, dict]:
    """The model's state and the whole optimizer state by parameter name, as for any other strategy.

    A collective: every rank's part is gathered to rank 0 (``consolidate_state_dict``). With
    ``full_state_dict`` and ``cpu_offload`` (what one checkpoint file holds) the states stay on rank 0,
    copied to the CPU, and the other ranks get empty ones, as ``get_state_dict`` does; otherwise rank 0
    broadcasts the whole state to every rank (a sharded checkpoint's planner writes each replicated
    tensor once).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model_sd = get_model_state_dict(model, options=options)
    on_rank0 = options is not None and options.full_state_dict and options.cpu_offload
    _create_state(optimizer)
    optimizer.consolidate_state_dict(to=0)  # every rank sends its part to rank 0
    indexed = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    if not on_rank0:
        dist.broadcast_object_list(indexed, src=0)
    if indexed[0] is None:
        return model_sd, {}
    names = _names(model, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in indexed[0]["param_groups"]]
    state = {names[i]: _to_cpu(s) if on_rank0 else s for i, s in indexed[0]["state"].items()}
    return model_sd, {"state": state, "param_groups": groups}


def _create_state(optimizer: ZeroRedundancyOptimizer) -> None:
    """Give a fresh optimizer its state (the structure a sharded checkpoint loads into), as
    ``get_state_dict`` does for a plain one: one step with zero gradients at learning rate 0 (a
    collective) leaves every parameter as it is, since AdamW scales its update and its decay by it."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if has_state(optimizer) or any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def load_state_dict(model: DDP, optimizer: ZeroRedundancyOptimizer, model_sd: dict, optim_sd: dict,
                    options: StateDictOptions | None) -> None:
    """Put the model's state back and hand each rank its part of the optimizer state (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, model_sd, options=options)
    index = {name: i for i, name in enumerate(_names(model, optimizer))}
    try:
        indexed = {"state": {index[name]: s for name, s in optim_sd["state"].items()},
                   "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim_sd["param_groups"]]}
    except KeyError as exc:
        raise ValueError(f"the optimizer state names a parameter this model does not have: {exc}") from None
    optimizer.load_state_dict(indexed)


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
