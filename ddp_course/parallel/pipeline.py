"""Three dimensions: pipeline stages over ``--pp`` ranks, each stage split over ``--tp`` ranks with
``fsdp_tp``'s plan and sharded over the rest with FSDP2; a step is 1F1B over the step's micro-batches.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.train --strategy=pipeline --pp=2 --tp=2
    torchrun --standalone --nproc_per_node=8 -m ddp_course.train --strategy=pipeline --pp=2 --tp=2

The ranks form a mesh ``(pp, dp, tp)``, row by row: rank ``(s * dp + d) * tp + t`` is tensor-parallel
rank ``t`` of data-parallel rank ``d`` of stage ``s``; the ranks of one ``d`` read the same batches
(:func:`data_parallel`). Each rank builds the whole model (seeded, as every strategy) and keeps its
stage (:class:`StageModule`): a run of blocks, the embeddings on the first stage, the final norm and the
head on the last, under the whole model's parameter names. A dimension of size 1 is left out.

A step is 1F1B (lesson 11, section 3) over the step's ``--grad_accum_steps`` micro-batches, asked of
the strategy by the training loop (:func:`forward_backward`): a stage receives each micro-batch's
activations from the rank of the stage before with its own ``(d, t)`` and sends its gradients back;
FSDP synchronises the gradients in the last micro-batch's backward only (``set_requires_gradient_sync``,
as PyTorch's pipeline schedules do); then the tied matrix's two copies (embedding, head) have their
gradients summed between the first and the last stage. The loss travels from the last stage to every
rank. Evaluation runs the stages' forwards in turn (:class:`PipelineModel`'s ``forward``).

Checkpoints: each stage's states under the whole model's names, so a sharded checkpoint is every
stage's part; a full one gathers the stages' full states on rank 0, and each stage takes its own back.
The qkv rows go out in the model's own order (``fsdp_tp``'s convention). ``--precision=fp16`` (a loss
scaler whose skipped steps would have to agree over the stages) and ``--compile`` are refused.
Lesson 13, section 11 proves the same layout equal to one process (``three_d_lab``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.parallel import _tensor_parallel as heads
from ddp_course.parallel import _tp_plan as tp_plan
from ddp_course.parallel import fsdp, fsdp_tp

OPTIONS = {
    "pp": (2, "pipeline: stages, each a run of blocks; with --tp, each stage split over tp ranks, and FSDP over the "
           "world size / (pp x tp)", "at least 1"),
    "tp": fsdp_tp.OPTIONS["tp"],
}
TWO_RANKS = {"pp": 2}  # 2 x 1 x 1: two stages, nothing else split (tests/core/test_every_strategy.py)
HELP_ORDER = 6
LAUNCH_EXAMPLE = "--nproc_per_node=4 -m ddp_course.train --strategy=pipeline --pp=2 --tp=2"
HELPERS = ("layout", "bounds", "one_f_one_b", "init_device_mesh")

TIED, HEAD = "tok_emb.weight", "head.weight"


def layout(world_size: int, cfg: TrainConfig) -> tuple[int, int, int]:
    """(pp, dp, tp) for this world size; a ConfigError for what the pipeline cannot split or run."""
    pp, tp = cfg.pp, cfg.tp
    if pp < 2:
        raise ConfigError(f"--strategy=pipeline needs --pp=2 or more stages (got {pp}); without a pipeline use "
                          "--strategy=fsdp_tp.")
    if tp < 1 or world_size % (pp * tp):
        raise ConfigError(f"--pp={pp} x --tp={tp} does not divide the {world_size} rank(s) of this job; the "
                          f"data-parallel size is the world size / (pp x tp): e.g. 4 ranks, --pp=2 --tp=2 or --tp=1.")
    if cfg.n_layer < pp - 1:  # the last stage may hold the final norm and the head alone
        raise ConfigError(f"--n_layer={cfg.n_layer} cannot give each of the first {pp - 1} of {pp} stages a block; "
                          f"use --n_layer={pp - 1} or more, or a smaller --pp.")
    bad = tp_plan.indivisible(cfg, tp)
    if bad:
        raise ConfigError(f"--strategy=pipeline splits the heads, the width and the sequence of each stage over "
                          f"--tp={tp} ranks, but --{bad[0]}={bad[1]} does not divide by {tp}.")
    if cfg.precision == "fp16":
        raise ConfigError("--strategy=pipeline does not take --precision=fp16: each stage's loss scaler would skip "
                          "steps on its own; use --precision=bf16 or fp32.")
    if cfg.compile:
        raise ConfigError("--strategy=pipeline does not take --compile (it would compile the whole model, and a rank "
                          "runs one stage); leave it off.")
    return pp, world_size // (pp * tp), tp


def data_parallel(rank: int, world_size: int, cfg: TrainConfig) -> tuple[int, int]:
    """(data-parallel rank, size): the ranks of every stage and tensor-parallel rank of one ``d`` share batches."""
    pp, dp, tp = layout(world_size, cfg)
    return rank // tp % dp, dp


def bounds(n_layer: int, pp: int, s: int) -> tuple[int, int]:
    """The blocks [lo, hi) of stage ``s``: as even as possible, the first stages taking any extra one
    (with ``n_layer = pp - 1``, the last stage holds none: the final norm and the head)."""
    base, extra = divmod(n_layer, pp)
    lo = s * base + min(s, extra)
    return lo, lo + base + (s < extra)


class StageModule(nn.Module):
    """One stage of a MiniGPT, its modules under the whole model's names (``blocks`` keyed by each
    block's index in the model): the embeddings on the first stage, the final norm and the head (its
    own copy of the tied matrix) on the last."""

    def __init__(self, model: nn.Module, s: int, pp: int) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first, self.last = s == 0, s == pp - 1
        lo, hi = bounds(model.cfg.n_layer, pp, s)
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or activations in; activations, or the logits on the last stage, out."""
        if self.first:
            x = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


