"""Exercise 09, second part -- ZeRO-1: shard AdamW's states over the ranks, yourself.

Under DDP every rank keeps AdamW's two moments for every parameter, although every rank computes
the very same update. ZeRO-1 gives each parameter one *owner*: only the owner keeps its optimizer
state and steps it, and the owner then sends the updated parameter to the others. Parameters and
gradients stay replicated; the optimizer state is split N ways. Complete the four functions below:

- ``partition``: which parameters each rank owns -- whole parameters, each on exactly one rank,
  the ranks' shares balanced by size;
- ``shard_optimizer``: this rank's optimizer (AdamW unless the caller names another class and its
  keyword arguments, as ``torch.distributed.optim.ZeroRedundancyOptimizer`` takes them), over the
  parameters it owns and no others;
- ``average_gradients``: after backward, leave on each parameter's owner the gradient averaged over
  the ranks (the gradient DDP would leave);
- ``share_updates``: after the owners' steps, every rank receives each parameter from its owner.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/09_zero1.py

The harness below trains your ZeRO-1 model and a DDP copy with a plain ``torch.optim.AdamW`` side by
side from the same weights on the same batches. It checks that every parameter is stepped on exactly
one rank, that each rank holds about 1/N of AdamW's state bytes, that the gradient your optimizer
steps with is DDP's, and that every rank ends with DDP's parameters; it prints PASS or FAIL on every
rank. The course's grader runs it the same way, compares with a reference of its own and explains
what is wrong:

    python -m ddp_course check 09 lessons/exercises/09_zero1.py
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.course.tiny import micro_batch, tiny_model
from ddp_course.dist import all_reduce_mean, log, setup

SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
MICRO_BATCH_SIZE, STEPS, LR, SEED = 4, 4, 1e-3, 0
# A real bug (a parameter never stepped, or not shared) leaves a parameter about one AdamW update,
# ~LR, away from DDP's; adding the same gradients in another order moves the last bits only. LR / 100
# separates the two.
TOLERANCE = LR / 100
# The gradient the owner steps with, against DDP's, per parameter: the same sum of two ranks' gradients
# divided by 2 differs from DDP's in the last bits at most (~1e-7); a sum that is not divided is off by
# 100 %, a rank's own gradient by tens of percent.
GRAD_RTOL = 1e-5


def partition(sizes: list[int], world_size: int) -> list[list[int]]:
    """The parameters each rank owns: ``shards[r]`` lists the indices (into ``sizes``) of rank r's.

    ``sizes[i]`` is parameter i's number of elements. Every parameter belongs to exactly one rank, and
    the ranks' totals are balanced: each owns about ``sum(sizes) / world_size`` elements.
    """
    # TODO: give each parameter to exactly one rank, so that the ranks' totals come out balanced
    raise NotImplementedError("exercise: complete this part")


def parameters_only(build):
    """Refuse parameter groups (dicts) with a clear message before ``build`` sees them: each parameter gets
    one owner, and one set of options applies to all of them (part of the harness: keep it)."""
    def checked(params, *args, **kwargs):
        if any(isinstance(p, dict) for p in params):
            raise TypeError("shard_optimizer takes a list of parameters, not parameter groups (dicts): each "
                            "parameter gets one owner, and one set of options applies to all of them. Pass "
                            "list(model.parameters()), and the options as keyword arguments.")
        return build(params, *args, **kwargs)
    return checked


@parameters_only
def shard_optimizer(params: list[nn.Parameter], shards: list[list[int]], rank: int,
                    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                    **defaults) -> torch.optim.Optimizer:
    """This rank's optimizer over the parameters it owns only: ``optimizer_class`` (default AdamW) with
    ``defaults`` as its keyword arguments (the learning rate ``LR`` unless they give ``lr``), as
    ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`` builds it."""
    # TODO: an optimizer_class over the parameters of this rank's shard, and no others, built with defaults (lr=LR unless they say otherwise)
    raise NotImplementedError("exercise: complete this part")


def average_gradients(params: list[nn.Parameter], shards: list[list[int]], world_size: int) -> None:
    """After backward: each parameter's owner holds the gradient averaged over every rank's batch.

    The other ranks' copies of that gradient may hold anything afterwards: nobody steps with them.
    """
    # TODO: for each parameter, sum its gradient over the ranks into its owner, then divide by the number of ranks
    raise NotImplementedError("exercise: complete this part")


def share_updates(params: list[nn.Parameter], shards: list[list[int]]) -> None:
    """After the owners' optimizer steps: every rank receives each parameter from its owner."""
    # TODO: send each parameter from the rank that owns it (and stepped it) to every other rank
    raise NotImplementedError("exercise: complete this part")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq and step, per parameter)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def main() -> None:
    with setup(device="cpu") as info:
        n = info.world_size
        model, ddp = tiny_model(SEED, **SHAPE), DDP(tiny_model(SEED, **SHAPE))
        names = [name for name, _ in model.named_parameters()]
        params = list(model.parameters())
        shards = partition([p.numel() for p in params], n)
        zero = shard_optimizer(params, shards, info.rank)
        adamw = torch.optim.AdamW(ddp.parameters(), lr=LR)  # the reference: all of AdamW on every rank
        index = {id(p): i for i, p in enumerate(params)}
        stepped = [index.get(id(p), -1) for group in zero.param_groups for p in group["params"]]

        losses, grads, want = {"zero1": [], "ddp": []}, {}, {}
        for step in range(STEPS):
            x, y = micro_batch(step, info.rank, micro_batch_size=MICRO_BATCH_SIZE, block_size=SHAPE["block_size"],
                               seed=SEED)
            _, loss = model(x, y)
            loss.backward()
            average_gradients(params, shards, n)
            if step == 0:  # the gradients this rank's optimizer steps with
                grads = {names[i]: params[i].grad.clone() for i in stepped if i >= 0 and params[i].grad is not None}
            zero.step()
            model.zero_grad(set_to_none=True)  # every gradient, owned or not: none may carry into the next step
            share_updates(params, shards)
            losses["zero1"].append(all_reduce_mean(loss.detach(), info))

            _, loss = ddp(x, y)
            loss.backward()
            if step == 0:
                want = {name: p.grad.clone() for name, p in ddp.module.named_parameters()}
            adamw.step()
            adamw.zero_grad(set_to_none=True)
            losses["ddp"].append(all_reduce_mean(loss.detach(), info))

        every = [None] * n
        dist.all_gather_object(every, stepped)  # what each rank's optimizer really steps
        counts = [sum(i in s for s in every) for i in range(len(params))]
        flat = torch.cat([p.detach().flatten() for p in params])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        across = (flat - rank0).abs().max().item()  # 0 when every rank holds rank 0's parameters, bit for bit
        diff = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(params, ddp.module.parameters()))
        grad_rel = max(((g - want[k]).norm() / want[k].norm()).item() for k, g in grads.items()) if grads else float("inf")
        mine, full = state_bytes(zero), state_bytes(adamw)
        # whole parameters cannot split evenly: a rank may be off an exact 1/N by up to (N-1)/N of the
        # largest parameter's moments (8 bytes per element), plus the 4-byte step counters
        slack = (n - 1) / n * 8 * max(p.numel() for p in params) + 4 * len(params)
        balanced = abs(mine - full / n) <= slack
        ok = (diff <= TOLERANCE and across == 0 and all(c == 1 for c in counts) and balanced and grad_rel <= GRAD_RTOL)
        log(f"optimizer holds {len(stepped)} of {len(params)} parameters; AdamW state {mine:,} of {full:,} bytes "
            f"({mine / full:.1%}); step-0 gradient vs DDP {grad_rel:.1e}; max |param - DDP| after {STEPS} steps "
            f"{diff:.2e}; ranks differ by {across:.1e} -> {'PASS' if ok else 'FAIL'}", all_ranks=True)
        sys.stdout.write("RESULT " + json.dumps({
            "rank": info.rank, "world_size": n, "shape": SHAPE, "n_params": len(params),
            "param_numels": [p.numel() for p in params],
            "stepped": [names[i] if i >= 0 else None for i in stepped], "shards": [[int(i) for i in s] for s in shards],
            "optimizer_bytes": mine, "ddp_optimizer_bytes": full, "grad_norms": {k: g.norm().item() for k, g in grads.items()},
            "grad_rel_diff_vs_ddp": grad_rel, "max_abs_diff_vs_ddp": diff, "max_abs_diff_across_ranks": across,
            "param_norms": {name: p.detach().norm().item() for name, p in zip(names, params)}, "losses": losses,
            "ok": ok}) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
