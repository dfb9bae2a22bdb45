"""Two dimensions at once on 4 CPU ranks: FSDP2 over ``dp`` x tensor parallelism over ``tp``, against one process.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l13_two_dimensions.two_d_lab --out_dir=runs/13_lab

The ranks form a 2-D mesh ``(dp, tp)`` (2 x 2 on 4 ranks, ``--tp=2``): rows of ``tp`` consecutive ranks
are tensor-parallel groups, which read the same batch; the ``dp`` groups read different halves of the
global batch. Each variant splits MiniGPT over the mesh with ``ddp_course.parallel._tp_plan``
(the plan of ``--strategy=fsdp_tp``), trains ``--steps`` AdamW steps on the same global batches as one
process, and records on every rank:

- **parity** against one process (every rank trains that reference itself, on the whole global
  batch): each step's loss, every parameter's gradient at the first step, the weights at the end
  (the qkv rows put back in the model's order first);
- **bytes** this rank holds: parameters, gradients, AdamW's state (``memory.measure_states``), and the
  activations autograd saved during the first forward (``memory.saved_activations``);
- **collectives** of the first step, forward and backward apart, by kind and by mesh dimension
  (``two_d_harness.CollectiveCounter``: DTensor's redistributions and the collectives its handlers issue,
  ``loss_parallel``'s included, FSDP's all-gathers and reduce-scatters -- checked against what each
  process group of the mesh ran).

The variants (``VARIANTS``): ``sp`` (sequence parallelism for the norms and the residual stream, the
strategy's plan), ``no_sp`` (the residual stream replicated inside a group: row-wise outputs
all-reduced) and ``vocab`` (``sp`` plus the tied embedding and head sharded by vocabulary rows, the
loss computed on vocabulary shards under ``loss_parallel``). Rank 0 writes ``two_d_lab.json``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l11_beyond_data_parallel.tp_lab import same_batches  # --steps global batches of the corpus
from ddp_course.course.l13_two_dimensions.two_d_harness import (
    GRAD_RTOL,
    LOSS_RTOL,
    UPDATE_RTOL,
    train_side_by_side,
)
from ddp_course.course.options import lab_help, write_result
from ddp_course.dist import log, setup
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.parallel import _tp_plan as tp_plan

PROG = "torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l13_two_dimensions.two_d_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/13_lab", "tp": 2, "steps": 3, "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32,
    "batch_size": 8, "lr": 3e-3, "seed": 0, "variants": "sp,no_sp,vocab", "corpus": "tinyshakespeare",
    "timeout_s": 60.0,
}
HELP = lab_help("two_d_lab", DEFAULTS, tp="tensor-parallel ranks (dp is the rest of the world size)",
                steps="AdamW steps of every variant and of the one-process reference",
                n_head="attention heads (divisible by --tp)", n_embd="model width (divisible by --tp)",
                block_size="tokens per sequence (divisible by --tp: sequence parallelism splits it)",
                batch_size="sequences per step, the whole global batch (divisible by dp)",
                seed="model initialisation and the batches", variants="comma-separated: sp, no_sp, vocab")
VARIANTS = {
    "sp": "FSDP over dp x tensor parallel over tp, sequence parallel norms and residual stream",
    "no_sp": "FSDP over dp x tensor parallel over tp, the residual stream replicated in each tp group",
    "vocab": "as sp, with the tied embedding/head sharded by vocabulary and the loss under loss_parallel",
}


def build(opts: dict[str, Any], vocab: int, device: torch.device) -> MiniGPT:
    """The same initial weights in every process (seeded)."""
    torch.manual_seed(opts["seed"])
    shape = {k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
    return MiniGPT(GPTConfig(vocab_size=vocab, **shape)).to(device)


def split(model: MiniGPT, mesh, variant: str) -> MiniGPT:
    """Tensor (and sequence) parallel over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``: each block,
    then the root -- the strategy's plan, with the variant's choices."""
    from torch.distributed.fsdp import fully_shard

    tp_plan.tensor_parallel(model, mesh["tp"], sequence_parallel=variant != "no_sp", vocab_parallel=variant == "vocab")
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def loss_context(variant: str) -> contextlib.AbstractContextManager:
    """``loss_parallel`` for the vocabulary-sharded logits: the cross-entropy of each shard and the
    log-sum-exp across shards, in forward and backward."""
    if variant != "vocab":
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def check_options(opts: dict[str, Any], world_size: int) -> list[str]:
    variants = [v.strip() for v in opts["variants"].split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise FlagError(f"{PROG}: unknown variant(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(VARIANTS)}.")
    tp = opts["tp"]
    if tp < 1 or world_size % tp:
        raise FlagError(f"--tp={tp} must divide the {world_size} ranks (dp = ranks / tp).")
    for key in ("n_head", "n_embd", "block_size"):
        if opts[key] % tp:
            raise FlagError(f"--{key}={opts[key]} must be divisible by --tp={tp}.")
    if opts["batch_size"] % (world_size // tp):
        raise FlagError(f"--batch_size={opts['batch_size']} must be divisible by dp = {world_size // tp}.")
    return variants


@command
def main(argv: list[str]) -> int:
    import os

    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    variants = check_options(opts, int(os.environ.get("WORLD_SIZE", 1)))
    with setup(device="cpu", timeout_s=opts["timeout_s"], threads=1,
               because="the lesson is about the layouts on a laptop; on GPUs --strategy=fsdp_tp runs the same plan"
               ) as info:
        if not info.is_distributed or info.world_size < 2:
            raise FlagError(f"the lab needs a process group of at least 2 ranks: launch it with `{PROG}`.")
        from torch.distributed.device_mesh import init_device_mesh

        dp = info.world_size // opts["tp"]
        mesh = init_device_mesh("cpu", (dp, opts["tp"]), mesh_dim_names=("dp", "tp"))
        data, vocab = same_batches(opts, info.device)
        t0 = time.perf_counter()
        log(f"[two_d_lab] {info.world_size} ranks as a {dp} x {opts['tp']} mesh (dp x tp); MiniGPT "
            f"{build(opts, vocab, info.device).num_params():,} parameters; global batch {opts['batch_size']} x "
            f"{opts['block_size']} tokens, {opts['steps']} AdamW steps")
        results: dict[str, Any] = {}
        for variant in variants:
            mine = train_side_by_side(lambda: build(opts, vocab, info.device),
                                      lambda model, mesh, v=variant: split(model, mesh, v), mesh, info, tp=opts["tp"],
                                      batch_size=opts["batch_size"], steps=opts["steps"], lr=opts["lr"],
                                      seed=opts["seed"], data=data, loss_context=lambda v=variant: loss_context(v))
            per_rank: list = [None] * info.world_size
            dist.all_gather_object(per_rank, mine)
            results[variant] = {"description": VARIANTS[variant], "per_rank": per_rank,
                                "losses": per_rank[0]["losses"], "reference_losses": per_rank[0]["reference_losses"],
                                "loss_rel_diff": max(r["loss_rel_diff"] for r in per_rank),
                                "grad_rel_err": max(r["grad_rel_err"] for r in per_rank),
                                "update_rel_diff": max(r["update_rel_diff"] for r in per_rank),
                                "matches": all(r["ok"] for r in per_rank)}
            v = results[variant]
            log(f"[two_d_lab] {variant:<6} losses {' '.join(f'{x:.5f}' for x in v['losses'])} (one process "
                f"{' '.join(f'{x:.5f}' for x in v['reference_losses'])}); relative differences: loss "
                f"{v['loss_rel_diff']:.1e}, gradients {v['grad_rel_err']:.1e}, weights {v['update_rel_diff']:.1e}")
        out = {"world_size": info.world_size, "dp": dp, "tp": opts["tp"], "options": opts, "vocab_size": vocab,
               "shape": {"vocab_size": vocab, **{k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}},
               "variants": results,
               "tolerances": {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "update_rtol": UPDATE_RTOL},
               "seconds": time.perf_counter() - t0}
        write_result(info, opts["out_dir"], "two_d_lab", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
