"""DistributedDataParallel: one process per device, gradients averaged by all-reduce in backward.

DDP broadcasts rank 0's parameters and buffers when it wraps the model (so every replica starts
equal), registers autograd hooks that fill gradient buckets, and all-reduces each bucket as soon as
it is full, overlapping communication with the rest of the backward pass.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(model: nn.Module, info, cfg) -> nn.Module:
    if not info.is_distributed:
        raise ValueError("--strategy=ddp needs a process group: launch with "
                         "`torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=ddp` "
                         "(or ddp_course.launch.run(..., nproc=2)).")
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)
