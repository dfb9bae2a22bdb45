"""Memory per rank: predicted from the configuration, then measured in a real run.

    from ddp_course.course.l09_fsdp.memory import predict
    predict("fsdp", world_size=4, shape={"vocab_size": 65, "block_size": 64, "n_layer": 2, "n_head": 4,
            "n_embd": 128}, micro_batch_size=8)   # one dict per rank

What a rank holds while it trains (AdamW, fp32 master weights):

- ``params``: DDP keeps all P parameters; FSDP keeps its shard of each. FSDP2 shards every tensor on
  dim 0 in chunks of ``ceil(rows / N)`` rows (``torch.chunk``) and pads the last chunk's *storage*
  to that size, so a tensor whose rows do not divide by N costs a little more than 1/N.
  FSDP1 concatenates each unit's tensors into one flat vector (each tensor aligned to 16 bytes),
  pads it to a multiple of N and gives every rank one N-th.
- ``grads``: the same layout as the parameters (FSDP's reduce-scatter writes into a padded buffer).
- ``zero1`` (ZeRO stage 1: exercise 09's second part, ``torch.distributed.optim.ZeroRedundancyOptimizer``)
  keeps every parameter and gradient on every rank, as DDP does, and shards only the optimizer: each
  parameter, whole, has one owner that keeps its AdamW state. The owners are chosen greedily by
  size (:func:`zero1_partition`), so a rank's share is 1/N of the state give or take part of one
  tensor, and nothing is padded.
- ``optimizer``: AdamW's two fp32 moments per parameter element, created from the (sharded)
  parameters -- *without* the padding: a shard's moments have its real size -- plus one fp32
  ``step`` counter per parameter tensor, which nothing shards.
- ``activations``: what autograd keeps from the forward for the backward; it depends on the
  micro-batch on each rank, not on the strategy. :func:`activation_bytes` counts it tensor by
  tensor for MiniGPT (the counts are in its docstring).

``padding`` is what a rank's parameters, gradients and optimizer states take beyond an exact 1/N of
DDP's: padded rows, plus the unsharded step counters, minus what the last ranks' shorter shards save.
For ``zero1`` it is what the rank's optimizer state takes beyond 1/N of DDP's (whole tensors do not
split evenly: positive on some ranks, negative on others).

:func:`measure_states` and :func:`saved_activations` measure the same quantities in a live process:
the bytes of the distinct storages behind the parameters (``DTensor.to_local()`` for FSDP2), the
gradients and the optimizer states, and the tensors autograd saves during a forward. On a GPU,
:func:`cuda_memory` adds the caching allocator's figures.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

STRATEGIES = ("single", "ddp", "zero1", "fsdp", "fsdp1")
FP32 = 4


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor: its name, shape and the FSDP unit (one block, or the root) it belongs to."""

    name: str
    shape: tuple[int, ...]
    unit: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


SHAPE_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


def parameter_table(shape: dict[str, int]) -> list[Tensor]:
    """MiniGPT's parameter tensors in registration order (the tied head counted once), built on ``meta``."""
    return list(_table(tuple(shape[k] for k in SHAPE_KEYS)))


@functools.lru_cache(maxsize=16)
def _table(key: tuple[int, ...]) -> tuple[Tensor, ...]:
    from ddp_course.model import GPTConfig, MiniGPT

    with torch.device("meta"):  # shapes only: no memory, no initialisation worth the name
        model = MiniGPT(GPTConfig(**dict(zip(SHAPE_KEYS, key))))
    out = []
    for name, p in model.named_parameters():  # named_parameters() skips the tied head.weight
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        out.append(Tensor(name, tuple(p.shape), unit))
    return tuple(out)


