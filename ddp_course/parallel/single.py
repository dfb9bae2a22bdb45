"""One process, one device: the baseline every other strategy is compared against."""

from __future__ import annotations

import torch.nn as nn


def wrap(model: nn.Module, info, cfg) -> nn.Module:
    if info.world_size > 1:
        raise ValueError(f"--strategy=single runs one process, but this job has {info.world_size} ranks: "
                         "every rank would train its own model. Use --strategy=ddp with torchrun, "
                         "or launch one process.")
    return model
