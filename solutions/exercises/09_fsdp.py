"""Exercise 09 -- shard MiniGPT with FSDP2's ``fully_shard``.

Complete ``shard`` so that the model is sharded over the ranks of ``mesh`` the way the course's
``strategy=fsdp`` does it: one FSDP unit per transformer block (so that one block at a time is
gathered in full), and one for the root, with the embeddings (tied with the output head) and the
final LayerNorm. ``fully_shard`` changes the module in place and returns it.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/09_fsdp.py

The harness below trains your sharded model and a DDP copy side by side from the same weights on
the same batches, checks that they end with the same parameters, that each rank holds about 1/N of
the parameter bytes and that the first forward gathers no more than one block at a time (besides
the root), and prints PASS or FAIL on every rank. The course's grader runs it the
same way, compares with a reference of its own and explains what is wrong:

    python -m ddp_course check 09 lessons/exercises/09_fsdp.py
"""

import contextlib
import json
import sys

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.course.l05_inside_ddp.ddp_common import CollectiveCounter
from ddp_course.course.tiny import micro_batch, tiny_model
from ddp_course.dist import all_reduce_mean, log, setup
from ddp_course.model import MiniGPT

SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
MICRO_BATCH_SIZE, STEPS, LR, SEED = 4, 4, 1e-3, 0
# the sharded and the DDP copy differ in the last bits only (a gradient norm summed shard by shard for
# clipping, the same gradients reduced another way): ~1e-6 after a few steps, printed as the max
# difference. LR / 100 leaves a wide margin above it. (A gradient summed but not averaged would move
# the parameters much less than LR: AdamW's step hardly depends on a gradient's size, lesson 04 section 6.)
TOLERANCE = LR / 100


def shard(model: MiniGPT, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` over ``mesh`` with fully_shard: one unit per block of ``model.blocks`` and one for the
    root (the model itself). Returns the model."""
    # BEGIN SOLUTION hint: the FSDP units over mesh: every transformer block, and the model itself; return the model
    for block in model.blocks:  # bottom-up: each block becomes one all-gather / reduce-scatter unit
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings (tied head) and the final LayerNorm
    return model
    # END SOLUTION


def local_bytes(model: nn.Module) -> int:
    """Bytes of parameter elements this rank holds (its shard of each DTensor, all of a plain tensor)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds whole at this moment: FSDP swaps a unit's gathered
    parameters (plain tensors) in for its forward and its shards (DTensors) back in after it."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


@contextlib.contextmanager
def watch_forward(model: nn.Module):
    """While active: the all-gathers issued (lesson 05's dispatch-mode counter) and the most parameter
    bytes held whole at once, sampled as each module's forward begins and ends."""
    seen = {"all_gathers": 0, "peak_gathered_bytes": 0}

    def sample(*_) -> None:
        seen["peak_gathered_bytes"] = max(seen["peak_gathered_bytes"], gathered_bytes(model))

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(sample), m.register_forward_hook(sample))]
    try:
        with CollectiveCounter() as counter:
            yield seen
        seen["all_gathers"] = sum(op["op"].startswith("allgather") for op in counter.ops)
    finally:
        for h in hooks:
            h.remove()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, by name (all-gathers a DTensor's shards: every rank must call it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    with setup(device="cpu") as info:
        total = sum(p.numel() * p.element_size() for p in tiny_model(SEED, **SHAPE).parameters())
        mesh = init_device_mesh("cpu", (info.world_size,))
        sharded = shard(tiny_model(SEED, **SHAPE), mesh)
        ddp = DDP(tiny_model(SEED, **SHAPE))
        units = {"root": isinstance(sharded, FSDPModule),
                 "blocks": [isinstance(b, FSDPModule) for b in getattr(sharded, "blocks", [])]}
        plain = [n for n, p in sharded.named_parameters() if not isinstance(p, DTensor)]
        mine = local_bytes(sharded)
        blocks = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in ddp.module.blocks]
        one_block = total - sum(blocks) + max(blocks)  # the root's parameters and one block's, whole at once

        optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (sharded, ddp)]
        losses, forward = {"fsdp": [], "ddp": []}, {"all_gathers": 0, "peak_gathered_bytes": 0}
        for step in range(STEPS):
            x, y = micro_batch(step, info.rank, micro_batch_size=MICRO_BATCH_SIZE, block_size=SHAPE["block_size"],
                               seed=SEED)
            for name, model, opt in (("fsdp", sharded, optimizers[0]), ("ddp", ddp, optimizers[1])):
                with watch_forward(model) if (name, step) == ("fsdp", 0) else contextlib.nullcontext({}) as seen:
                    _, loss = model(x, y)
                forward.update(seen)  # the first step's forward of the sharded model
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(all_reduce_mean(loss.detach(), info))

        got, want = full_params(sharded), full_params(ddp.module)
        diff = max((got[n] - want[n]).abs().max().item() for n in want) if got.keys() == want.keys() else float("inf")
        norms = {n: t.norm().item() for n, t in got.items()}
        balanced = abs(mine - total / info.world_size) <= 0.05 * total / info.world_size
        one_at_a_time = forward["peak_gathered_bytes"] <= one_block
        ok = (diff <= TOLERANCE and not plain and balanced and units["root"] and all(units["blocks"])
              and one_at_a_time)
        log(f"local parameter bytes {mine:,} of {total:,} ({mine / total:.1%}); blocks sharded {units['blocks']}, "
            f"root {units['root']}; first forward: {forward['all_gathers']} all-gathers, at most "
            f"{forward['peak_gathered_bytes']:,} parameter bytes whole at once (one block at a time: {one_block:,}); "
            f"max |param - DDP| after {STEPS} steps {diff:.2e} -> {'PASS' if ok else 'FAIL'}", all_ranks=True)
        sys.stdout.write("RESULT " + json.dumps({"rank": info.rank, "world_size": info.world_size, "total_bytes": total,
                                      "local_bytes": mine, "units": units, "plain_params": plain, "forward": forward, "losses": losses,
                                      "max_abs_diff_vs_ddp": diff, "param_norms": norms, "ok": ok}) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
