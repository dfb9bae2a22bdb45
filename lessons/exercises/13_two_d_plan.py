"""Exercise 13 -- the 2-D plan: FSDP2 over the data-parallel ranks, tensor and sequence parallelism inside
each block, on 4 ranks.

Complete ``make_mesh`` (the 2 x 2 mesh of the 4 ranks, its dimensions named ``"dp"`` and ``"tp"``) and
``parallelize`` (which module of MiniGPT gets which parallel style over ``tp``, with sequence
parallelism for the LayerNorms and the residual stream, then FSDP over ``dp``: each block, then the
root). The head split of the attention is given (``prepare_attention``: the fused qkv's rows reordered
so that each rank's column shard holds q, k and v of its own heads); the rest is yours.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=4 lessons/exercises/13_two_d_plan.py

The harness below trains your split model and a one-process MiniGPT side by side from the same
weights on the same global batches (each data-parallel group gets its half), compares every step's
loss, every gradient of the first step and the weights at the end, counts the collectives of the
first step by mesh dimension, and prints PASS or FAIL on every rank. The course's grader runs it the
same way and names what went wrong:

    python -m ddp_course check 13 lessons/exercises/13_two_d_plan.py
"""

import json
import sys

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ddp_course.course.l13_two_dimensions.two_d_harness import report, train_side_by_side
from ddp_course.course.tiny import tiny_model
from ddp_course.dist import setup
from ddp_course.model import MiniGPT
from ddp_course.parallel._tensor_parallel import HeadParallelAttention, rearrange_qkv

SHAPE = {"block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32}
TP, BATCH_SIZE, STEPS, LR, SEED = 2, 8, 3, 3e-3, 0


def prepare_attention(model: MiniGPT, tp: int) -> None:
    """Given: the attention of every block split by heads over ``tp`` ranks (lesson 11's head split)."""
    for block in model.blocks:
        rearrange_qkv(block.attn, tp)
        block.attn = HeadParallelAttention(block.attn, tp)


def make_mesh(world_size: int) -> DeviceMesh:
    """The ranks as a 2-D mesh: ``world_size // TP`` rows (``"dp"``) of ``TP`` ranks (``"tp"``)."""
    # TODO: a 2-D CPU mesh of world_size // TP by TP ranks, its dimensions named "dp" and "tp"
    raise NotImplementedError("exercise: complete this part")


def parallelize(model: MiniGPT, mesh: DeviceMesh) -> nn.Module:
    """Tensor and sequence parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``; returns the model."""
    prepare_attention(model, mesh["tp"].size())
    # TODO: per block a plan over mesh["tp"] (norms, attention, MLP), one for the model around the blocks; then fully_shard over mesh["dp"]: each block, then the model
    raise NotImplementedError("exercise: complete this part")


def main() -> None:
    with setup(device="cpu") as info:
        mesh = make_mesh(info.world_size)
        result = train_side_by_side(lambda: tiny_model(SEED, **SHAPE), parallelize, mesh, info, tp=TP,
                                    batch_size=BATCH_SIZE, steps=STEPS, lr=LR, seed=SEED)
        ok = report(result, info)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
