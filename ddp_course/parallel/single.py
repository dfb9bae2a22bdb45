"""One process, one device: the baseline every other strategy is compared against."""

from __future__ import annotations

import torch.nn as nn

from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo

NEEDS_PROCESS_GROUP = False  # one process; every other hook is the default (ddp_course/parallel/__init__.py)
HELP_ORDER = 0  # its place in --help's list of strategies


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """The model itself (a job of several ranks is refused before: ``Strategy.refusal``)."""
    return model
