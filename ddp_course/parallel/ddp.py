"""DistributedDataParallel: one process per device, gradients averaged by all-reduce in backward.

DDP broadcasts rank 0's parameters and buffers when it wraps the model (so every replica starts
equal), registers autograd hooks that fill gradient buckets (``bucket_cap_mb``), and all-reduces
each bucket as soon as it is full, overlapping communication with the rest of the backward pass.

A *communication hook* replaces that all-reduce: DDP hands it one bucket (a flat tensor of
gradients) and expects a future of the averaged bucket back. Besides PyTorch's built-in fp16 hook,
this module holds two written for the course:

- :func:`bf16_hook` casts the bucket to bfloat16 for the wire. It is PyTorch's ``bf16_compress_hook``
  written out: the built-in one refuses to register unless CUDA with NCCL >= 2.10 is present, but
  gloo reduces bfloat16 too, so the course's version runs on CPU.
- :func:`int8_hook` quantises the bucket to 8-bit integers with one scale per rank and all-gathers
  them (integers summed across ranks would overflow 8 bits): 4x fewer bytes than float32 from each
  rank, at the price of ~1/254 of the bucket's largest gradient of rounding error per element.

Hooks are checked by DDP against their annotations (``bucket: dist.GradBucket``), so this module
keeps its annotations real objects: no ``from __future__ import annotations`` here.
"""

import contextlib
import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo

# its options, {name: (default, help, check)}: TrainConfig fields, listed under it by --help (lesson 05)
OPTIONS = {
    "bucket_cap_mb": (25.0, "gradient bucket size: one all-reduce per bucket", "positive"),
    "broadcast_buffers": (True, "DDP re-broadcasts rank 0's buffers before every forward", None),
    "find_unused_parameters": (False, "tolerate parameters that get no gradient (costs a graph walk)", None),
    "static_graph": (False, "promise the graph is the same every step (lets DDP optimise)", None),
    "comm_hook": ("none", "gradient compression on the wire: none | fp16 | bf16 | int8", ("none", "fp16", "bf16", "int8")),
}
HELP_ORDER = 2  # its place in --help's list of strategies

HELPERS = ("bf16_hook", "int8_hook", "comm_hook", "ddp_kwargs")  # public, not hooks: lessons 05 and 07 use them

INT8_LEVELS = 127  # int8 codes used: -127 .. 127 (symmetric, so 0 stays exactly 0)


class CommHookError(ValueError):
    """A communication hook cannot run on this backend. The message says what to use instead."""


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def bf16_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce (SUM) the bucket as bfloat16, divided by the world size first; decompress in place.

    One collective: ``all_reduce`` of ``bucket.numel()`` bfloat16 values (2 bytes each instead of 4).
    bfloat16 keeps float32's exponent range, so nothing overflows or underflows; it keeps 8 significant
    bits (7 stored), so each value is rounded to ~0.4 % (2^-8 relative).
    """
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())  # divide before the sum, as the built-in does

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # back to the gradient's dtype, in place (no second bucket in memory)
        return buffer

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def int8_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Quantise the bucket to int8 with a per-rank scale, all-gather, decode and average.

    Each rank sends ``numel`` int8 codes plus its float32 scale (``max |g|``), packed into one uint8
    tensor, with one all-gather (``all_gather_single``, formerly ``all_gather_into_tensor``). Every
    rank then decodes all ranks' codes and takes the mean. An all-reduce cannot be used for the
    codes: the sum of two int8 values can overflow.
    Rounding error per element, per rank: at most ``scale / 254`` (half a quantisation step).
    """
    group = _group(process_group)
    world = group.size()
    buffer = bucket.buffer()
    flat = buffer.detach().float()
    n = flat.numel()
    scale = flat.abs().max().clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero bucket stays zero
    codes = torch.round(flat / scale * INT8_LEVELS).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    packed = torch.empty(n + 4, dtype=torch.uint8, device=buffer.device)
    packed[:n] = codes.view(torch.uint8)
    packed[n:] = scale.reshape(1).view(torch.uint8)
    gathered = torch.empty(world * (n + 4), dtype=torch.uint8, device=buffer.device)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        rows = gathered.view(world, n + 4)
        q = rows[:, :n].contiguous().view(torch.int8).float()  # (world, n)
        scales = rows[:, n:].contiguous().view(torch.float32)  # (world, 1)
        buffer.copy_((q * (scales / INT8_LEVELS)).mean(dim=0))
        return buffer

    work = _all_gather_single(gathered, packed, group=group, async_op=True)
    return work.get_future().then(decode)


# PyTorch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook, "int8": int8_hook}


def comm_hook(name: str, backend: str | None) -> Callable[..., torch.futures.Future[torch.Tensor]] | None:
    """The hook for ``--comm_hook=name`` on this backend (None for ``none``: DDP's own all-reduce).

    On NCCL, bf16 uses PyTorch's built-in ``bf16_compress_hook`` (it checks the NCCL version); on gloo
    the course's :func:`bf16_hook` does the same arithmetic.
    """
    if name == "none":
        return None
    if name not in HOOKS:
        raise CommHookError(f"--comm_hook={name!r} is not a hook; choose one of none, {', '.join(HOOKS)}.")
    if name == "bf16" and backend == "nccl":
        return default_hooks.bf16_compress_hook
    return HOOKS[name]


def ddp_kwargs(cfg: TrainConfig) -> dict:
    """DDP's keyword arguments for this config (the DDP options of lesson 05)."""
    options = {"bucket_cap_mb": cfg.bucket_cap_mb, "find_unused_parameters": cfg.find_unused_parameters,
               "static_graph": cfg.static_graph}
    if not cfg.broadcast_buffers:
        # Newer PyTorch renamed the per-forward buffer broadcast to `forward_sync_buffers` and warns
        # about the old name. Neither re-broadcasts the buffers before each forward when False. They
        # differ at wrap time: `forward_sync_buffers=False` still broadcasts the buffers once there
        # (`init_sync_buffers = True` in DistributedDataParallel.__init__, torch/nn/parallel/
        # distributed.py), the old `broadcast_buffers=False` does not (it is passed on as the
        # `broadcast_buffers` of `_sync_module_states`). MiniGPT has no buffers, so the course's runs
        # are the same either way.
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
            options["forward_sync_buffers"] = False
        else:
            options["broadcast_buffers"] = False
    return options


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """DistributedDataParallel with the config's DDP options and communication hook (needs a process group)."""
    hook = comm_hook(cfg.comm_hook, info.backend)  # refuse a bad hook before DDP's first broadcast
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids, **ddp_kwargs(cfg))
    if hook is not None:
        # compress each bucket for the all-reduce, then back to the gradient's dtype
        ddp.register_comm_hook(state=None, hook=hook)
    return ddp


def sync_context(model: DDP, sync: bool) -> contextlib.AbstractContextManager:
    """``model.no_sync()`` for a micro-step that must not all-reduce (DDP reads it when the forward runs)."""
    return contextlib.nullcontext() if sync else model.no_sync()


def unwrap(model: DDP) -> nn.Module:
    """The module DDP wraps."""
    return model.module