def zero1_partition(numels: list[int], world_size: int, groups: list[int] | None = None) -> list[list[int]]:
    """ZeRO-1's owners: ``shards[r]`` lists the indices of the tensors rank r owns (and steps).

    Sorted greedy, the rule of ``torch.distributed.optim.ZeroRedundancyOptimizer``: the tensors from
    the largest down (a stable sort, so equal sizes keep their order), each to the rank that owns the
    fewest elements so far (the lowest rank on a tie). No two ranks then differ by more than the
    largest tensor. ``groups`` (a parameter group per tensor): the library sorts and deals one group
    after the other, the elements owned carried from group to group.
    """
    groups = groups if groups is not None else [0] * len(numels)
    shards: list[list[int]] = [[] for _ in range(world_size)]
    owned = [0] * world_size
    for group in sorted(set(groups)):
        mine = [i for i in range(len(numels)) if groups[i] == group]
        for i in sorted(mine, key=lambda i: numels[i], reverse=True):
            rank = owned.index(min(owned))
            shards[rank].append(i)
            owned[rank] += numels[i]
    return shards


def decay_group(t: Tensor) -> int:
    """The course's AdamW group of a tensor: 0 for matrices (weight decay), 1 for the rest."""
    return 0 if len(t.shape) >= 2 else 1


def _zero1_states(table: list[Tensor], world_size: int, rank: int, decay_groups: bool) -> dict[str, int]:
    params = sum(t.numel for t in table) * FP32
    groups = [decay_group(t) for t in table] if decay_groups else None
    mine = [table[i] for i in zero1_partition([t.numel for t in table], world_size, groups)[rank]]
    return {"params": params, "grads": params, "optimizer": sum(2 * t.numel * FP32 + FP32 for t in mine)}


def _fsdp2_states(table: list[Tensor], shard: int, s: int) -> dict[str, int]:
    params = optim = 0
    for t in table:
        rows, rest = t.shape[0], t.numel // t.shape[0]
        chunk = math.ceil(rows / shard)  # torch.chunk's chunk size: every rank's storage has this many rows
        mine = max(0, min(chunk, rows - s * chunk))  # the real rows of shard s (the last ones may be short)
        params += chunk * rest * FP32
        optim += 2 * mine * rest * FP32 + FP32  # exp_avg, exp_avg_sq of the real rows; the step counter
    return {"params": params, "grads": params, "optimizer": optim}


def fsdp1_flat_layout(table: list[Tensor], shard: int, align: int) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Per FSDP1 unit: (padded flat length, [(start, end) of each tensor]) with FSDP1's alignment and padding."""
    units: dict[str, list[Tensor]] = {}
    for t in table:
        units.setdefault(t.unit, []).append(t)
    out = {}
    for unit, tensors in units.items():
        offset, spans = 0, []
        for t in tensors:
            offset += (-offset) % align  # each tensor starts on a 16-byte boundary (use_orig_params=True)
            spans.append((offset, offset + t.numel))
            offset += t.numel
        out[unit] = (math.ceil(offset / shard) * shard, spans)  # padded to a multiple of the shard ranks
    return out


