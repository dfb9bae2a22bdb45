"""One process, one device: the baseline every other strategy is compared against."""

from __future__ import annotations

import torch.nn as nn

from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo

NEEDS_PROCESS_GROUP = False  # one process; every other hook is the default (ddp_course/parallel/__init__.py)


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """The model itself; refuses a job of several ranks (each would train a model of its own)."""
    if info.world_size > 1:
        raise ValueError(f"--strategy=single runs one process, but this job has {info.world_size} ranks: "
                         "every rank would train its own model. Use --strategy=ddp with torchrun, "
                         "or launch one process.")
    return model
