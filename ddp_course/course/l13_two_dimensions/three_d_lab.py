"""Three dimensions: pipeline stages over ``pp``, FSDP2 over ``dp``, tensor (and sequence) parallelism
over ``tp``, trained with 1F1B, against one process.

    torchrun --standalone --nproc_per_node=8 -m ddp_course.course.l13_two_dimensions.three_d_lab --pp=2 --tp=2
    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l13_two_dimensions.three_d_lab --pp=2 --tp=1

The ranks form a mesh ``(pp, dp, tp)`` with ``dp = world size / (pp * tp)``, laid out row by row: rank
``(s * dp + d) * tp + t`` is tensor-parallel rank ``t`` of data-parallel rank ``d`` of pipeline stage
``s``. Each rank builds the same MiniGPT (seeded) and keeps its stage (a run of blocks, the embeddings
on the first stage, the final norm and the head on the last). The stage is split over ``tp`` (lesson
13's plan: heads and hidden units, the norms and the residual stream on sequence shards; the residual
stream is cut onto the sequence on the first stage only and made whole before the head on the last:
``_tp_plan.stage_plan``), then sharded over ``dp`` (``fully_shard`` on each block, then the stage). A
dimension of size 1 is left out (``--tp=1`` is pipeline x FSDP; ``dp`` = 1 is pipeline x tensor
parallel).

Each data-parallel rank cuts its share of the global batch into ``--micro_batches`` and runs them in
1F1B order: stage ``s`` receives each micro-batch's activations from the rank of stage ``s - 1`` with
its own ``(d, t)`` (with sequence parallelism, its slice of the sequence: ``block_size / tp``
positions) and sends the gradients back the same way; the tied matrix's two copies (embedding on the
first stage, head on the last) have their gradients summed between the two ranks of each ``(d, t)``
that hold them. Two variants (``VARIANTS``), each in the same processes:

- ``by_hand``: lesson 11's ``Stage`` and ``hand_step`` with ``one_f_one_b_order``; FSDP keeps its
  gradient synchronisation on, so every micro-batch's backward reduce-scatters;
- ``strategy``: the training job's ``--strategy=pipeline`` (``ddp_course.parallel.pipeline``: its
  ``wrap`` and its ``forward_backward``), which synchronises in the last micro-batch's backward only.

Every rank trains the one-process reference too (the whole model on the whole global batch, the same
AdamW) and compares its own stage: each step's loss, the first step's gradients and the weights after
the last step, under their names in the whole model (the qkv rows put back in the model's order); the
ranks' stages together must cover every parameter. Each rank also counts the first step's collectives
over ``dp`` and ``tp`` (lesson 13's counter). Rank 0 writes ``three_d_lab.json``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import TrainConfig
from ddp_course.course.l11_beyond_data_parallel.held import SavedBytes
from ddp_course.course.l11_beyond_data_parallel.pp_lab import GRAD_RTOL, LOSS_RTOL, TIED, UPDATE_RTOL, Stage
from ddp_course.course.l11_beyond_data_parallel.schedules_lab import Recorder, hand_step, one_f_one_b_order
from ddp_course.course.l11_beyond_data_parallel.tp_lab import same_batches
from ddp_course.course.l13_two_dimensions.two_d_harness import CollectiveCounter, natural, reference, rel
from ddp_course.course.l13_two_dimensions.two_d_lab import build
from ddp_course.course.options import lab_help, write_result
from ddp_course.dist import DistInfo, log, setup
from ddp_course.parallel import _tensor_parallel as heads
from ddp_course.parallel import _tp_plan as tp_plan
from ddp_course.parallel import pipeline

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

PROG = "torchrun --standalone --nproc_per_node=8 -m ddp_course.course.l13_two_dimensions.three_d_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/13_three_d", "pp": 2, "tp": 2, "micro_batches": 4, "steps": 3, "n_layer": 4, "n_head": 4,
    "n_embd": 64, "block_size": 32, "batch_size": 16, "lr": 3e-3, "seed": 0, "corpus": "tinyshakespeare",
    "variants": "by_hand,strategy", "timeout_s": 120.0,
}
VARIANTS = {
    "by_hand": "lesson 11's hand_step in 1F1B order; FSDP reduce-scatters in every micro-batch's backward",
    "strategy": "the training job's --strategy=pipeline; FSDP reduce-scatters in the last micro-batch's backward",
}
HELP = lab_help("three_d_lab", DEFAULTS, pp="pipeline stages", tp="tensor-parallel ranks (dp = ranks / (pp * tp))",
                micro_batches="micro-batches per step on every data-parallel rank (1F1B's m)",
                steps="AdamW steps of the split model and of the one-process reference",
                n_layer="transformer blocks, at least pp", n_head="attention heads (divisible by --tp)",
                n_embd="model width (divisible by --tp)",
                block_size="tokens per sequence (divisible by --tp: sequence parallelism splits it)",
                batch_size="sequences per step, the whole global batch (divisible by dp * micro_batches)",
                seed="model initialisation and the batches", variants=f"comma-separated, from {', '.join(VARIANTS)}")


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


def variants(opts: dict[str, Any]) -> list[str]:
    chosen = [v.strip() for v in opts["variants"].split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        raise FlagError(f"{PROG}: unknown variant(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(VARIANTS)}.")
    return chosen


def global_name(local: str, lo: int) -> str:
    """A parameter of lesson 11's ``Stage`` as the whole model names it: block ``j`` of a stage starting
    at block ``lo`` is block ``lo + j``; the head's copy of the tied matrix is ``tok_emb.weight``."""
    if local.startswith("blocks."):
        _, j, rest = local.split(".", 2)
        return f"blocks.{lo + int(j)}.{rest}"
    return TIED if local == "head.weight" else local


