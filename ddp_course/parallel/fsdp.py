"""FSDP2: ``fully_shard`` on each transformer block, then on the root.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=fsdp
    torchrun --standalone --nproc_per_node=4 -m ddp_course.train --strategy=fsdp --fsdp_shard_size=2

``fully_shard(module, mesh=...)`` replaces every parameter of ``module`` (those not already taken
by an inner call) by a :class:`~torch.distributed.tensor.DTensor` sharded on dim 0 over the mesh:
each rank keeps rows ``[r*c, (r+1)*c)`` of every tensor, with ``c = ceil(rows / shard ranks)``
(the last ranks may hold fewer real rows, or none; every rank's storage is padded up to ``c`` rows). The calls are bottom-up, so each block
is one *group*: one all-gather brings the whole block's parameters together before its forward,
one reduce-scatter hands each rank its shard of the block's gradients after its backward. The root
call takes what is left: the embeddings (tied with the output head), the final LayerNorm.

What a step costs, per block: an all-gather before forward; with ``reshard_after_forward`` (ZeRO-3)
the gathered copy is freed after the forward and gathered again in backward; without it (ZeRO-2-like)
it stays from forward to backward -- less communication, more memory. Then a reduce-scatter of the
gradients. Optimizer states are created from the sharded parameters, so AdamW's two moments are
sharded too. The root keeps its gathered parameters after forward (PyTorch's advice: the backward
starts with it, so freeing them would only mean gathering them again at once).

Options (``OPTIONS`` below, fields of ``TrainConfig``): ``reshard_after_forward``,
``fsdp_mixed_precision`` (``MixedPrecisionPolicy``: bf16 parameters for compute and all-gather,
gradients reduced in fp32, sharded parameters and optimizer kept fp32), ``fsdp_shard_size``
(hybrid sharding, HSDP: a 2-D mesh ``replicate x shard``; shards within a group of ranks, all-reduces
the gradient shards across groups), ``fsdp_cpu_offload`` (``CPUOffloadPolicy``, needs a GPU),
``activation_checkpointing`` (MiniGPT recomputes each block in backward; FSDP gathers the block
again for the recomputation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo

# its options, {name: (default, help, check)}: TrainConfig fields, listed under it by --help (lesson 09)
OPTIONS = {
    "reshard_after_forward": (True, "FSDP: free each block's gathered parameters after its forward (ZeRO-3); false "
                              "keeps them for backward (ZeRO-2-like)", None),
    "fsdp_mixed_precision": (False, "FSDP: compute with bf16 copies of the parameters, reduce gradients in fp32 "
                             "(MixedPrecisionPolicy)", None),
    "fsdp_shard_size": (0, "FSDP: ranks that split one copy of the model between them; 0 = all ranks; a divisor of "
                        "the world size = hybrid (replicate x shard)", "0 or more"),
    "fsdp_cpu_offload": (False, "FSDP: keep the sharded parameters, gradients and optimizer states in CPU memory "
                         "(needs a GPU)", None),
}
HELP_ORDER = 3  # its place in --help's list of strategies
# public, not hooks: its own, which other strategies (fsdp1, fsdp_tp) and a lesson's lab use, and the two of
# PyTorch it calls
HELPERS = ("shard", "shard_layout", "device_mesh", "mp_policy", "cpu_offload", "offload_policy", "plain_copy", "fully_shard",
           "init_device_mesh")


def shard_layout(info: DistInfo, cfg: TrainConfig) -> tuple[int, int]:
    """(replicas, shard ranks) for this world size: ``fsdp_shard_size`` ranks hold one copy of the model."""
    ws = info.world_size
    shard = cfg.fsdp_shard_size or ws
    if shard > ws or ws % shard:
        divisors = [d for d in range(1, ws + 1) if ws % d == 0]
        raise ConfigError(f"--fsdp_shard_size={cfg.fsdp_shard_size} does not divide the {ws} rank(s) of this job into "
                          f"equal shard groups; use 0 (shard over all ranks) or one of {divisors}.")
    return ws // shard, shard


def device_mesh(info: DistInfo, cfg: TrainConfig) -> DeviceMesh:
    """1-D mesh ``(shard,)`` over every rank, or 2-D ``(replicate, shard)`` for hybrid sharding.

    Ranks are laid out row by row: with 4 ranks and ``fsdp_shard_size=2``, ranks {0, 1} and {2, 3}
    each hold one sharded copy, and {0, 2}, {1, 3} are the replicas that all-reduce.
    """
    replicas, shard = shard_layout(info, cfg)
    if replicas == 1:
        return init_device_mesh(info.device.type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(info.device.type, (replicas, shard), mesh_dim_names=("replicate", "shard"))


def mp_policy(cfg: TrainConfig) -> MixedPrecisionPolicy:
    """bf16 for the gathered parameters (compute and all-gather), fp32 for the gradient reduction."""
    if not cfg.fsdp_mixed_precision:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def cpu_offload(info: DistInfo, cfg: TrainConfig) -> bool:
    """Whether to offload (``fsdp_cpu_offload``, FSDP2's and FSDP1's); refused on a job without GPUs."""
    if cfg.fsdp_cpu_offload and info.device.type != "cuda":
        raise ConfigError("--fsdp_cpu_offload moves the sharded parameters, gradients and optimizer states from the GPU "
                          "to CPU memory, and copies each block to the GPU for its compute. This job trains on the CPU, "
                          "where everything is in CPU memory already: drop --fsdp_cpu_offload, or run on GPUs.")
    return cfg.fsdp_cpu_offload


def offload_policy(info: DistInfo, cfg: TrainConfig) -> OffloadPolicy:
    """CPUOffloadPolicy with ``fsdp_cpu_offload`` (GPU jobs only), else the default (no offload)."""
    return CPUOffloadPolicy() if cpu_offload(info, cfg) else OffloadPolicy()


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """Shard ``model`` in place: ``fully_shard`` on each of ``model.blocks``, then on the root. Returns it.

    Collectives: none here (every rank shards its own identical copy: same seed, same init); the
    all-gathers and reduce-scatters happen in forward and backward.
    """
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        raise ConfigError(f"--strategy=fsdp shards each transformer block of `model.blocks`; {type(model).__name__} "
                          "has no such ModuleList.")
    return shard(model, model.blocks, reshard_after_forward=cfg.reshard_after_forward, mesh=device_mesh(info, cfg),
                 mp_policy=mp_policy(cfg), offload_policy=offload_policy(info, cfg))


def shard(root: nn.Module, blocks: Iterable[nn.Module], *, reshard_after_forward: bool = True, **options: Any
          ) -> nn.Module:
    """``fully_shard`` on each of ``blocks``, bottom-up (one all-gather / reduce-scatter group per block),
    then on ``root``, which takes the rest (the embeddings with the tied head, the final LayerNorm) and
    keeps its parameters from forward to backward. ``options``: ``fully_shard``'s (``mesh``, policies).
    fsdp, fsdp_tp and pipeline shard this way; returns ``root``."""
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(root, reshard_after_forward=False, **options)
    return root


@contextlib.contextmanager
def sync_context(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2 has no ``no_sync()``: ``set_requires_gradient_sync(False)`` skips the reduce-scatter (the
    unsharded gradients accumulate locally) until the final micro-step."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The gradients are DTensor shards, whose norm ``clip_grad_norm_`` reduces across ranks; the
    result is a DTensor too, returned as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor()


def gathered(model: nn.Module) -> nn.Module:
    """A plain MiniGPT with the full parameters (every rank all-gathers; every rank gets the copy).

    Also FSDP1's (``ddp_course.parallel.fsdp1``): the full state dict of either is keyed by the
    plain model's names.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return plain_copy(model, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def plain_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain MiniGPT of ``model``'s config holding the full state dict ``state`` (fsdp's and fsdp_tp's
    ``gathered``), built without drawing from the global RNG."""
    from ddp_course.model import MiniGPT

    with torch.random.fork_rng(devices=[]):  # building a model draws its initial weights: leave the RNG alone
        copy = MiniGPT(model.cfg).to(next(iter(state.values())).device)
    copy.load_state_dict(state)
    return copy
