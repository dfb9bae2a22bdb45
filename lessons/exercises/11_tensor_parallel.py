"""Exercise 11 -- tensor parallelism by hand: MiniGPT's MLP split over the ranks, Megatron style.

MiniGPT's MLP is ``fc`` (C -> H = 4C), GELU, ``proj`` (H -> C). Split its H hidden units over the N
ranks; rank r holds the r-th block of H/N of them, in ``torch.chunk`` order (units r*H/N .. (r+1)*H/N - 1):

- ``fc`` is **column-parallel**: rank r holds the rows of ``fc.weight`` (shape (H, C), one row per
  output feature) and the entries of ``fc.bias`` of its hidden units; its output is its slice of the
  hidden activations, and GELU acts on each unit alone, so the slice needs no communication;
- ``proj`` is **row-parallel**: rank r holds the columns of ``proj.weight`` (shape (C, H), one column
  per input feature) of its hidden units, and computes a *partial* output; the N partial outputs must
  be summed (an all-reduce), and ``proj.bias`` added once, after the sum.

Two small autograd functions place the collectives (Megatron-LM calls them f and g): f,
``CopyToParallelRegion``, before ``fc``, and g, ``ReduceFromParallelRegion``, after ``proj``. Each is
the identity in one direction and an all-reduce (a sum over the ranks) in the other: which, is yours
to work out from what each rank holds on either side of them, going forward and coming back.

Complete the two functions' ``forward`` and ``backward``, the two slicing functions and
``TensorParallelMLP.forward``, then run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/11_tensor_parallel.py

The harness below builds the same small MiniGPT on every rank, replaces the MLP of every block by
your tensor-parallel one, and runs forward and backward on the same batch on every rank and on one
process. Every rank compares its logits, and the gradient of each of its parameters (each shard with
the same slice of the one-process gradient), then trains a few SGD steps side by side with one
process, and prints PASS or FAIL. The course's grader runs it the same way, compares with a reference
of its own and names the mistake:

    python -m ddp_course check 11 lessons/exercises/11_tensor_parallel.py
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_course.course.l11_beyond_data_parallel.biased import biased_model
from ddp_course.course.tiny import micro_batch
from ddp_course.dist import log, setup
from ddp_course.model import MLP

SHAPE = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
BATCH, STEPS, LR, SEED = 4, 3, 0.5, 0  # LR: plain SGD's
# One process and N ranks compute the same sums with their float32 terms grouped differently (each
# rank sums over its hidden units, then the all-reduce adds the ranks): measured, up to 5e-7 of the
# size of the logits or of a gradient. A missing or extra collective, or a bias added on every rank,
# is off by a tenth of that size or more (measured 0.13 to 1.4, in the logits or in some gradient).
# TOLERANCE sits between, relative to the size of what is compared.
TOLERANCE = 1e-5


class CopyToParallelRegion(torch.autograd.Function):
    """f, before the column-parallel ``fc``: its input is the MLP's input, the same on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO: f's forward: x is the MLP's input, the same on every rank
        raise NotImplementedError("exercise: complete this part")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO: f's backward: grad is what flowed back through this rank's own hidden units
        raise NotImplementedError("exercise: complete this part")


class ReduceFromParallelRegion(torch.autograd.Function):
    """g, after the row-parallel ``proj``: its input is this rank's partial output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        # TODO: g's forward: x is this rank's partial output
        raise NotImplementedError("exercise: complete this part")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # TODO: g's backward: grad is the gradient of g's output, as this rank received it
        raise NotImplementedError("exercise: complete this part")


def column_shard(fc: nn.Linear, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the column-parallel ``fc``: (its rows of the weight, its entries of the bias)."""
    # TODO: this rank's block of output features (torch.chunk order): its rows of the weight, its part of the bias
    raise NotImplementedError("exercise: complete this part")


