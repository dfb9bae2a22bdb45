"""Gradient accumulation under DDP: where ``no_sync()`` must go, measured.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l06_grad_accumulation.no_sync_lab --out_dir=runs/no_sync_lab

Every rank runs ``--n_micro`` micro-batches, accumulated ``--k`` at a time (10 micro-batches with
K = 4 make optimizer steps of 4, 4 and a leftover of 2), once per *variant* of the accumulation
loop (see ``VARIANTS``): the correct one, no ``no_sync`` at all, the classic silent bugs, and a
leftover step whose loss is divided by K instead of by its own number of micro-batches.

For every optimizer step of every variant the lab measures

- which micro-steps all-reduced, and how many bucket all-reduces ran: a DDP communication hook
  counts them (``AllReduceCounter``);
- the accumulated gradient against one big batch on a plain, unwrapped model: all the step's
  micro-batches of every rank concatenated (``rel_err = |g - g_ref| / |g_ref|``);
- whether the replicas hold the same gradient (the largest element-wise difference between ranks).

The optimizer never steps (each comparison is at the same weights, so each stands alone); the
gradients are zeroed after every optimizer step, as ``optimizer.zero_grad()`` would. ``--device=auto``
(default) runs on the GPUs with NCCL when every rank has one, else on the CPU with gloo; the first
line says which. Rank 0 writes ``no_sync_lab.json`` into ``--out_dir``. Options are ``--key=value``
(``--help`` lists them).

The exercise of lesson 06 (``exercises/06_no_sync.py``) and its grader measure with the same pieces,
from :mod:`ddp_course.course.l06_grad_accumulation.grad_check` (the exercise does not import this lab:
its ``accumulate`` holds the correct loop).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddp_course import parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l06_grad_accumulation.grad_check import (
    AllReduceCounter,
    compare,
    micro_batch,
    reference_gradient,
    replica_spread,
    tiny_model,
)
from ddp_course.course.options import lab_help, require_device, write_result
from ddp_course.dist import log, setup

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l06_grad_accumulation.no_sync_lab"

# Relative tolerance on |g - g_ref| / |g_ref|. Accumulating K micro-batch means on W ranks and
# averaging them computes the same mean as one big batch, only with the float32 sums in another
# order: observed ~1e-7. Every real mistake is far above 1e-3 (a rank-local gradient misses by
# tens of percent, a leftover divided by K by 1 - n/K), so 1e-5 separates them with room on both sides.
GRAD_RTOL = 1e-5

DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/no_sync_lab",
    "k": 4,  # micro-batches per optimizer step
    "n_micro": 10,  # micro-batches per rank in all (the last optimizer step takes what is left)
    "micro_batch_size": 4,  # sequences per micro-batch per rank
    "block_size": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "bucket_cap_mb": 25.0,  # DDP's default size, but given explicitly: no 1 MiB first bucket (lesson 05, section 10)
    "seed": 0,
    "variants": "all",  # comma-separated names from VARIANTS, or all
    "timeout_s": 60.0,  # process-group timeout
    "device": "auto",  # auto | cpu | cuda
}

HELP = lab_help("no_sync_lab", DEFAULTS, k="micro-batches per optimizer step (K)",
                n_micro="micro-batches per rank in all; if not a multiple of K the last step takes the leftover",
                micro_batch_size="sequences per micro-batch per rank", bucket_cap_mb="DDP gradient bucket size",
                seed="model init and data", variants="comma-separated variant names, or all")

# name -> (what the loop does, in one line)
VARIANTS: dict[str, str] = {
    "no_sync": "non-final micro-steps: forward AND backward inside model.no_sync() (correct)",
    "always_sync": "no no_sync at all: every backward all-reduces (correct gradient, K times the traffic)",
    "backward_only": "no_sync() around the backward only, forward outside it (the classic silent bug)",
    "flag_after_forward": "require_backward_grad_sync = last, set after the forward (the same bug, by the flag)",
    "forward_only": "every forward inside no_sync(), every backward outside it (the mirror image)",
    "loss_over_k": "correct placement, but every loss divided by K, also on the leftover step",
}


# --------------------------------------------------------------------------------------------------

def chunks(n_micro: int, k: int) -> list[list[int]]:
    """Micro-batch indices of each optimizer step: K at a time, the leftover in a last, shorter step."""
    if n_micro < 1 or k < 1:
        raise ValueError(f"n_micro and k must be at least 1 (got n_micro={n_micro}, k={k}).")
    return [list(range(s, min(s + k, n_micro))) for s in range(0, n_micro, k)]


# --------------------------------------------------------------------------------------------------
# the variants of the accumulation loop

def accumulate(ddp, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], variant: str, k: int) -> None:
    """Forward and backward over one optimizer step's micro-batches, the way ``variant`` does it."""
    n = len(batches)
    for i, (x, y) in enumerate(batches):
        last = i == n - 1
        if variant in ("no_sync", "loss_over_k"):
            divisor = k if variant == "loss_over_k" else n  # the leftover step has n < K micro-batches
            with parallel.sync_context(ddp, sync=last):  # ddp.no_sync() unless last
                _, loss = ddp(x, y)
                (loss / divisor).backward()
        elif variant == "always_sync":
            _, loss = ddp(x, y)
            (loss / n).backward()
        elif variant == "backward_only":
            _, loss = ddp(x, y)  # DDP reads require_backward_grad_sync here: True, so it prepares to sync
            with contextlib.nullcontext() if last else ddp.no_sync():
                (loss / n).backward()
        elif variant == "flag_after_forward":
            _, loss = ddp(x, y)
            ddp.require_backward_grad_sync = last  # too late for this backward: read by the next forward
            (loss / n).backward()
        elif variant == "forward_only":
            with ddp.no_sync():
                _, loss = ddp(x, y)
            (loss / n).backward()  # outside no_sync, but the forward already decided: no all-reduce
        else:
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}.")


