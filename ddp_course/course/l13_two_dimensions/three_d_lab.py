"""Three dimensions: pipeline stages over ``pp``, FSDP2 over ``dp``, tensor (and sequence) parallelism
over ``tp``, trained with 1F1B, against one process.

    torchrun --standalone --nproc_per_node=8 -m ddp_course.course.l13_two_dimensions.three_d_lab --pp=2 --tp=2
    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l13_two_dimensions.three_d_lab --pp=2 --tp=1
    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l13_two_dimensions.three_d_lab --pp=2 --tp=2

The ranks form a mesh ``(pp, dp, tp)`` with ``dp = world size / (pp * tp)``, laid out row by row: rank
``(s * dp + d) * tp + t`` is tensor-parallel rank ``t`` of data-parallel rank ``d`` of pipeline stage
``s``. Each rank builds the same MiniGPT (seeded) and keeps its stage (lesson 11's ``Stage``: a run of
blocks, the embeddings on the first stage, the final norm and the head on the last). Then, as
``--strategy=fsdp_tp`` does with a whole model, the stage is split over ``tp`` (lesson 13's plan: heads
and hidden units, the norms and the residual stream on sequence shards; the residual stream is cut onto
the sequence on the first stage only, made whole before the head on the last:
``_tp_plan.stage_plan``) and sharded over ``dp`` (``fully_shard`` on each block, then the stage). A
dimension of size 1 is left out (``--tp=1`` is pipeline x FSDP; ``dp`` = 1 is pipeline x tensor
parallel).

A step is 1F1B by hand (lesson 11's ``hand_step`` with ``one_f_one_b_order``): each data-parallel rank
cuts its share of the global batch into ``--micro_batches``; stage ``s`` receives each micro-batch's
activations from the rank of stage ``s - 1`` with its own ``(d, t)`` (with sequence parallelism: its
sequence shard, ``block_size / tp`` positions) and sends the gradients back the same way. FSDP
reduce-scatters the gradients over ``dp`` after every micro-batch's backward and sums them in the
sharded gradient; the tied matrix's two copies (embedding on the first stage, head on the last) have
their gradients summed between the two ranks of each ``(d, t)`` that hold them (``tied_groups``).

Every rank trains the one-process reference too (the whole model on the whole global batch, the same
AdamW) and compares its own stage: each step's loss, the first step's gradients and the weights after
the last step, under their names in the whole model (the qkv rows put back in the model's order).
Rank 0 writes ``three_d_lab.json``: the mesh, each rank's figures and the seconds of each step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l11_beyond_data_parallel.held import SavedBytes
from ddp_course.course.l11_beyond_data_parallel.pp_lab import TIED, Stage, stage_bounds
from ddp_course.course.l11_beyond_data_parallel.schedules_lab import Recorder, hand_step, one_f_one_b_order
from ddp_course.course.l11_beyond_data_parallel.tp_lab import same_batches
from ddp_course.course.l13_two_dimensions.two_d_harness import (
    GRAD_RTOL,
    LOSS_RTOL,
    UPDATE_RTOL,
    CollectiveCounter,
    natural,
    reference,
    rel,
)
from ddp_course.course.l13_two_dimensions.two_d_lab import build
from ddp_course.course.options import lab_help, write_result
from ddp_course.dist import log, setup
from ddp_course.parallel import _tensor_parallel as heads
from ddp_course.parallel import _tp_plan as tp_plan

PROG = "torchrun --standalone --nproc_per_node=8 -m ddp_course.course.l13_two_dimensions.three_d_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/13_three_d", "pp": 2, "tp": 2, "micro_batches": 4, "steps": 3, "n_layer": 4, "n_head": 4,
    "n_embd": 64, "block_size": 32, "batch_size": 16, "lr": 3e-3, "seed": 0, "corpus": "tinyshakespeare",
    "timeout_s": 120.0,
}
HELP = lab_help("three_d_lab", DEFAULTS, pp="pipeline stages", tp="tensor-parallel ranks (dp = ranks / (pp * tp))",
                micro_batches="micro-batches per step on every data-parallel rank (1F1B's m)",
                steps="AdamW steps of the split model and of the one-process reference",
                n_layer="transformer blocks, at least pp", n_head="attention heads (divisible by --tp)",
                n_embd="model width (divisible by --tp)",
                block_size="tokens per sequence (divisible by --tp: sequence parallelism splits it)",
                batch_size="sequences per step, the whole global batch (divisible by dp * micro_batches)",
                seed="model initialisation and the batches")


def layout(world_size: int, opts: dict[str, Any]) -> tuple[int, int, int]:
    """(pp, dp, tp) for this world size, or a FlagError that says what to change."""
    pp, tp = opts["pp"], opts["tp"]
    if pp < 2 or tp < 1 or world_size % (pp * tp):
        raise FlagError(f"--pp={pp} x --tp={tp} must divide the {world_size} ranks, with --pp at least 2 "
                        f"(dp = ranks / (pp * tp)); e.g. 8 ranks: --pp=2 --tp=2; 4 ranks: --pp=2 --tp=1 or --tp=2.")
    dp = world_size // (pp * tp)
    if opts["n_layer"] < pp:
        raise FlagError(f"--n_layer={opts['n_layer']} cannot give each of {pp} stages a block; use --n_layer={pp} or more.")
    for key in ("n_head", "n_embd", "block_size"):
        if opts[key] % tp:
            raise FlagError(f"--{key}={opts[key]} must be divisible by --tp={tp}.")
    if opts["batch_size"] % (dp * opts["micro_batches"]):
        raise FlagError(f"--batch_size={opts['batch_size']} must be divisible by dp x micro_batches = "
                        f"{dp} x {opts['micro_batches']}: each data-parallel rank cuts its share into micro-batches.")
    return pp, dp, tp


def global_name(local: str, lo: int) -> str:
    """A stage's parameter name as the whole model names it: block ``j`` of a stage starting at block
    ``lo`` is block ``lo + j``; the head's copy of the tied matrix is ``tok_emb.weight``."""
    if local.startswith("blocks."):
        _, j, rest = local.split(".", 2)
        return f"blocks.{lo + int(j)}.{rest}"
    return TIED if local == "head.weight" else local