def tied_groups(pp: int, dp: int, tp: int) -> dict[tuple[int, int], ProcessGroup]:
    """For each ``(d, t)``: the group of the first and the last stage's ranks, which hold the tied matrix.
    Every rank creates every group (``new_group`` is collective over the world)."""
    return {(d, t): dist.new_group([d * tp + t, ((pp - 1) * dp + d) * tp + t])
            for d in range(dp) for t in range(tp)}


def split_stage(model: torch.nn.Module, mesh: DeviceMesh, s: int, dims: tuple[int, int, int]) -> Stage:
    """Stage ``s`` of ``model`` (lesson 11's), split over ``tp`` (when > 1), then sharded over ``dp``."""
    from torch.distributed.fsdp import fully_shard

    pp, dp, tp = dims
    stage = Stage(model, s, pp)
    if tp > 1:
        tp_plan.tensor_parallel(stage, mesh["tp"], root=tp_plan.stage_plan(stage.first, stage.last))
    if dp > 1:
        for block in stage.blocks:  # lesson 09's order: each block one unit, then the rest of the stage
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    return stage


def sync_tied(stage: Stage, group: ProcessGroup) -> None:
    """Sum the tied matrix's gradient over its two copies: this rank's shard of it (FSDP's local
    shard, the same rows on the first and the last stage), all-reduced in the pair's group."""
    from torch.distributed.tensor import DTensor

    if not (stage.first or stage.last):
        return
    grad = (stage.tok_emb.weight if stage.first else stage.head.weight).grad
    dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def local_numel(p: torch.Tensor) -> int:
    """Elements of ``p`` this rank holds (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


class _ByHand:
    """Lesson 11's stage and 1F1B by hand, on the lab's mesh."""

    def __init__(self, model: torch.nn.Module, opts: dict[str, Any], info: DistInfo, mesh: DeviceMesh,
                 dims: tuple[int, int, int]) -> None:
        pp, dp, tp = dims
        self.s, self.d, self.t = info.rank // (dp * tp), info.rank // tp % dp, info.rank % tp
        self.stage = split_stage(model, mesh, self.s, dims)
        self.lo = self.stage.block_range[0]
        self.group = tied_groups(pp, dp, tp)[(self.d, self.t)]
        self.order = one_f_one_b_order(opts["micro_batches"], pp, self.s)
        self.peers = (info.rank - dp * tp, info.rank + dp * tp)  # the neighbouring stages' ranks with this (d, t)
        self.received = None if self.stage.first else (
            opts["batch_size"] // dp // opts["micro_batches"], opts["block_size"] // tp if tp > 1 else opts["block_size"],
            opts["n_embd"])
        self.m, self.rec, self.mesh = opts["micro_batches"], Recorder(SavedBytes(set())), mesh

    def named(self) -> dict[str, torch.nn.Parameter]:
        return {global_name(n, self.lo): p for n, p in self.stage.named_parameters()}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """The share's loss on the last stage (None elsewhere)."""
        self.rec.start()
        act = self.received[1:] if self.received else ()
        loss = hand_step(self.stage, x, y, self.m, self.order, act_shape=act, rec=self.rec, peers=self.peers)
        sync_tied(self.stage, self.group)
        return loss