# --------------------------------------------------------------------------------------------------

def check_options(opts: dict[str, Any]) -> list[str]:
    """The variants to run (``--variants``); a ``FlagError`` for an unknown one or a size below 1."""
    spec = opts["variants"]
    names = list(VARIANTS) if spec == "all" else [v.strip() for v in spec.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise FlagError(f"--variants={spec!r}: unknown variant(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(VARIANTS)} or all.")
    for key in ("k", "n_micro", "micro_batch_size", "block_size"):
        if opts[key] < 1:
            raise FlagError(f"--{key} must be at least 1 (got {opts[key]}).")
    return names


def count_buckets(ddp, counter: AllReduceCounter, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bucket all-reduces of one plain synced backward, after DDP's rebuild.

    Two plain synced steps: DDP rebuilds its buckets after the first backward (in the order the
    gradients arrived); the second shows how many buckets one backward all-reduces.
    """
    for _ in range(2):
        counter.reset()
        _, loss = ddp(*batch)
        loss.backward()
        ddp.zero_grad(set_to_none=True)
    return counter.calls


def measure_step(ddp, counter: AllReduceCounter, batches, ref: dict[str, torch.Tensor], variant: str, k: int,
                 n_buckets: int, world_size: int, rank: int) -> dict[str, Any]:
    """One optimizer step of ``variant``: what all-reduced, and the gradient against one big batch."""
    counter.reset()
    accumulate(ddp, batches, variant, k)
    calls, synced = counter.calls, counter.synced_micro_steps
    mine = compare(ddp.module, ref)
    spread = replica_spread(ddp.module)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, {"rank": rank, "bucket_all_reduces": calls,
                                      "synced_micro_steps": synced, **mine})
    ddp.zero_grad(set_to_none=True)  # what optimizer.zero_grad() does after the step
    rel_err = max(r["rel_err"] for r in per_rank)
    return {"micro_batches": len(batches),
            "synced_micro_steps": per_rank[0]["synced_micro_steps"],
            "bucket_all_reduces": per_rank[0]["bucket_all_reduces"],
            "all_reduce_rounds": per_rank[0]["bucket_all_reduces"] / n_buckets,
            "rel_err": rel_err,
            "norm_ratio": [r["norm_ratio"] for r in per_rank],
            "replica_max_diff": spread,
            "matches_big_batch": rel_err <= GRAD_RTOL,
            "ranks": per_rank}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    variants = check_options(opts)
    shape = {k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
    data = {"micro_batch_size": opts["micro_batch_size"], "block_size": opts["block_size"], "seed": opts["seed"]}
    steps = chunks(opts["n_micro"], opts["k"])

    require_device(opts["device"])  # refuse a device this machine cannot give before any process group is made
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed:
            raise FlagError(f"the lab needs a process group: launch it with `{PROG}`.")
        from torch.nn.parallel import DistributedDataParallel as DDP

        device = info.device
        model = tiny_model(opts["seed"], **shape).to(device)
        reference = tiny_model(opts["seed"], **shape).to(device)  # same weights, never wrapped: one process, big batch
        ddp = parallel.record(DDP(model, bucket_cap_mb=opts["bucket_cap_mb"],
                                  device_ids=[device.index] if device.type == "cuda" else None), "ddp")
        counter = AllReduceCounter(ddp)

        def my_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(t.to(device) for t in micro_batch(index, info.rank, **data))

        n_buckets = count_buckets(ddp, counter, my_batch(0))
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[no_sync_lab] {info.world_size} ranks, {info.device_reason}; MiniGPT {n_params:,} "
            f"parameters in {n_buckets} gradient bucket(s); {opts['n_micro']} micro-batches of "
            f"{opts['micro_batch_size']} per rank, K = {opts['k']}: optimizer steps of "
            f"{', '.join(str(len(c)) for c in steps)} micro-batches")

        refs = [reference_gradient(reference, idx, info.world_size, **data) for idx in steps]
        results: dict[str, Any] = {}
        for variant in variants:
            ddp.require_backward_grad_sync = True  # a clean start for every variant
            rows = [{**measure_step(ddp, counter, [my_batch(i) for i in idx], ref, variant, opts["k"], n_buckets,
                                    info.world_size, info.rank), "indices": idx}
                    for idx, ref in zip(steps, refs)]
            results[variant] = {"description": VARIANTS[variant], "steps": rows}
            log(f"[no_sync_lab] {variant:<19} all-reducing micro-steps per optimizer step "
                f"{[r['synced_micro_steps'] for r in rows]}, gradient vs one big batch: max rel. error "
                f"{max(r['rel_err'] for r in rows):.1e}, replicas differ by up to "
                f"{max(r['replica_max_diff'] for r in rows):.1e}")
        ddp.require_backward_grad_sync = True

        out = {"world_size": info.world_size, "backend": info.backend, "device": device.type,
               "k": opts["k"], "n_micro": opts["n_micro"],
               "steps": steps, "n_buckets": n_buckets, "grad_rtol": GRAD_RTOL, "options": opts,
               "n_params": n_params, "variants": results}
        write_result(info, opts["out_dir"], "no_sync_lab", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