class PipelineModel(nn.Module):
    """What a rank trains: its stage, and where the other stages are. Its ``forward(x, y)`` runs the
    stages' forwards in turn (a collective over the pipeline: every rank calls it) and returns
    ``(None, loss)``, the batch's loss on every rank, as ``MiniGPT(x, y)`` does; training goes through
    :func:`forward_backward` instead."""

    def __init__(self, stage: StageModule, mesh, dims: tuple[int, int, int], tied: Any) -> None:
        super().__init__()
        self.stage, self.cfg = stage, stage.cfg
        self.pp, self.dp, self.tp = dims
        rank = dist.get_rank()
        stride = self.dp * self.tp  # the ranks of neighbouring stages with this rank's (d, t)
        self.index, self.prev, self.next = rank // stride, rank - stride, rank + stride
        self.mesh, self.pp_group, self.tied_group = mesh, mesh["pp"].get_group(), tied
        self.seq = stage.cfg.block_size // self.tp if self.tp > 1 else stage.cfg.block_size

    def activations(self, rows: int, seq: int, device: torch.device) -> torch.Tensor:
        """A buffer for one micro-batch's activations between stages (this rank's slice of the sequence)."""
        return torch.empty((rows, seq * self.seq // self.cfg.block_size, self.cfg.n_embd), device=device)

    def loss_everywhere(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss on every rank of the pipeline (an all-reduce over it; the others add 0)."""
        total = loss.detach().clone() if loss is not None else torch.zeros((), device=device)
        dist.all_reduce(total, group=self.pp_group)
        return total

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        stage, device = self.stage, x.device
        inp = x
        if not stage.first:
            inp = self.activations(x.shape[0], x.shape[1], device)
            _recv(inp, self.prev)
        out = stage(inp)
        if not stage.last:
            _send(out.float(), self.next)
            return None, self.loss_everywhere(None, device)
        return None, self.loss_everywhere(_lm_loss(out, y), device)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _through_cpu(t: torch.Tensor) -> bool:
    return t.is_cuda and dist.get_backend() == "gloo"  # gloo sends CPU tensors only


def _send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.detach().cpu() if _through_cpu(t) else t.detach().contiguous(), dst=dst)


def _recv(t: torch.Tensor, src: int) -> None:
    buf = torch.empty_like(t, device="cpu") if _through_cpu(t) else t
    dist.recv(buf, src=src)
    if buf is not t:
        t.copy_(buf)


def one_f_one_b(m: int, pp: int, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s order: ``pp - 1 - s`` forwards (never more than m) to fill the pipeline, then one
    forward and one backward in turn, then the backwards still owed; each as (kind, micro-batch)."""
    warmup = min(pp - 1 - s, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """This rank's stage, split over ``tp`` (fsdp_tp's plan, the sequence cut on the first stage only),
    then FSDP2 over ``dp`` (each block, then the stage)."""
    pp, dp, tp = dims = layout(info.world_size, cfg)
    mesh = init_device_mesh(info.device.type, dims, mesh_dim_names=("pp", "dp", "tp"))
    pairs = {(d, t): dist.new_group([d * tp + t, ((pp - 1) * dp + d) * tp + t]) for d in range(dp) for t in range(tp)}
    d, t = info.rank // tp % dp, info.rank % tp
    stage = StageModule(model, info.rank // (dp * tp), pp)
    if tp > 1:
        heads.quiet_sequential_redistribution()
        tp_plan.tensor_parallel(stage, mesh["tp"], root=tp_plan.stage_plan(stage.first, stage.last))
    if dp > 1:
        fsdp.shard(stage, stage.blocks.values(), mesh=mesh["dp"])
    return PipelineModel(stage, mesh, dims, pairs[(d, t)])


def forward_backward(model: PipelineModel, micro_batches: list, autocast: Callable[[], Any]) -> torch.Tensor:
    """One step's forwards and backwards over its micro-batches in 1F1B order; returns the mean loss
    (on every rank). Gradients accumulate in the stage's parameters, each micro-batch's loss divided by m."""
    stage, m = model.stage, len(micro_batches)
    device = micro_batches[0][0].device
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sends: list = []
    loss_sum = torch.zeros((), device=device)
    for kind, i in one_f_one_b(m, model.pp, model.index):
        x, y = micro_batches[i]
        if kind == "F":
            inp = x
            if not stage.first:
                inp = model.activations(x.shape[0], x.shape[1], device)
                _recv(inp, model.prev)
                inp.requires_grad_(True)
            with autocast():
                out = stage(inp)
                if stage.last:
                    out = _lm_loss(out, y) / m
            if stage.last:
                loss_sum += out.detach()
            else:  # in fp32 whatever autocast computed: the next stage's buffer is fp32 (gloo checks the bytes)
                sends.append(_isend(out.detach().float(), model.next))
            held[i] = (inp, out)
        else:
            inp, out = held.pop(i)
            if isinstance(stage, FSDPModule):  # reduce-scatter in the last backward only
                stage.set_requires_gradient_sync(i == m - 1)
            if stage.last:
                out.backward()
            else:
                grad = torch.empty_like(out, dtype=torch.float32)
                _recv(grad, model.next)
                out.backward(grad.to(out.dtype))
            if not stage.first:
                sends.append(_isend(inp.grad, model.prev))
    for work, _ in sends:
        work.wait()
    _sum_tied(model)
    return model.loss_everywhere(loss_sum if stage.last else None, device)


def _isend(t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    buf = t.cpu() if _through_cpu(t) else t.contiguous()
    return dist.isend(buf, dst=dst), buf


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _sum_tied(model: PipelineModel) -> None:
    """The tied matrix's gradient summed over its two copies (this rank's shard of each: the same rows)."""
    stage = model.stage
    if stage.first or stage.last:
        param = stage.tok_emb.weight if stage.first else stage.head.weight
        if param.grad is not None:
            dist.all_reduce(_local(param.grad), group=model.tied_group)


def clip_grad_norm_(model: PipelineModel, max_norm: float) -> torch.Tensor:
    """The global norm over every stage's gradients (the tied matrix counted once, on the first stage),
    then the clip on every rank."""
    stage = model.stage
    grads = [(n, p.grad) for n, p in stage.named_parameters() if p.grad is not None]
    squares = torch.zeros((), device=grads[0][1].device if grads else torch.device("cpu"))
    for name, g in grads:
        if name == HEAD:
            continue  # the last stage's copy of the tied matrix: the first stage counts it
        norm = torch.linalg.vector_norm(g)
        squares += (norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(squares, group=model.pp_group)
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_ does
    for _, g in grads:
        g.mul_(coef)
    return total


# --- states: each stage's, under the whole model's names ----------------------------------------

def _flat() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _names(model: PipelineModel) -> set[str]:
    return {n for n, _ in model.stage.named_parameters()}


def _stages(obj: Any, model: PipelineModel) -> list[Any]:
    """Every stage's ``obj`` in stage order (an all_gather_object over this rank's pipeline group)."""
    out: list[Any] = [None] * model.pp
    dist.all_gather_object(out, obj, group=model.pp_group)
    return out


def _cpu(state: dict) -> dict:
    return {k: _cpu(v) if isinstance(v, dict) else v.cpu() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def state_dict(model: PipelineModel, optimizer: torch.optim.Optimizer, options: Any = None) -> tuple[dict, dict]:
    """This stage's states (sharded), or with ``full_state_dict`` every stage's merged, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full = options is not None and options.full_state_dict
    # whole tensors on every rank of the stage; sharded, the optimizer's entries keyed by parameter (its
    # param_groups too: nested, every stage would save a list of the same name, and one would win)
    opts = StateDictOptions(full_state_dict=True) if full else _flat()
    model_sd, optim_sd = get_state_dict(model.stage, optimizer, options=opts)
    model_sd = heads.natural_rows(model_sd, model.cfg.n_embd, model.tp) if model.tp > 1 else model_sd
    optim_sd = heads.optimizer_rows(optim_sd, heads.natural_rows, model.cfg.n_embd, model.tp)
    if not full:
        return model_sd, optim_sd
    models, optims = _stages(_cpu(model_sd), model), _stages(_cpu(optim_sd), model)
    merged_groups = [{**group, "params": [p for o in optims for p in o["param_groups"][g]["params"]]}
                     for g, group in enumerate(optims[0]["param_groups"])]
    return ({k: v for sd in models for k, v in sd.items()},
            {"state": {k: v for o in optims for k, v in o["state"].items()}, "param_groups": merged_groups})


def load_state_dict(model: PipelineModel, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                    options: Any = None) -> None:
    """The inverse of :func:`state_dict`: a full checkpoint's entries of this stage only, the qkv rows
    back in the tensor-parallel order."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if options is not None and options.full_state_dict:
        mine = _names(model)
        buffers = {n for n, _ in model.stage.named_buffers()}
        model_sd = {k: v for k, v in model_sd.items() if k in mine or k in buffers}
        optim_sd = {"state": {k: v for k, v in optim_sd.get("state", {}).items() if k in mine},
                    "param_groups": [{**g, "params": [p for p in g["params"] if p in mine]}
                                     for g in optim_sd["param_groups"]]}
    else:
        options = _flat()
    if model.tp > 1:
        model_sd = heads.tp_rows(model_sd, model.cfg.n_embd, model.tp)
        optim_sd = heads.optimizer_rows(optim_sd, heads.tp_rows, model.cfg.n_embd, model.tp)
    set_state_dict(model.stage, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def model_state_dict(model: PipelineModel, options: Any = None) -> dict:
    """The whole model's full state dict, merged from every stage, on every rank (``final.pt``,
    fingerprints, sampling): a collective over the pipeline."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    own = get_model_state_dict(model.stage, options=StateDictOptions(full_state_dict=True))
    own = heads.natural_rows(own, model.cfg.n_embd, model.tp) if model.tp > 1 else own
    device = next(iter(own.values())).device
    return {k: v.to(device) for sd in _stages(_cpu(own), model) for k, v in sd.items()}


def gathered(model: PipelineModel) -> nn.Module:
    """A plain MiniGPT with every stage's full parameters (a collective: every rank)."""
    return fsdp.plain_copy(model, model_state_dict(model))