def _fsdp1_states(table: list[Tensor], shard: int, s: int, compute_bytes: int) -> dict[str, int]:
    params = optim = 0
    for length, spans in fsdp1_flat_layout(table, shard, 16 // compute_bytes).values():
        per_rank = length // shard
        lo, hi = s * per_rank, (s + 1) * per_rank
        params += per_rank * FP32
        for start, end in spans:
            mine = max(0, min(end, hi) - max(start, lo))
            if mine:  # a tensor with no element on this rank gets no gradient, so AdamW keeps no state
                optim += 2 * mine * FP32 + FP32
    return {"params": params, "grads": params, "optimizer": optim}


def activation_bytes(shape: dict[str, int], micro_batch_size: int, *, compute_bytes: int = FP32,
                     activation_checkpointing: bool = False, device_type: str = "cpu") -> int:
    """Bytes autograd keeps from one MiniGPT forward for its backward (counted per distinct storage).

    With B = micro-batch, T = block_size, C = n_embd, V = vocabulary, L = blocks, e = bytes per
    element of the compute dtype:

    - per block, 16 (B, T, C) tensors: the block input, LayerNorm 1's output, the (B, T, 3C) qkv
      output (q, k and v are views of it), the attention output (SDPA's fused kernels lay it out as
      (B, T, nh, hs), so the projection's input is the same storage), the residual sum, LayerNorm 2's
      output, the MLP's (B, T, 4C) hidden layer before and after GELU; plus two (B, T) LayerNorm
      statistics per LayerNorm (compute dtype on the CPU, fp32 on CUDA) and SDPA's fp32 log-sum-exp
      (B, nh, T);
    - once: the final LayerNorm's input and output (2 x (B, T, C)) and statistics, the fp32
      log-softmax of the logits (B, T, V), the int64 token ids, targets and positions, and the loss's
      fp32 weight total.

    With activation checkpointing each block keeps only its input (1 instead of 16 (B, T, C) tensors,
    no statistics); the block's other activations are recomputed during backward, one block at a time.
    """
    B, T, C, V = micro_batch_size, shape["block_size"], shape["n_embd"], shape["vocab_size"]
    L, nh = shape["n_layer"], shape["n_head"]
    stat = compute_bytes if device_type == "cpu" else FP32
    per_block = 1 * B * T * C * compute_bytes if activation_checkpointing else (
        16 * B * T * C * compute_bytes + 2 * 2 * B * T * stat + B * nh * T * FP32)
    once = 2 * B * T * C * compute_bytes + 2 * B * T * stat + B * T * V * FP32 + (2 * B * T + T) * 8 + FP32
    return L * per_block + once


def predict(strategy: str, world_size: int, shape: dict[str, int], *, micro_batch_size: int = 16,
            reshard_after_forward: bool = True, fsdp_shard_size: int = 0, mixed_precision: bool = False,
            activation_checkpointing: bool = False, device_type: str = "cpu", decay_groups: bool = False
            ) -> list[dict]:
    """Predicted bytes on each rank (one dict per rank) for ``strategy`` at ``world_size``.

    ``decay_groups`` (``zero1``): the optimizer has the course's two parameter groups (matrices with
    weight decay, the rest without), as ``--strategy=zero1`` builds it; without, one group of every
    parameter, as exercise 09 builds it.

    Keys: ``rank``, ``params``, ``grads``, ``optimizer``, ``states`` (their sum), ``activations``,
    ``padding`` (``states`` minus an exact 1/N of DDP's, N = ranks sharing one copy; for ``zero1``,
    minus DDP's parameters and gradients and 1/N of its optimizer state),
    ``gathered`` (FSDP: full parameters held at once during the step, in the compute dtype: one
    block at a time plus the root with ``reshard_after_forward``, every unit without it).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} has no memory model; choose one of {', '.join(STRATEGIES)}.")
    table = parameter_table(shape)
    n_params = sum(t.numel for t in table)
    compute = 2 if mixed_precision and strategy in ("fsdp", "fsdp1") else FP32
    shard = (fsdp_shard_size or world_size) if strategy in ("fsdp", "fsdp1") else world_size if strategy == "zero1" else 1
    if world_size % shard:
        raise ValueError(f"fsdp_shard_size={fsdp_shard_size} does not divide world_size={world_size}.")
    replicated = {"params": n_params * FP32, "grads": n_params * FP32,
                  "optimizer": 2 * n_params * FP32 + len(table) * FP32}
    acts = activation_bytes(shape, micro_batch_size, compute_bytes=compute,
                            activation_checkpointing=activation_checkpointing, device_type=device_type)
    unit_bytes: dict[str, int] = {}
    for t in table:
        unit_bytes[t.unit] = unit_bytes.get(t.unit, 0) + t.numel * compute
    blocks = [v for k, v in unit_bytes.items() if k != "root"]
    rows = []
    for rank in range(world_size):
        s = rank % shard  # index in its shard group: ranks are laid out row by row on (replicate, shard)
        if strategy == "fsdp":
            states = _fsdp2_states(table, shard, s)
        elif strategy == "fsdp1":
            states = _fsdp1_states(table, shard, s, compute)
        elif strategy == "zero1":
            states = _zero1_states(table, world_size, rank, decay_groups)
        else:
            states = dict(replicated)
        total = states["params"] + states["grads"] + states["optimizer"]
        exact = sum(replicated.values()) / shard
        if strategy == "zero1":  # only the optimizer state is divided
            exact = replicated["params"] + replicated["grads"] + replicated["optimizer"] / world_size
        if strategy in ("fsdp", "fsdp1"):
            gathered = unit_bytes["root"] + (max(blocks) if reshard_after_forward else sum(blocks))
        else:
            gathered = 0
        rows.append({"strategy": strategy, "world_size": world_size, "rank": rank, "shard_ranks": shard, **states,
                     "states": total, "padding": total - exact, "activations": acts, "gathered": gathered})
    return rows


def predict_cfg(cfg, world_size: int, vocab_size: int, device_type: str = "cpu") -> list[dict]:
    """:func:`predict` for a :class:`~ddp_course.config.TrainConfig` (its strategy and FSDP options)."""
    shape = {"vocab_size": vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
             "n_embd": cfg.n_embd}
    return predict(cfg.strategy, world_size, shape, micro_batch_size=cfg.micro_batch_size,
                   reshard_after_forward=cfg.reshard_after_forward, fsdp_shard_size=cfg.fsdp_shard_size,
                   mixed_precision=cfg.fsdp_mixed_precision, activation_checkpointing=cfg.activation_checkpointing,
                   device_type=device_type, decay_groups=True)


# --- measuring ---------------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def measure_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds now for parameters, gradients and optimizer states (distinct storages).

    Call it after an optimizer step (FSDP has resharded, AdamW has created its states) and before
    ``zero_grad`` (the gradients still exist).
    """
    params = list(model.parameters())
    out = {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params)}
    if optimizer is not None:
        # ZeroRedundancyOptimizer keeps this rank's AdamW (over the parameters it owns) in .optim
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        out["optimizer"] = _storage_bytes(v for st in local.state.values() for v in st.values()
                                          if isinstance(v, torch.Tensor))
    out["states"] = sum(out.values())
    return out