def row_shard(proj: nn.Linear, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the row-parallel ``proj``: (its columns of the weight, the whole bias)."""
    # TODO: this rank's block of input features (torch.chunk order): its columns of the weight; the bias whole
    raise NotImplementedError("exercise: complete this part")


class ShardError(ValueError):
    """A shard of the wrong shape (raised by the harness before any forward)."""

    def __init__(self, what: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        super().__init__(f"{what} has shape {got}, but this rank's shard must be {want}")
        self.what, self.got, self.want = what, got, want


def expect_shape(what: str, got: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(got.shape) != want:
        raise ShardError(what, tuple(got.shape), want)


class TensorParallelMLP(nn.Module):
    """MiniGPT's MLP with its hidden units split over the ranks: ``fc`` column-parallel, ``proj`` row-parallel."""

    def __init__(self, mlp: MLP, rank: int, world_size: int) -> None:
        super().__init__()
        c, h = mlp.fc.in_features, mlp.fc.out_features
        fc_w, fc_b = column_shard(mlp.fc, rank, world_size)
        proj_w, proj_b = row_shard(mlp.proj, rank, world_size)
        for what, got, want in (("column_shard's weight", fc_w, (h // world_size, c)),
                                ("column_shard's bias", fc_b, (h // world_size,)),
                                ("row_shard's weight", proj_w, (c, h // world_size)),
                                ("row_shard's bias", proj_b, (c,))):
            expect_shape(what, got, want)
        self.fc = nn.Linear(c, h // world_size)  # this rank's hidden units
        self.proj = nn.Linear(h // world_size, c)  # their columns of proj; the bias whole, on every rank
        with torch.no_grad():
            for p, v in ((self.fc.weight, fc_w), (self.fc.bias, fc_b), (self.proj.weight, proj_w),
                         (self.proj.bias, proj_b)):
                p.copy_(v)
        self.drop = mlp.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: f; this rank's hidden units (fc, GELU); their partial output (proj's weight alone); g; then proj's bias, once
        raise NotImplementedError("exercise: complete this part")


def expected_slice(full: torch.Tensor, held: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The part of the one-process tensor ``full`` that this rank's parameter ``held`` stands for: this rank's
    block (torch.chunk order) along the one dimension in which ``held`` is smaller; ``full`` if none is."""
    smaller = [d for d in range(full.dim()) if held.shape[d] != full.shape[d]]
    return full.chunk(world_size, smaller[0])[rank] if smaller else full


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: the error relative to the size of what is compared."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def sgd_step(model: nn.Module, lr: float) -> None:
    """Plain SGD on the parameters this rank holds, p <- p - lr * grad; then the gradients are cleared."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def main() -> None:
    with setup(device="cpu") as info:
        rank, world = info.rank, info.world_size
        single = biased_model(SEED, **SHAPE)  # one process: the reference
        tp = biased_model(SEED, **SHAPE)  # the same weights on every rank, then each block's MLP split
        try:
            for block in tp.blocks:
                block.mlp = TensorParallelMLP(block.mlp, rank, world)
        except ShardError as exc:
            log(f"FAIL: {exc}", all_ranks=True)
            error = {"what": exc.what, "got": exc.got, "want": exc.want}
            sys.stdout.write("RESULT " + json.dumps({"rank": rank, "world_size": world, "shard_error": error,
                                                     "ok": False}) + "\n")
            sys.stdout.flush()
            raise SystemExit(1) from None
        full = dict(single.named_parameters())
        shards = {n: torch.equal(p.detach(), expected_slice(full[n].detach(), p, rank, world))
                  for n, p in tp.named_parameters() if ".mlp." in n}

        x, y = micro_batch(0, 0, micro_batch_size=BATCH, block_size=SHAPE["block_size"], seed=SEED)  # same on every rank
        logits_1, loss_1 = single(x, y)
        logits_tp, loss_tp = tp(x, y)
        loss_1.backward()
        loss_tp.backward()
        logits_diff = rel_diff(logits_tp.detach(), logits_1.detach())
        grads = {}
        for name, p in tp.named_parameters():
            want = expected_slice(full[name].grad, p, rank, world)
            grads[name] = {"norm": None if p.grad is None else p.grad.norm().item(),
                           "rel_diff": None if p.grad is None else rel_diff(p.grad, want)}

        losses = {"tp": [], "single": []}  # SGD steps side by side, a new batch (the same on every rank) each
        for step in range(STEPS):
            for model in (tp, single):
                sgd_step(model, LR)
            xs, ys = micro_batch(step + 1, 0, micro_batch_size=BATCH, block_size=SHAPE["block_size"], seed=SEED)
            for key, model in (("tp", tp), ("single", single)):
                _, loss = model(xs, ys)
                loss.backward()
                losses[key].append(loss.item())
        train_diff = max(abs(a - b) / abs(b) for a, b in zip(losses["tp"], losses["single"]))

        bad_grads = [n for n, g in grads.items() if g["rel_diff"] is None or not g["rel_diff"] <= TOLERANCE]
        ok = all(shards.values()) and logits_diff <= TOLERANCE and not bad_grads and train_diff <= TOLERANCE
        log(f"loss {loss_tp.item():.6f} (one process {loss_1.item():.6f}); max |logits - one process| "
            f"{logits_diff:.1e} of their size; gradients off: {bad_grads[:3] or 'none'}; after {STEPS} SGD "
            f"steps the losses differ by {train_diff:.1e} -> {'PASS' if ok else 'FAIL'}", all_ranks=True)
        sys.stdout.write("RESULT " + json.dumps({
            "rank": rank, "world_size": world, "shard_error": None, "shards_match": shards,
            "loss": loss_tp.item(), "single_loss": loss_1.item(), "logits_rel_diff": logits_diff, "grads": grads,
            "losses": losses, "train_rel_diff": train_diff, "ok": ok}) + "\n")  # one write: lines cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
