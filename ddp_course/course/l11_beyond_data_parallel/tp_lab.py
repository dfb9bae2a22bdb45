"""Tensor parallelism with PyTorch's own API: MiniGPT's attention and MLP split over the ranks.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.tp_lab --out_dir=runs/11/tp

Every rank builds the same MiniGPT (same seed) and hands the linear layers of every block to
``torch.distributed.tensor.parallel.parallelize_module`` over a 1-D device mesh of all the ranks:
``attn.qkv`` and ``mlp.fc`` column-wise (``ColwiseParallel``: each rank holds a block of the output
features), ``attn.proj`` and ``mlp.proj`` row-wise (``RowwiseParallel``: the matching block of input
features; the partial outputs are all-reduced, the bias added once). Their weights become DTensors;
the embeddings, the LayerNorms and the head stay whole on every rank. Every rank then trains on the
same batches (the course's corpus), and rank 0 trains one unsplit model on them too, for comparison.

The attention needs two changes, both from outside ``ddp_course/model.py``:

- ``qkv`` is ONE fused linear layer whose 3C output rows are all of q, then all of k, then all of v.
  A column-wise shard of it in that order gives rank 0 of 2 all of q and half of k. So before
  parallelizing, the rows are reordered head-major per rank (``rearrange_qkv``): rank r's contiguous
  block becomes [q of its heads; k of its heads; v of its heads] -- the same weights, in another order.
- ``CausalSelfAttention.forward`` splits the qkv output at C and uses all ``n_head`` heads; on a rank,
  the output holds 3C/N features of n_head/N heads. ``HeadParallelAttention`` is the same computation
  with the rank's local head count (heads are independent: no communication until ``proj``).

The lab also runs, forward only, the naive plan (the fused weight sharded in its original order with
the head-parallel forward), to show how far the mix-up of q, k and v moves the logits. It counts the collectives
of one training step's forward and backward (``CommDebugMode``) and each rank's parameter bytes.
``--device=auto`` (default) uses one GPU per rank with NCCL when every rank has one, else the CPU with
gloo. Rank 0 writes ``tp_lab.json`` into ``--out_dir``. Options are ``--key=value`` (``--help``).

Exercise 11 (``exercises/11_tensor_parallel.py``, the MLP split by hand) builds its model with
``biased.biased_model`` and does not import this module: ``hidden_block`` is the slicing it asks for.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.options import lab_help, require_device
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.parallel._tensor_parallel import (  # noqa: F401 -- the grader and the tests import them from here
    HeadParallelAttention,
    hidden_block,
    qkv_order,
    rearrange_qkv,
)
from ddp_course.paths import show

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.tp_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/11/tp",
    "steps": 6,  # AdamW steps
    "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32,
    "batch_size": 8,  # sequences per step, the same on every rank (tensor parallelism splits the model, not the batch)
    "lr": 3e-3, "seed": 0, "corpus": "tinyshakespeare",
    "device": "auto", "timeout_s": 60.0,
}
HELP = lab_help("tp_lab", DEFAULTS, steps="AdamW steps, tensor-parallel and one process side by side",
                n_head="attention heads (a multiple of the number of ranks)",
                n_embd="model width (its heads and 4 x n_embd hidden units split evenly over the ranks)",
                batch_size="sequences per step (every rank the same)", seed="model initialisation and batch order")


# --------------------------------------------------------------------------------------------------
# the attention, split by heads

def qkv_layout(n_embd: int, n_head: int, world_size: int, rearranged: bool) -> list[list[str]]:
    """What each rank's column-wise shard of qkv holds, as runs like ``"q heads 0-1"`` (for the notebook)."""
    rows = qkv_order(n_embd, world_size) if rearranged else torch.arange(3 * n_embd)
    hs = n_embd // n_head
    out = []
    for r in range(world_size):
        runs: list[tuple[str, list[int]]] = []
        for row in rows[hidden_block(3 * n_embd, r, world_size)].tolist():
            which, head = "qkv"[row // n_embd], (row % n_embd) // hs
            if runs and runs[-1][0] == which:
                if runs[-1][1][-1] != head:
                    runs[-1][1].append(head)
            else:
                runs.append((which, [head]))
        out.append([f"{w} heads {h[0]}-{h[-1]}" if len(h) > 1 else f"{w} head {h[0]}" for w, h in runs])
    return out


def tensor_parallel(model: MiniGPT, mesh, rearrange: bool = True) -> MiniGPT:
    """Split every block's attention (by heads) and MLP (by hidden units) over ``mesh``, in place."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = mesh.size()
    for block in model.blocks:
        if rearrange:
            rearrange_qkv(block.attn, n)
        block.attn = HeadParallelAttention(block.attn, n)
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    return model


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want|: a difference relative to the size of what is compared."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters this rank holds: in all, in shards, and in tensors every rank holds whole.

    A row-wise layer's bias is a DTensor too, but replicated (every rank holds all of it): it counts
    as whole, with the plain tensors (embeddings, LayerNorms).
    """
    from torch.distributed.tensor import DTensor

    def is_shard(p) -> bool:
        return isinstance(p, DTensor) and any(placement.is_shard() for placement in p.placements)

    def local(p) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    sharded = sum(local(p).numel() * p.element_size() for p in model.parameters() if is_shard(p))
    whole = sum(local(p).numel() * p.element_size() for p in model.parameters() if not is_shard(p))
    return {"total": sharded + whole, "sharded": sharded, "replicated": whole}


def count_collectives(fn, *args) -> tuple[Any, dict[str, int]]:
    """``fn(*args)``, and the collectives DTensor issued meanwhile by name, e.g. {"all_reduce": 4} (``CommDebugMode``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with warnings.catch_warnings():  # CommDebugMode's module tracker warns on inputs without gradient
        warnings.filterwarnings("ignore", message="Full backward hook")
        with CommDebugMode() as comm:
            out = fn(*args)
    return out, {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def train(model: nn.Module, steps: list, lr: float) -> tuple[list[float], torch.Tensor, dict[str, dict[str, int]]]:
    """AdamW on ``steps`` (x, y) batches: the losses, the first batch's logits, and the first step's
    collectives, forward and backward apart."""
    # foreach=False: the split layers' parameters are DTensors and the rest plain tensors, and the
    # multi-tensor kernels AdamW picks by default on CUDA refuse such a mix ("got mixed torch.Tensor and
    # DTensor"). One tensor at a time is what AdamW does on the CPU anyway; the one-process model runs it too.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    losses, counts, first = [], {}, None
    for x, y in steps:
        if first is None:
            (first, loss), counts["forward"] = count_collectives(model, x, y)
            _, counts["backward"] = count_collectives(loss.backward)
        else:
            _, loss = model(x, y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first.detach(), counts


# --------------------------------------------------------------------------------------------------

def check_options(opts: dict[str, Any], world_size: int) -> None:
    for key in ("steps", "n_layer", "n_head", "n_embd", "block_size", "batch_size"):
        if opts[key] < 1:
            raise FlagError(f"--{key} must be at least 1 (got {opts[key]}).")
    if opts["n_embd"] % opts["n_head"]:
        raise FlagError(f"--n_embd={opts['n_embd']} must be a multiple of --n_head={opts['n_head']}.")
    if opts["n_head"] % world_size:
        raise FlagError(f"--n_head={opts['n_head']} heads cannot be split evenly over {world_size} ranks: "
                        f"choose a multiple of {world_size}.")


def same_batches(opts: dict[str, Any], device: torch.device) -> tuple[list, int]:
    """``--steps`` batches of the corpus, the same on every rank, and the vocabulary size."""
    from ddp_course.data import prepare, train_batches

    data = prepare(opts["corpus"], opts["block_size"], 0.1, announce=lambda _: None)
    batches = train_batches(data.train, opts["batch_size"], rank=0, world_size=1, seed=opts["seed"])
    return [tuple(t.to(device) for t in next(batches)) for _ in range(opts["steps"])], data.tokenizer.vocab_size


@command
def main(argv: list[str]) -> int:
    import os

    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    check_options(opts, int(os.environ.get("WORLD_SIZE", 1)))
    require_device(opts["device"])
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed:
            raise FlagError(f"the lab needs a process group: launch it with `{PROG}`.")
        from torch.distributed.device_mesh import init_device_mesh

        device, n = info.device, info.world_size
        shape = {k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
        steps, vocab = same_batches(opts, device)

        def build() -> MiniGPT:  # the same weights in every process
            torch.manual_seed(opts["seed"])
            return MiniGPT(GPTConfig(vocab_size=vocab, **shape)).to(device)

        mesh = init_device_mesh(device.type, (n,))
        with torch.no_grad():  # the first batch: one process, and the naive plan (the fused qkv sharded as it is)
            logits_single, loss_single = build()(*steps[0])
            logits_naive, loss_naive = tensor_parallel(build(), mesh, rearrange=False)(*steps[0])
        model = tensor_parallel(build(), mesh)
        mine = parameter_bytes(model)
        losses, logits, counts = train(model, steps, opts["lr"])
        single = train(build(), steps, opts["lr"])[0] if info.is_main else []  # one process, the same batches
        per_rank = [None] * n
        dist.all_gather_object(per_rank, {"rank": info.rank, "losses": losses, "param_bytes": mine})
        if info.is_main:
            full_bytes = parameter_bytes(build())["total"]
            diff = max(abs(a - b) / abs(b) for r in per_rank for a, b in zip(r["losses"], single))
            layout = {f"{'rearranged' if r else 'naive'}": qkv_layout(shape["n_embd"], shape["n_head"], n, r)
                      for r in (False, True)}
            result = {"world_size": n, "backend": info.backend, "device": device.type, "options": opts,
                      "losses_tp": losses, "losses_single": single, "max_rel_diff": diff,
                      "first_logits_rel_diff": {"tp": rel_diff(logits, logits_single),
                                                "naive": rel_diff(logits_naive, logits_single)},
                      "ranks": per_rank, "full_param_bytes": full_bytes, "collectives": counts,
                      "naive_qkv": {"loss": loss_naive.item(), "single_loss": loss_single.item(),
                                    "layout": layout["naive"]},
                      "rearranged_layout": layout["rearranged"]}
            path = Path(opts["out_dir"]) / "tp_lab.json"
            write_json(path, result)
            log(f"[tp_lab] {n} ranks, {info.device_reason}; {opts['steps']} AdamW steps: tensor-parallel vs one "
                f"process, max relative loss difference {diff:.1e}; rank 0 holds {mine['total']:,} of {full_bytes:,} "
                f"parameter bytes; wrote {show(path)}")
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