def local_shapes(model: torch.nn.Module) -> dict[str, dict]:
    """Per parameter: the full shape, this rank's shape and its storage's elements (padding included)."""
    out = {}
    for name, p in model.named_parameters():
        loc = _local(p)
        out[name] = {"full": list(p.shape), "local": list(loc.shape), "local_numel": loc.numel(),
                     "storage_numel": loc.untyped_storage().nbytes() // loc.element_size()}
    return out


class SavedActivations:
    """Bytes of the tensors autograd saved for backward so far (parameters excluded), by storage.

    A parameter is recognised as a leaf that requires grad, or a view of one; and, for a split model,
    by its storage: a DTensor parameter's transposed local view (what a linear layer saves) is not a
    view of the parameter object itself, so ``params`` lists the parameters whose storages to leave out.
    """

    def __init__(self, params=()) -> None:
        self._seen: dict[int, int] = {}
        self._params = {_local(p).untyped_storage().data_ptr() for p in params}

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # a parameter (or a view of one) is not an activation
            s = _local(t).untyped_storage()  # a DTensor (sequence parallelism's) keeps this rank's part
            if s.data_ptr() not in self._params:
                self._seen[s.data_ptr()] = max(self._seen.get(s.data_ptr(), 0), s.nbytes())
        return t


@contextlib.contextmanager
def saved_activations(params=()):
    """``with saved_activations() as acts: loss = model(x, y)[1]``, then ``acts.bytes``; ``params``:
    the model's parameters, to leave out their storages whatever view of them is saved."""
    acts = SavedActivations(params)
    with torch.autograd.graph.saved_tensors_hooks(acts.pack, lambda t: t):
        yield acts


def cuda_memory(device: torch.device) -> dict[str, int] | None:
    """The CUDA caching allocator's current and peak allocated bytes (None off the GPU)."""
    if device.type != "cuda":
        return None
    return {"allocated": int(torch.cuda.memory_allocated(device)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device))}
