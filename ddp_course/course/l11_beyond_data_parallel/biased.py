"""The model of exercise 11 (the MLP split by hand) and of its grader: a tiny MiniGPT with random biases.

Kept apart from ``tp_lab`` on purpose: the exercise's script imports this module, and nothing here
knows how the MLP is split (the lab's ``hidden_block`` would be the exercise's slicing, done).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddp_course.course.tiny import tiny_model
from ddp_course.model import MiniGPT


def biased_model(seed: int = 0, **shape: int) -> MiniGPT:
    """``tiny_model(seed, **shape)`` with the bias of every linear layer drawn at random (std 0.02), the same in every process.

    MiniGPT starts with zero biases, which would hide a bias added on every rank instead of once.
    """
    model = tiny_model(seed, **shape)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.02 * torch.randn(m.bias.shape, generator=g))
    return model