def tied_groups(pp: int, dp: int, tp: int) -> dict[tuple[int, int], Any]:
    """For each ``(d, t)``: the group of the first and the last stage's ranks, which hold the tied matrix.
    Every rank creates every group (``new_group`` is collective over the world)."""
    return {(d, t): dist.new_group([d * tp + t, ((pp - 1) * dp + d) * tp + t])
            for d in range(dp) for t in range(tp)}


def split_stage(opts: dict[str, Any], vocab: int, mesh, coords: tuple[int, int, int], dims: tuple[int, int, int],
                device: torch.device) -> Stage:
    """This rank's stage of the seeded MiniGPT, split over ``tp`` (when > 1), then sharded over ``dp``."""
    from torch.distributed.fsdp import fully_shard

    s, _, _ = coords
    pp, dp, tp = dims
    stage = Stage(build(opts, vocab, device), s, pp)
    if tp > 1:
        tp_plan.tensor_parallel(stage, mesh["tp"], root=tp_plan.stage_plan(stage.first, stage.last))
    if dp > 1:
        for block in stage.blocks:  # lesson 09's order: each block one unit, then the rest of the stage
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    return stage


def sync_tied(stage: Stage, group) -> None:
    """Sum the tied matrix's gradient over its two copies: this rank's shard of it (FSDP's local
    shard, the same rows on the first and the last stage), all-reduced in the pair's group."""
    from torch.distributed.tensor import DTensor

    if not (stage.first or stage.last):
        return
    grad = (stage.tok_emb.weight if stage.first else stage.head.weight).grad
    dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def train(opts: dict[str, Any], info, mesh, dims: tuple[int, int, int], data: list, vocab: int) -> dict[str, Any]:
    """Train this rank's stage and the one-process reference on the same global batches; this rank's figures."""
    pp, dp, tp = dims
    rank, m, cfg_block = info.rank, opts["micro_batches"], opts["block_size"]
    coords = (rank // (dp * tp), rank // tp % dp, rank % tp)
    s, d, t = coords
    heads.quiet_sequential_redistribution()
    model0 = build(opts, vocab, info.device)
    init = {n: p.detach().clone() for n, p in model0.named_parameters()}
    ref = reference(model0, data, opts["lr"])
    groups = tied_groups(pp, dp, tp)
    stage = split_stage(opts, vocab, mesh, coords, dims, info.device)
    lo, hi = stage_bounds(opts["n_layer"], pp)[s]
    # built before any forward: the root FSDP unit keeps its parameters unsharded after a forward (see
    # two_d_harness.train_side_by_side), and an optimizer built then would hold those
    opt = torch.optim.AdamW(stage.parameters(), lr=opts["lr"], foreach=False)  # the reference's AdamW
    order = one_f_one_b_order(m, pp, s)
    stride = dp * tp  # the ranks of neighbouring stages with the same (d, t)
    act_shape = (cfg_block // tp if tp > 1 else cfg_block, opts["n_embd"])
    per = opts["batch_size"] // dp
    rec = Recorder(SavedBytes(set()))
    losses, seconds, out = [], [], {}
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    # the first step's collectives over dp and tp (FSDP's and tensor parallelism's; the sends between
    # stages are point to point, not collectives)
    counter = CollectiveCounter({dim: mesh[dim].get_group() for dim, n in (("dp", dp), ("tp", tp)) if n > 1})
    for step, (x, y) in enumerate(data):
        xs, ys = x[d * per:(d + 1) * per].clone(), y[d * per:(d + 1) * per].clone()
        dist.barrier()
        t0 = time.perf_counter()
        rec.start()
        with counter if step == 0 else contextlib.nullcontext():
            loss = hand_step(stage, xs, ys, m, order, act_shape=act_shape, rec=rec, peers=(rank - stride, rank + stride))
        sync_tied(stage, groups[(d, t)])
        if step == 0:
            grads = natural({global_name(n, lo): p.grad for n, p in stage.named_parameters()}, opts["n_embd"], tp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        if stage.last:  # the global batch's loss: the mean of the data-parallel ranks' shares
            value = torch.tensor(loss)
            if dp_group is not None:
                dist.all_reduce(value, group=dp_group)
            losses.append(value.item() / dp)
    names = {global_name(n, lo): p for n, p in stage.named_parameters()}
    weights = natural(names, opts["n_embd"], tp)
    moved = {n: weights[n] - init[n] for n in weights}
    want = {n: ref["weights"][n] - init[n] for n in weights}
    out.update(rank=rank, coords={"pp": s, "dp": d, "tp": t}, blocks=[lo, hi], first=stage.first, last=stage.last,
               params=sorted(weights), local_elements=sum(full_local(p) for p in stage.parameters()),
               grad_rel_err=rel(grads, {n: ref["grads"][n] for n in grads}),
               update_rel_diff=rel(moved, want), seconds=seconds, collectives=counter.counts, reference_losses=ref["losses"])
    if stage.last:
        out.update(losses=losses, loss_rel_diff=max(abs(a - b) / b for a, b in zip(losses, ref["losses"])))
    out["ok"] = (out["grad_rel_err"] <= GRAD_RTOL and out["update_rel_diff"] <= UPDATE_RTOL
                 and out.get("loss_rel_diff", 0.0) <= LOSS_RTOL)
    return out


def full_local(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures over every rank: the worst of each parity figure, and the step times."""
    last = [r for r in per_rank if r["last"]]
    steps = [max(r["seconds"][i] for r in per_rank) for i in range(len(per_rank[0]["seconds"]))]
    return {"losses": last[0]["losses"], "reference_losses": per_rank[0]["reference_losses"],
            "loss_rel_diff": max(r["loss_rel_diff"] for r in last),
            "grad_rel_err": max(r["grad_rel_err"] for r in per_rank),
            "update_rel_diff": max(r["update_rel_diff"] for r in per_rank),
            "step_seconds": steps, "matches": all(r["ok"] for r in per_rank)}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    dims = layout(int(os.environ.get("WORLD_SIZE", 1)), opts)
    with setup(device="cpu", timeout_s=opts["timeout_s"], threads=1,
               because="the lesson is about the layouts on a laptop") as info:
        if not info.is_distributed:
            raise FlagError(f"the lab needs a process group: launch it with `{PROG} --pp=2 --tp=2`.")
        from torch.distributed.device_mesh import init_device_mesh

        pp, dp, tp = dims
        t0 = time.perf_counter()
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=("pp", "dp", "tp"))
        data, vocab = same_batches(opts, info.device)
        log(f"[three_d_lab] {info.world_size} ranks as a {pp} x {dp} x {tp} mesh (pp x dp x tp); "
            f"{opts['micro_batches']} micro-batches per data-parallel rank, 1F1B; global batch "
            f"{opts['batch_size']} x {opts['block_size']} tokens, {opts['steps']} AdamW steps")
        mine = train(opts, info, mesh, dims, data, vocab)
        per_rank: list = [None] * info.world_size
        dist.all_gather_object(per_rank, mine)
        result = summary(per_rank)
        for r in per_rank:
            c = r["coords"]
            log(f"[three_d_lab] rank {r['rank']} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']}) blocks "
                f"{r['blocks'][0]}-{r['blocks'][1] - 1}{' +embeddings' if r['first'] else ''}"
                f"{' +head' if r['last'] else ''}: {r['local_elements']:,} elements here; gradients "
                f"{r['grad_rel_err']:.1e}, weights {r['update_rel_diff']:.1e}"
                + (f", losses {r['loss_rel_diff']:.1e}" if r["last"] else "") + f" -> {'PASS' if r['ok'] else 'FAIL'}")
        log(f"[three_d_lab] losses {' '.join(f'{v:.5f}' for v in result['losses'])} (one process "
            f"{' '.join(f'{v:.5f}' for v in result['reference_losses'])}); steps "
            f"{' '.join(f'{v:.2f}' for v in result['step_seconds'])} s")
        out = {"world_size": info.world_size, "pp": pp, "dp": dp, "tp": tp, "options": opts, "vocab_size": vocab,
               "per_rank": per_rank, **result,
               "tolerances": {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "update_rtol": UPDATE_RTOL},
               "seconds": time.perf_counter() - t0}
        write_result(info, opts["out_dir"], "three_d_lab", out)
    return 0 if result["matches"] else 1


if __name__ == "__main__":
    sys.exit(main())
