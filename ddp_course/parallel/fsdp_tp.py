"""Two dimensions at once: FSDP2 over the data-parallel ranks, tensor parallelism inside each block.

The ranks form a 2-D mesh ``(dp, tp)`` with ``tp = --tp`` (a divisor of the world size) and
``dp = world size / tp``, laid out row by row: ranks ``[d * tp, (d + 1) * tp)`` are one tensor-parallel
group, and they see the same batch; the ``dp`` groups see different batches (:func:`data_parallel`).

Inside a tensor-parallel group (``ddp_course.parallel._tp_plan``): every block's attention is
split by heads and its MLP by hidden units (``qkv`` and ``mlp.fc`` column-wise, the two ``proj``
row-wise), and with sequence parallelism the LayerNorms and the residual stream between blocks hold
a slice of the sequence each: every block all-gathers the sequence before its attention and its MLP
and reduce-scatters their outputs. Then FSDP2 shards every parameter over the data-parallel ranks
(``fully_shard`` on each block over ``mesh["dp"]``, then the root): a parameter that tensor
parallelism already split is split again, so each rank holds 1 / world size of it.

Per step: over ``tp``, in each block two all-gathers and two reduce-scatters of activations in
forward, and the same in backward (the gradients of the sequence travel the other way); over ``dp``,
FSDP's all-gathers of the parameter shards and reduce-scatters of the gradients.

Checkpoints mean the same weights whatever the mesh: the fused ``qkv`` rows, reordered for the head
split, are put back in the model's own order in every state dict this strategy hands out, and
reordered again when one comes in. So a checkpoint of ``--strategy=fsdp_tp --tp=2`` on 4 ranks loads
into ``--strategy=fsdp`` on 4 ranks, into one process, or into another ``--tp``.

Option: ``--tp`` (tensor-parallel ranks; ``n_head``, ``n_embd`` and ``block_size`` must divide by it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.parallel import _tensor_parallel as heads
from ddp_course.parallel import _tp_plan as tp_plan
from ddp_course.parallel import fsdp

# its options, {name: (default, help, check)}: TrainConfig fields, listed under it by --help (lesson 13)
OPTIONS = {
    "tp": (1, "fsdp_tp: tensor-parallel ranks (heads, width and sequence split over them); the data-parallel size "
           "is the world size / tp", "at least 1"),
    "reshard_after_forward": fsdp.OPTIONS["reshard_after_forward"],
    "fsdp_mixed_precision": fsdp.OPTIONS["fsdp_mixed_precision"],
}
TWO_RANKS = {"tp": 2}  # what it needs to run on 2 ranks (tests/core/test_every_strategy.py): a 1 x 2 mesh
HELP_ORDER = 5  # its place in --help's list of strategies

HELPERS = ("layout", "device_mesh", "init_device_mesh")  # public, not hooks: lesson 13 uses the first two

LAUNCH_EXAMPLE = "--nproc_per_node=4 -m ddp_course.train --strategy=fsdp_tp --tp=2"  # what the refusal without torchrun suggests


def layout(world_size: int, cfg: TrainConfig) -> tuple[int, int]:
    """(dp, tp) for this world size; a ConfigError when ``--tp`` does not divide it or the model."""
    tp = cfg.tp
    if tp < 1 or world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"--tp={tp} does not divide the {world_size} rank(s) of this job into equal tensor-parallel "
                          f"groups; use one of {divisors} (the data-parallel size is the world size / tp).")
    bad = tp_plan.indivisible(cfg, tp)
    if bad:
        raise ConfigError(f"--strategy=fsdp_tp splits the heads, the width and (sequence parallelism) the sequence "
                          f"over --tp={tp} ranks, but --{bad[0]}={bad[1]} does not divide by {tp}.")
    return world_size // tp, tp


def data_parallel(rank: int, world_size: int, cfg: TrainConfig) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): the ranks of one tensor-parallel group share a batch."""
    dp, tp = layout(world_size, cfg)
    return rank // tp, dp


def device_mesh(info: DistInfo, cfg: TrainConfig) -> DeviceMesh:
    """The 2-D mesh ``(dp, tp)``: rows of ``tp`` consecutive ranks."""
    dp, tp = layout(info.world_size, cfg)
    return init_device_mesh(info.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig, *, state: dict[str, Any]) -> nn.Module:
    """Tensor (and sequence) parallel inside each block over ``tp``, then FSDP2 over ``dp``, in place.
    The plan's ``state`` keeps the tensor-parallel size: the state dicts need it to put the qkv rows back."""
    mesh = device_mesh(info, cfg)
    heads.quiet_sequential_redistribution()
    tp_plan.tensor_parallel(model, mesh["tp"], sequence_parallel=True)
    fsdp.shard(model, model.blocks, reshard_after_forward=cfg.reshard_after_forward, mesh=mesh["dp"],
               mp_policy=fsdp.mp_policy(cfg))  # the order of lesson 09: each block one unit, then the root
    state["tp"] = mesh["tp"].size()
    return model


# FSDP's own: no reduce-scatter over ``dp`` until the final micro-step (tensor parallelism's collectives
# are part of every forward and backward, and run regardless)
sync_context = fsdp.sync_context


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm over every rank's shards, then the clip.

    The parameters live on two meshes: those tensor parallelism splits (or replicates for sequence
    parallelism) on ``(dp, tp)``, the embeddings and the tied head on ``dp`` alone. Each parameter's
    norm is taken whole (``full_tensor``: a collective over its own mesh), so a parameter that is
    replicated over ``tp`` counts once."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(g).full_tensor() if isinstance(g, DTensor) else torch.linalg.vector_norm(g)
             for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_ does
    for g in grads:
        g.mul_(coef)
    return total


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, options: Any = None, *,
               state: dict[str, Any]) -> tuple[dict, dict]:
    """DCP's state dicts, with the qkv rows (and their AdamW moments) in the model's own order."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    tp = state["tp"]
    return (heads.natural_rows(model_sd, model.cfg.n_embd, tp),
            heads.optimizer_rows(optim_sd, heads.natural_rows, model.cfg.n_embd, tp))


def load_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                    options: Any = None, *, state: dict[str, Any]) -> None:
    """The inverse of :func:`state_dict`: the qkv rows back in the tensor-parallel order, then DCP's."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_sd = heads.tp_rows(model_sd, model.cfg.n_embd, state["tp"])
    optim_sd = heads.optimizer_rows(optim_sd, heads.tp_rows, model.cfg.n_embd, state["tp"])
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def model_state_dict(model: nn.Module, options: Any = None, *, state: dict[str, Any]) -> dict:
    """The model's state dict alone (``final.pt``, fingerprints), the qkv rows in the model's own order."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return heads.natural_rows(get_model_state_dict(model, options=options), model.cfg.n_embd, state["tp"])


def gathered(model: nn.Module, *, state: dict[str, Any]) -> nn.Module:
    """A plain MiniGPT with the full parameters in the model's own order (a collective: every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return fsdp.plain_copy(model, model_state_dict(model, StateDictOptions(full_state_dict=True), state=state))