class _Strategy:
    """The training job's ``--strategy=pipeline``: its ``wrap`` and its ``forward_backward``."""

    def __init__(self, model: torch.nn.Module, opts: dict[str, Any], info: DistInfo, dims: tuple[int, int, int]) -> None:
        pp, dp, tp = dims
        cfg = TrainConfig(strategy="pipeline", pp=pp, tp=tp, **{k: opts[k] for k in ("n_layer", "n_head", "n_embd",
                                                                                      "block_size")})
        self.model = pipeline.wrap(model, info, cfg)
        self.stage, self.m = self.model.stage, opts["micro_batches"]
        self.s, self.d, self.t = self.model.index, info.rank // tp % dp, info.rank % tp
        self.lo = pipeline.bounds(opts["n_layer"], pp, self.s)[0]
        self.mesh = self.model.mesh
        self.received = None if self.stage.first else tuple(self.model.activations(
            opts["batch_size"] // dp // self.m, opts["block_size"], torch.device("cpu")).shape)

    def named(self) -> dict[str, torch.nn.Parameter]:
        return {TIED if n == pipeline.HEAD else n: p for n, p in self.stage.named_parameters()}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = pipeline.forward_backward(self.model, list(zip(x.chunk(self.m), y.chunk(self.m))),
                                         contextlib.nullcontext)
        return loss.item() if self.stage.last else None


def train(variant: str, opts: dict[str, Any], info: DistInfo, mesh: DeviceMesh, dims: tuple[int, int, int],
          data: list, vocab: int, ref: dict[str, Any], init: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train this rank's stage of ``variant`` on the global batches; this rank's figures against ``ref``."""
    pp, dp, tp = dims
    heads.quiet_sequential_redistribution()
    model = build(opts, vocab, info.device)
    run = _ByHand(model, opts, info, mesh, dims) if variant == "by_hand" else _Strategy(model, opts, info, dims)
    stage = run.stage
    # built before any forward: the root FSDP unit keeps its parameters unsharded after a forward (see
    # two_d_harness.train_side_by_side), and an optimizer built then would hold those
    opt = torch.optim.AdamW(stage.parameters(), lr=opts["lr"], foreach=False)  # the reference's AdamW
    per = opts["batch_size"] // dp
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    # the first step's collectives over dp and tp (FSDP's and tensor parallelism's; the sends between
    # stages are point to point, not collectives), on the lab's mesh and on the one the variant built
    counter = CollectiveCounter({dim: [m[dim].get_group() for m in (mesh, run.mesh)] for dim, n in (("dp", dp), ("tp", tp))
                                 if n > 1})
    losses, seconds = [], []
    for step, (x, y) in enumerate(data):
        xs, ys = x[run.d * per:(run.d + 1) * per].clone(), y[run.d * per:(run.d + 1) * per].clone()
        dist.barrier()
        t0 = time.perf_counter()
        with counter if step == 0 else contextlib.nullcontext():
            loss = run.step(xs, ys)
        if step == 0:
            grads = natural({n: p.grad for n, p in run.named().items()}, opts["n_embd"], tp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        if stage.last:  # the global batch's loss: the mean of the data-parallel ranks' shares
            value = torch.tensor(loss)
            if dp_group is not None:
                dist.all_reduce(value, group=dp_group)
            losses.append(value.item() / dp)
    weights = natural(dict(run.named()), opts["n_embd"], tp)
    moved = {n: weights[n] - init[n] for n in weights}
    want = {n: ref["weights"][n] - init[n] for n in weights}
    out: dict[str, Any] = dict(
        rank=info.rank, coords={"pp": run.s, "dp": run.d, "tp": run.t}, first=stage.first, last=stage.last,
        blocks=[run.lo, run.lo + len(stage.blocks)], params=sorted(weights), received=run.received,
        local_elements=sum(local_numel(p) for p in stage.parameters()),
        grad_rel_err=rel(grads, {n: ref["grads"][n] for n in grads}), update_rel_diff=rel(moved, want),
        seconds=seconds, collectives=counter.counts)
    if stage.last:
        out.update(losses=losses, loss_rel_diff=max(abs(a - b) / b for a, b in zip(losses, ref["losses"])))
    out["ok"] = (out["grad_rel_err"] <= GRAD_RTOL and out["update_rel_diff"] <= UPDATE_RTOL
                 and out.get("loss_rel_diff", 0.0) <= LOSS_RTOL)
    return out


def summary(per_rank: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One variant over every rank: the worst of each parity figure, whether the ranks' stages cover
    every parameter of the model (the tied matrix on both end stages), and the step times."""
    last = [r for r in per_rank if r["last"]]
    covered = set().union(*(r["params"] for r in per_rank)) == set(names) and all(
        TIED in r["params"] for r in per_rank if r["first"] or r["last"])
    steps = [max(r["seconds"][i] for r in per_rank) for i in range(len(per_rank[0]["seconds"]))]
    return {"per_rank": per_rank, "losses": last[0]["losses"],
            "loss_rel_diff": max(r["loss_rel_diff"] for r in last),
            "grad_rel_err": max(r["grad_rel_err"] for r in per_rank),
            "update_rel_diff": max(r["update_rel_diff"] for r in per_rank), "covers_every_parameter": covered,
            "step_seconds": steps, "matches": covered and all(r["ok"] for r in per_rank)}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    dims = layout(int(os.environ.get("WORLD_SIZE", 1)), opts)
    chosen = variants(opts)
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
        model0 = build(opts, vocab, info.device)
        init = {n: p.detach().clone() for n, p in model0.named_parameters()}
        ref = reference(model0, data, opts["lr"])
        results = {}
        for variant in chosen:
            per_rank: list = [None] * info.world_size
            dist.all_gather_object(per_rank, train(variant, opts, info, mesh, dims, data, vocab, ref, init))
            results[variant] = {"description": VARIANTS[variant], **summary(per_rank, sorted(init))}
            v = results[variant]
            log(f"[three_d_lab] {variant:<8} losses {' '.join(f'{x:.5f}' for x in v['losses'])}; relative to one "
                f"process: loss {v['loss_rel_diff']:.1e}, gradients {v['grad_rel_err']:.1e}, weights "
                f"{v['update_rel_diff']:.1e}; every parameter compared: {v['covers_every_parameter']} -> "
                f"{'PASS' if v['matches'] else 'FAIL'}")
        out = {"world_size": info.world_size, "pp": pp, "dp": dp, "tp": tp, "options": opts, "vocab_size": vocab,
               "reference_losses": ref["losses"], "variants": results,
               "tolerances": {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "update_rtol": UPDATE_RTOL},
               "seconds": time.perf_counter() - t0}
        write_result(info, opts["out_dir"], "three_d_lab", out)
    return 0 if all(v["matches"] for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
