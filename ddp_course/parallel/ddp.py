"""DistributedDataParallel: one process per device, gradients averaged by all-reduce in backward.

DDP broadcasts rank 0's parameters and buffers when it wraps the model (so every replica starts
equal), registers autograd hooks that fill gradient buckets (``bucket_cap_mb``), and all-reduces
each bucket as soon as it is full, overlapping communication with the rest of the backward pass.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def wrap(model: nn.Module, info, cfg) -> nn.Module:
    if not info.is_distributed:
        raise ValueError("--strategy=ddp needs a process group: launch with "
                         "`torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=ddp` "
                         "(or ddp_course.launch.run(..., nproc=2)).")
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    options = {}
    if not cfg.broadcast_buffers:  # passed only when changed: newer torch versions renamed it
        options["broadcast_buffers"] = False
    ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb,
              find_unused_parameters=cfg.find_unused_parameters, static_graph=cfg.static_graph, **options)
    if cfg.comm_hook != "none":
        # compress each bucket to 16 bits for the all-reduce, then back to the gradient's dtype
        ddp.register_comm_hook(state=None, hook=COMM_HOOKS[cfg.comm_hook])
    return ddp
