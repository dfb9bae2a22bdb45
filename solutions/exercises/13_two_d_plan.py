"""Exercise 13 -- the 2-D plan: FSDP2 over the data-parallel ranks, tensor and sequence parallelism inside
each block, on 4 ranks.

Complete ``make_mesh`` (the 4 ranks as a 2 x 2 mesh, its dimensions named ``"dp"`` and ``"tp"``, each
tensor-parallel group made of ranks that a real machine puts on one node) and ``parallelize`` (which
module of MiniGPT gets which parallel style over ``tp``, with sequence parallelism for the LayerNorms
and the residual stream, and FSDP2 over ``dp`` -- in which order is for you to find). The head split of
the attention is given (``prepare_attention``: the fused qkv's rows reordered so that each rank's column
shard holds q, k and v of its own heads); the rest is yours.

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
    """The ranks as a 2-D mesh with dimensions ``"dp"`` and ``"tp"`` (``TP`` ranks per tensor-parallel group)."""
    # BEGIN SOLUTION hint: a 2-D CPU mesh of the world_size ranks, TP of them in each "tp" group, its dimensions named "dp" and "tp"; a "tp" group must be consecutive ranks (one node)
    return init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
    # END SOLUTION


def parallelize(model: MiniGPT, mesh: DeviceMesh) -> nn.Module:
    """Tensor and sequence parallelism over ``mesh["tp"]`` and FSDP2 over ``mesh["dp"]``; returns the model."""
    prepare_attention(model, mesh["tp"].size())
    # BEGIN SOLUTION hint: a plan over mesh["tp"] for each block (its norms, attention, MLP) and one for the modules around the blocks, and FSDP2 over mesh["dp"] -- which of the two must come first?
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "ln1": SequenceParallel(), "attn": gather,
            "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp": gather,
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(model, mesh["tp"], {
        "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "ln_f": SequenceParallel(),
        "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True),
    })
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
    # END SOLUTION


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
