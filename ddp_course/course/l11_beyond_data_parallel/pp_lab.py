"""Pipeline parallelism by hand: MiniGPT cut into stages, GPipe micro-batches, the bubble measured.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.pp_lab --out_dir=runs/pp_lab

Each rank is one *stage* of one MiniGPT: on 2 ranks, stage 0 holds the embeddings and the first half
of the blocks, stage 1 the other half, the final LayerNorm, the output head and the loss
(``split_stages``). A training step is GPipe's schedule (``gpipe_step``): the batch is cut into m
micro-batches; every stage runs all m forwards, receiving each micro-batch's activations from the
stage before it (``dist.recv``) and sending its own to the next (``dist.isend``); then all m
backwards, the activation gradients travelling back the same way. The micro-batch losses are
divided by m, so the gradients accumulated over the m backwards are those of the whole batch; one
optimizer step follows.

The tied weight. MiniGPT's output head *is* its token embedding (one (V, C) matrix, lesson 01's
weight tying), but the embedding lives on the first stage and the head on the last. Each of the two
stages keeps its own copy, initialised equal, and after the backward the two copies' gradients are
summed with one all-reduce between the first and the last stage (``sync_tied``), as Megatron-LM
does with its "embedding group": each copy then holds the full gradient of the tied matrix, both
take the same AdamW step, and they stay equal. No other stage takes part.

The lab measures

- **parity** (``--parity_steps`` optimizer steps with ``--parity_micro_batches`` micro-batches):
  the pipeline against one process training the whole model on the same batches from the same
  initial weights (each rank trains that reference itself and compares its own stage): the losses,
  the first step's gradients and the weights after the last step. Two classic mistakes run too:
  ``no_tied_sync`` (the tied matrix's gradients never summed) and ``no_loss_scale`` (micro-batch
  losses not divided by m);
- **the bubble**: for each m in ``--micro_batches`` (same global batch), ``--repeats`` timed
  forward-and-backward phases, interleaved over m. Each rank times its compute (``busy``: the
  forwards and backwards, nothing else) and the phase's wall time from a common barrier to the end
  of the last stage's work; idle fraction = 1 - busy / wall, against GPipe's (p - 1) / (m + p - 1);
- **a transfer**: one activation micro-batch sent to the next stage and back (ping-pong), beside the
  compute of one micro-batch, so the reader sees that communication is small next to the bubble;
- with ``--library=true``: the same stages through ``torch.distributed.pipelining``
  (``PipelineStage`` and ``ScheduleGPipe``): one more parity variant, ``torch_pipelining``, and its
  step time at the parity check's m (wall time only: the library does not report its compute).

``--device=auto`` (default) runs on the GPUs with NCCL when every rank has one, else on the CPU with
gloo; the first line says which. Rank 0 writes ``pp_lab.json`` into ``--out_dir``. Options are
``--key=value`` (``--help`` lists them).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_course.cli import FlagError, command, number_list, parse_flags
from ddp_course.course.options import lab_help, require_device, write_result
from ddp_course.data import CharTokenizer, load_corpus
from ddp_course.dist import log, setup
from ddp_course.metrics import environment, load_average
from ddp_course.model import GPTConfig, MiniGPT

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.pp_lab"

# Tolerances of the parity check (fp32). The pipeline computes the same sums as one process, in
# another order: each gradient is accumulated over m micro-batch backwards instead of one, and the
# tied matrix's two halves are added by an all-reduce instead of by autograd. That changes last
# bits: measured ~1e-7 relative on the losses and gradients. AdamW divides each update by the square
# root of its second moment plus eps, so a near-zero gradient's rounding moves its weight by far more
# than SGD would (lesson 04, section 6, measures the step against |g|): the weights after a few steps
# differ by ~1e-5 of the distance they moved (the lab prints it).
# The mistakes are far out: a tied matrix left unsynchronised misses tens of percent of its gradient,
# a missing 1/m multiplies every gradient by m. Each tolerance sits between, with room on both sides.
LOSS_RTOL = 1e-5  # |loss_pp - loss_ref| / loss_ref, every step
GRAD_RTOL = 1e-5  # |g_pp - g_ref| / |g_ref| over a stage's parameters, first step
UPDATE_RTOL = 1e-3  # |w_pp - w_ref| / |w_ref - w_0| over a stage's parameters, after the last step

DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/pp_lab",
    "n_layer": 4,  # split evenly over the stages
    "n_head": 4,
    "n_embd": 128,
    "block_size": 64,
    "batch_size": 32,  # the global batch: sequences per optimizer step, cut into m micro-batches
    "micro_batches": "1,2,4,8",  # the m values whose bubble is timed
    "repeats": 5,
    "parity_steps": 3,
    "parity_micro_batches": 4,
    "lr": 3e-3,
    "mistakes": True,  # also run the two classic mistakes in the parity check
    "library": True,  # also run torch.distributed.pipelining's ScheduleGPipe
    "corpus": "tinyshakespeare",
    "seed": 0,
    "timeout_s": 60.0,
    "device": "auto",
}

HELP = lab_help("pp_lab", DEFAULTS,
                n_layer="transformer blocks, split evenly over the stages (at least one per stage)",
                batch_size="sequences per optimizer step (the global batch), divisible by every m",
                micro_batches="comma-separated micro-batch counts m whose bubble is timed, e.g. 1,2,4,8",
                repeats="timed steps per m (interleaved over m), after one untimed step each",
                parity_steps="optimizer steps of the parity check",
                parity_micro_batches="micro-batches per step in the parity check",
                mistakes="also run the mistakes no_tied_sync and no_loss_scale in the parity check",
                library="also run torch.distributed.pipelining (PipelineStage, ScheduleGPipe)",
                corpus="tinyshakespeare, offline, or a path to a text file",
                seed="model init and the choice of batches")

VARIANTS = {
    "gpipe": "micro-batch losses divided by m, the tied matrix's gradients summed between the first and last stage",
    "no_tied_sync": "mistake: the embedding's and the head's copies of the tied matrix never exchange gradients",
    "no_loss_scale": "mistake: micro-batch losses not divided by m (gradients m times too large)",
    "torch_pipelining": "torch.distributed.pipelining: PipelineStage and ScheduleGPipe, the tied matrix summed as above",
}


# --------------------------------------------------------------------------------------------------
# the stages

def stage_bounds(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """The blocks [lo, hi) of each stage: as even as possible, the first stages taking any extra one."""
    if n_layer < n_stages:
        raise FlagError(f"--n_layer={n_layer} cannot give each of {n_stages} stages a block; "
                        f"use --n_layer={n_stages} or more, or fewer ranks.")
    base, extra = divmod(n_layer, n_stages)
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (s < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class Stage(nn.Module):
    """One pipeline stage of a MiniGPT: a run of its blocks, with the embeddings on the first stage and
    the final LayerNorm, the output head and the loss on the last. The model's code is untouched: the
    stage holds the model's own modules and repeats ``MiniGPT.forward`` for its part."""

    def __init__(self, model: MiniGPT, index: int, n_stages: int) -> None:
        super().__init__()
        lo, hi = stage_bounds(model.cfg.n_layer, n_stages)[index]
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.cfg = model.cfg  # the whole model's shape (lesson 13's tensor-parallel plan checks it)
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.block_range = (lo, hi)
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head  # head.weight: this stage's copy of the tied matrix

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: token ids (b, T) in; other stages: activations (b, T, C). Out: activations
        (b, T, C), or on the last stage the mean cross-entropy (with ``targets``) or the logits."""
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (b, T, C)
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x))  # (b, T, V)
        if targets is None:
            return logits
        return lm_loss(logits, targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """MiniGPT's loss, as in ``MiniGPT.forward``: mean cross-entropy over every token, in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(opts: dict[str, Any], vocab_size: int, device: torch.device) -> MiniGPT:
    """The same initial weights on every rank (seeded), so that every stage and the reference start equal."""
    torch.manual_seed(opts["seed"])
    cfg = GPTConfig(vocab_size=vocab_size, block_size=opts["block_size"], n_layer=opts["n_layer"],
                    n_head=opts["n_head"], n_embd=opts["n_embd"])
    return MiniGPT(cfg).to(device)


def split_stages(model: MiniGPT, index: int, n_stages: int) -> tuple[Stage, dict[str, nn.Parameter]]:
    """This rank's stage, and its parameters under their names in the whole model (the head's copy of
    the tied matrix is called ``tok_emb.weight``, its name in ``model.named_parameters()``)."""
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head is listed once, as tok_emb.weight
    stage = Stage(model, index, n_stages)
    return stage, {names[id(p)]: p for p in stage.parameters()}


TIED = "tok_emb.weight"


def tied_group(n_stages: int):
    """The process group of the first and the last stage, which both hold the tied matrix (the whole
    world on 2 ranks). Every rank must call this (``new_group`` is collective)."""
    return None if n_stages == 2 else dist.new_group([0, n_stages - 1])


def sync_tied(params: dict[str, nn.Parameter], stage: Stage, group) -> None:
    """Sum the tied matrix's gradient over its two copies (first and last stage): one all-reduce.

    The embedding's copy holds the gradient from the lookups, the head's copy the gradient from the
    output projection; the whole model's gradient of the one tied matrix is their sum."""
    if stage.first or stage.last:
        dist.all_reduce(params[TIED].grad, op=dist.ReduceOp.SUM, group=group)


# --------------------------------------------------------------------------------------------------
# GPipe by hand

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA kernels run asynchronously: a clock needs them finished


# Point to point between stages. NCCL sends CUDA tensors as they are; gloo sends only CPU tensors
# (PyTorch's table of backends: gloo has send/recv on CPU, not on GPU), so on gloo a CUDA tensor
# travels through a CPU copy. The course only gets gloo with CUDA tensors from the test-only
# shared-GPU option (``dist.SHARED_GPU_VAR``); on the CPU, and with NCCL, these are plain send/recv.

def _through_cpu(t: torch.Tensor) -> bool:
    return t.is_cuda and dist.get_backend() == "gloo"


def send(t: torch.Tensor, dst: int) -> None:
    dist.send(t.cpu() if _through_cpu(t) else t, dst=dst)


def isend(t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    """Start sending ``t``: (work, the tensor that must stay alive until ``work.wait()``)."""
    buf = t.cpu() if _through_cpu(t) else t
    return dist.isend(buf, dst=dst), buf


def recv(t: torch.Tensor, src: int) -> None:
    """Receive into ``t`` (blocking)."""
    if _through_cpu(t):
        buf = torch.empty_like(t, device="cpu")
        dist.recv(buf, src=src)
        t.copy_(buf)
    else:
        dist.recv(t, src=src)


def gpipe_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, m: int, *, act_shape: tuple[int, ...],
               scale_loss: bool = True, clock: float | None = None) -> dict[str, Any]:
    """One forward-and-backward of GPipe over ``m`` micro-batches; gradients accumulate in ``stage``.

    ``x``, ``y``: the whole batch (every stage has it; the first uses ``x``, the last ``y``). Forward:
    micro-batch i's activations come from stage s - 1 (``dist.recv``, blocking: the stage needs them)
    and go to stage s + 1 (``dist.isend``: the stage goes on with the next micro-batch while they
    travel). Backward, in the same order: the gradient of this stage's output comes back from stage
    s + 1, and the gradient of its input goes to stage s - 1.

    Returns the summed micro-batch losses (last stage) and, with ``clock`` (the time of a common
    barrier), every compute interval ``(kind, micro-batch, start, end)`` in seconds since then.
    """
    device = x.device
    rank = dist.get_rank()
    xs, ys = x.chunk(m), y.chunk(m)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    sends: list = []  # (work, tensor): each tensor stays referenced until its send has completed
    intervals: list[tuple[str, int, float, float]] = []
    total_loss = torch.zeros((), device=device)

    def timed(kind: str, i: int, fn, *args):
        if clock is None:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        _sync(device)
        intervals.append((kind, i, t0 - clock, time.perf_counter() - clock))
        return out

    for i in range(m):  # all forwards
        if stage.first:
            inp = xs[i]
        else:
            inp = torch.empty((xs[i].shape[0], *act_shape), device=device)
            recv(inp, rank - 1)
            inp.requires_grad_(True)  # the backward must produce the gradient to send back
        if stage.last:
            out = timed("F", i, stage, inp, ys[i]) / (m if scale_loss else 1)  # this micro-batch's share
            total_loss += out.detach()
        else:
            out = timed("F", i, stage, inp)
            act = out.detach()
            sends.append(isend(act, rank + 1))
        inputs.append(inp)
        outputs.append(out)
    for i in range(m):  # all backwards
        if stage.last:
            timed("B", i, outputs[i].backward)
        else:
            grad = torch.empty_like(outputs[i])
            recv(grad, rank + 1)
            timed("B", i, outputs[i].backward, grad)
        if not stage.first:
            sends.append(isend(inputs[i].grad, rank - 1))
        outputs[i] = inputs[i] = None  # free this micro-batch's activations
    for work, _ in sends:
        work.wait()
    _sync(device)
    return {"loss": total_loss.item() if stage.last else None, "intervals": intervals,
            "end": None if clock is None else time.perf_counter() - clock}


# --------------------------------------------------------------------------------------------------
# parity with one process

def batches(tokens: torch.Tensor, opts: dict[str, Any], n: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``n`` batches of ``--batch_size`` windows of the corpus at seeded offsets (the same on every rank)."""
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    T, B = opts["block_size"], opts["batch_size"]
    out = []
    for _ in range(n):
        starts = torch.randint(len(tokens) - T - 1, (B,), generator=g)
        win = torch.stack([tokens[s: s + T + 1] for s in starts.tolist()])
        # contiguous: sliced from (T + 1)-token windows, inputs and targets would have a row stride of
        # T + 1. PyTorch 2.10's PipelineStage checks every micro-batch against the metadata of a
        # contiguous one and refuses it ("stride mismatch": forward_one_chunk -> _validate_fwd_input in
        # torch/distributed/pipelining/stage.py, validate_tensor_metadata in _utils.py); a micro-batch
        # cut from a contiguous batch along its first dimension is contiguous too
        out.append((win[:, :-1].contiguous().to(device), win[:, 1:].contiguous().to(device)))
    return out


def optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def reference_run(opts: dict[str, Any], vocab: int, data: list, device: torch.device) -> dict[str, Any]:
    """One process, the whole model, the whole batch: losses, first-step gradients, final weights."""
    model = build_model(opts, vocab, device)
    return one_process(model, optimizer(model.parameters(), opts["lr"]), data)


def one_process(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list) -> dict[str, Any]:
    """Train ``model`` on each ``(x, y)`` of ``data`` in turn: each step's loss, the first step's
    gradients and the final weights, by parameter name (lesson 13's reference too)."""
    losses, grads = [], None
    for x, y in data:
        _, loss = model(x, y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """|a - b| / |b| over a list of tensors, in float64."""
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b))
    den = sum((y.double() ** 2).sum() for y in b)
    return float((num / den).sqrt())


def library_schedule(stage: Stage, info, m: int):
    """``(x, y) -> loss`` running ``stage`` through ``torch.distributed.pipelining``'s GPipe schedule.

    ``ScheduleGPipe(PipelineStage(...), m, loss_fn=...)`` cuts the batch into m micro-batches itself,
    runs all forwards then all backwards with its own sends and receives, and (``scale_grads=True``,
    its default) divides the accumulated gradients by m. The tied matrix stays ours to synchronise.
    The loss (the mean of the micro-batch losses) is returned on the last stage, None elsewhere.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    schedule = ScheduleGPipe(PipelineStage(stage, stage.index, info.world_size, info.device), n_microbatches=m,
                             loss_fn=lm_loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if stage.first:
            schedule.step(x)
        elif stage.last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        return sum(loss.item() for loss in losses) / m if stage.last else None

    return step


def pipeline_run(opts: dict[str, Any], vocab: int, data: list, info, variant: str, ref: dict[str, Any],
                 init: dict[str, torch.Tensor], group) -> dict[str, Any]:
    """``--parity_steps`` pipeline steps of ``variant``, compared on this rank with the reference."""
    m = opts["parity_micro_batches"]
    stage, params = split_stages(build_model(opts, vocab, info.device), info.rank, info.world_size)
    opt = optimizer(params.values(), opts["lr"])
    if variant == "torch_pipelining":
        forward_backward = library_schedule(stage, info, m)
    else:
        def forward_backward(x: torch.Tensor, y: torch.Tensor) -> float | None:
            return gpipe_step(stage, x, y, m, act_shape=(opts["block_size"], opts["n_embd"]),
                              scale_loss=variant != "no_loss_scale")["loss"]
    losses, grad_err, tied_err = [], None, None
    for x, y in data:
        losses.append(forward_backward(x, y))
        if variant != "no_tied_sync":
            sync_tied(params, stage, group)
        if grad_err is None:  # the first step's gradients, at the same weights as the reference's
            grad_err = rel([q.grad for q in params.values()], [ref["grads"][n] for n in params])
            tied_err = rel([params[TIED].grad], [ref["grads"][TIED]]) if TIED in params else None
        opt.step()
        opt.zero_grad(set_to_none=True)
    names = list(params)
    update = rel([params[n].detach() - init[n] for n in names], [ref["weights"][n] - init[n] for n in names])
    return {"losses": losses, "grad_rel_err": grad_err, "tied_grad_rel_err": tied_err, "update_rel_diff": update,
            "tied_weight": params[TIED].detach().clone() if TIED in params else None}


def parity(opts: dict[str, Any], vocab: int, tokens: torch.Tensor, info, group) -> dict[str, Any]:
    """Every variant against the one-process reference; numbers gathered from every stage."""
    data = batches(tokens, opts, opts["parity_steps"], info.device)
    ref = reference_run(opts, vocab, data, info.device)
    init = {n: p.detach().clone() for n, p in build_model(opts, vocab, info.device).named_parameters()}
    names = ["gpipe"] + (["no_tied_sync", "no_loss_scale"] if opts["mistakes"] else []) + (
        ["torch_pipelining"] if opts["library"] else [])
    out: dict[str, Any] = {}
    last = info.world_size - 1
    for variant in names:
        mine = pipeline_run(opts, vocab, data, info, variant, ref, init, group)
        copies = mine.pop("tied_weight")
        if info.rank in (0, last):  # do the two copies of the tied matrix still agree after training?
            other = copies.clone()
            dist.broadcast(other, src=0, group=group)
            mine["tied_copies_max_diff"] = (copies - other).abs().max().item()
        per_rank: list = [None] * info.world_size
        dist.all_gather_object(per_rank, mine)
        losses = per_rank[last]["losses"]
        v = out[variant] = {
            "description": VARIANTS[variant], "losses": losses, "reference_losses": ref["losses"],
            "loss_rel_diff": max(abs(a - b) / b for a, b in zip(losses, ref["losses"])),
            "grad_rel_err": max(r["grad_rel_err"] for r in per_rank),
            "grad_rel_err_per_stage": [r["grad_rel_err"] for r in per_rank],
            "tied_grad_rel_err": max(r["tied_grad_rel_err"] for r in per_rank if r["tied_grad_rel_err"] is not None),
            "update_rel_diff": max(r["update_rel_diff"] for r in per_rank),
            "update_rel_diff_per_stage": [r["update_rel_diff"] for r in per_rank],
            "tied_copies_max_diff": per_rank[last]["tied_copies_max_diff"],
        }
        v["matches"] = (v["loss_rel_diff"] <= LOSS_RTOL and v["grad_rel_err"] <= GRAD_RTOL
                        and v["update_rel_diff"] <= UPDATE_RTOL)
        log(f"[pp_lab] parity {variant:<16} losses {' '.join(f'{x:.5f}' for x in losses)} "
            f"(one process: {' '.join(f'{x:.5f}' for x in ref['losses'])}); gradient rel. error "
            f"{v['grad_rel_err']:.1e}, weights after {len(losses)} steps {v['update_rel_diff']:.1e} of the update")
    return {"micro_batches": opts["parity_micro_batches"], "steps": opts["parity_steps"], "variants": out,
            "tolerances": {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "update_rtol": UPDATE_RTOL}}


# --------------------------------------------------------------------------------------------------
# the bubble

def bubble_formula(p: int, m: int) -> float:
    """GPipe's idle fraction with p equal stages and m micro-batches: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def measure_bubble(opts: dict[str, Any], vocab: int, tokens: torch.Tensor, info, ms: list[int]) -> dict[str, Any]:
    """Time the forward-and-backward phase of GPipe for every m, ``--repeats`` times, interleaved.

    Wall time of a repeat: from the moment the first rank leaves a barrier to the moment the last
    stage is done. Busy: the sum of a rank's compute intervals. The ranks leave a barrier up to a few
    milliseconds apart on a loaded machine, so on one node (``time.perf_counter`` reads the same
    monotonic clock in every process there) all ranks' times are put on one clock, that of the first
    rank to leave; across nodes each rank's clock starts at its own exit from the barrier. The
    optimizer step is left out: it is the same for every m."""
    p = info.world_size
    shared_clock = info.local_world_size == info.world_size  # one node: one monotonic clock
    stage, _ = split_stages(build_model(opts, vocab, info.device), info.rank, p)
    x, y = batches(tokens, opts, 1, info.device)[0]
    act = (opts["block_size"], opts["n_embd"])
    rows: dict[int, list[dict]] = {m: [] for m in ms}
    for m in ms:  # one untimed step each: first-call allocations, gloo's connections
        gpipe_step(stage, x, y, m, act_shape=act)
        stage.zero_grad(set_to_none=True)
    for _ in range(opts["repeats"]):
        for m in ms:  # interleaved, so that a slow moment of the machine hits every m alike
            dist.barrier()
            clock = time.perf_counter()
            out = gpipe_step(stage, x, y, m, act_shape=act, clock=clock)
            stage.zero_grad(set_to_none=True)
            busy = sum(b - a for _, _, a, b in out["intervals"])
            rows[m].append({"clock": clock, "busy": busy, "end": out["end"], "intervals": out["intervals"]})
    gathered: list = [None] * p
    dist.all_gather_object(gathered, rows)  # every rank's rows, to compute the common wall time
    per_m = {}
    for m in ms:
        reps = []
        for r in range(opts["repeats"]):
            first = min(g[m][r]["clock"] for g in gathered)
            shift = [g[m][r]["clock"] - first if shared_clock else 0.0 for g in gathered]  # onto one clock
            wall = max(g[m][r]["end"] + d for g, d in zip(gathered, shift))
            busy = [g[m][r]["busy"] for g in gathered]
            reps.append({"wall": wall, "busy": busy, "idle": [1 - b / wall for b in busy],
                         "intervals": [[(k, i, a + d, b + d) for k, i, a, b in g[m][r]["intervals"]]
                                       for g, d in zip(gathered, shift)]})
        idle = [statistics.mean(r["idle"]) for r in reps]  # mean over the stages, one value per repeat
        median_rep = sorted(range(len(reps)), key=lambda i: idle[i])[len(reps) // 2]
        spans = {k: [b - a for r in reps for stage_iv in r["intervals"] for kind, _, a, b in stage_iv if kind == k]
                 for k in ("F", "B")}  # every micro-batch's forward and backward, all stages and repeats
        per_m[str(m)] = {
            "m": m, "micro_batch_size": opts["batch_size"] // m, "formula": bubble_formula(p, m),
            "idle": idle, "idle_per_stage": [[r["idle"][s] for r in reps] for s in range(p)],
            "wall_s": [r["wall"] for r in reps], "busy_s": [[r["busy"][s] for r in reps] for s in range(p)],
            "forward_s": statistics.median(spans["F"]), "backward_s": statistics.median(spans["B"]),
            "timeline": reps[median_rep]["intervals"],  # the repeat with the median idle fraction
        }
        s = per_m[str(m)]
        log(f"[pp_lab] bubble m={m:<2} idle {statistics.median(idle):6.1%} "
            f"({min(idle):.1%}-{max(idle):.1%} over {len(idle)}), formula {s['formula']:.1%}; "
            f"wall {statistics.median(s['wall_s']) * 1e3:.1f} ms, one micro-batch F {s['forward_s'] * 1e3:.2f} ms "
            f"B {s['backward_s'] * 1e3:.2f} ms")
    return {"stages": p, "micro_batches": ms, "repeats": opts["repeats"], "shared_clock": shared_clock, "per_m": per_m}


def measure_transfer(opts: dict[str, Any], info, m: int, rounds: int = 20) -> dict[str, Any]:
    """One micro-batch of activations (at the largest m) sent from stage 0 to stage 1 and back,
    ``rounds`` times: half a round trip is one transfer (with the Python call around it)."""
    t = torch.randn(opts["batch_size"] // m, opts["block_size"], opts["n_embd"], device=info.device)
    times = []
    for _ in range(rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if info.rank == 0:
            send(t, 1)
            recv(t, 1)
        elif info.rank == 1:
            recv(t, 0)
            send(t, 0)
        _sync(info.device)
        times.append((time.perf_counter() - t0) / 2)
    times = times[2:]  # the first ones set up the connection
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, times)
    return {"bytes": t.numel() * t.element_size(), "micro_batch_size": opts["batch_size"] // m,
            "one_way_s": statistics.median(gathered[0])}


# --------------------------------------------------------------------------------------------------
# torch.distributed.pipelining

def library_timing(opts: dict[str, Any], vocab: int, tokens: torch.Tensor, info) -> dict[str, Any]:
    """``--repeats`` forward-and-backward steps through ``torch.distributed.pipelining`` at the parity
    check's m: wall time only (the library does not report its compute intervals)."""
    m = opts["parity_micro_batches"]
    stage, _ = split_stages(build_model(opts, vocab, info.device), info.rank, info.world_size)
    step = library_schedule(stage, info, m)
    x, y = batches(tokens, opts, 1, info.device)[0]
    step(x, y)  # untimed: the stages exchange their shapes on the first step
    stage.zero_grad(set_to_none=True)
    wall = []
    for _ in range(opts["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        _sync(info.device)
        t = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the last stage is done
        wall.append(t.item())
        stage.zero_grad(set_to_none=True)
    log(f"[pp_lab] torch.distributed.pipelining ScheduleGPipe m={m}: step {statistics.median(wall) * 1e3:.1f} ms "
        f"({min(wall) * 1e3:.1f}-{max(wall) * 1e3:.1f} over {len(wall)})")
    return {"micro_batches": m, "wall_s": wall}


# --------------------------------------------------------------------------------------------------

def check_options(opts: dict[str, Any], world_size: int) -> list[int]:
    """The m values to time; a ``FlagError`` for a batch they do not divide or a size below 1."""
    ms = number_list(opts["micro_batches"], "micro_batches", int, "1,2,4,8")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "repeats", "parity_steps",
                "parity_micro_batches"):
        if opts[key] < 1:
            raise FlagError(f"--{key} must be at least 1 (got {opts[key]}).")
    for m in [*ms, opts["parity_micro_batches"]]:
        if m < 1 or opts["batch_size"] % m:
            raise FlagError(f"--batch_size={opts['batch_size']} must be divisible by every micro-batch count "
                            f"(got m={m}); e.g. --batch_size=32 with --micro_batches=1,2,4,8.")
    if opts["n_embd"] % opts["n_head"]:
        raise FlagError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")
    stage_bounds(opts["n_layer"], world_size)
    return ms


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    require_device(opts["device"])
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed or info.world_size < 2:
            raise FlagError(f"a pipeline needs at least 2 stages, one per rank: launch it with `{PROG}`.")
        ms = check_options(opts, info.world_size)
        if opts["library"] and info.device.type == "cuda" and info.backend == "gloo":
            raise FlagError("torch.distributed.pipelining sends CUDA tensors with the process group's send/recv, "
                            "which gloo does not do (only NCCL does): run with --library=false here, or with "
                            "one GPU per rank (NCCL).")
        corpus = load_corpus(opts["corpus"], announce=log)
        tok = CharTokenizer.from_text(corpus.text)
        tokens = torch.tensor(tok.encode(corpus.text), dtype=torch.long)
        vocab = tok.vocab_size
        group = tied_group(info.world_size)
        model = build_model(opts, vocab, torch.device("cpu"))
        bounds = stage_bounds(opts["n_layer"], info.world_size)
        stage_params = [sum(p.numel() for p in Stage(model, s, info.world_size).parameters())
                        for s in range(info.world_size)]
        log(f"[pp_lab] {info.world_size} stages, {info.device_reason}; MiniGPT {model.num_params():,} parameters "
            f"({opts['n_layer']} blocks, width {opts['n_embd']}), blocks per stage "
            f"{[hi - lo for lo, hi in bounds]}, parameters per stage {stage_params} (the tied matrix on both "
            f"ends); global batch {opts['batch_size']} x {opts['block_size']} tokens")
        del model

        t0 = time.perf_counter()
        par = parity(opts, vocab, tokens, info, group)
        t_parity = time.perf_counter() - t0
        t0 = time.perf_counter()
        bub = measure_bubble(opts, vocab, tokens, info, ms)
        bub["transfer"] = measure_transfer(opts, info, max(ms))
        t_bubble = time.perf_counter() - t0
        tr = bub["transfer"]
        log(f"[pp_lab] one transfer of a micro-batch's activations at m={max(ms)} ({tr['bytes']:,} bytes): "
            f"{tr['one_way_s'] * 1e3:.2f} ms")
        t0 = time.perf_counter()
        lib = library_timing(opts, vocab, tokens, info) if opts["library"] else None
        t_lib = time.perf_counter() - t0

        out = {"world_size": info.world_size, "backend": info.backend, "device": info.device.type,
               "device_reason": info.device_reason, "options": opts, "vocab_size": vocab,
               "shape": {"vocab_size": vocab, **{k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}},
               "blocks_per_stage": [hi - lo for lo, hi in bounds], "params_per_stage": stage_params,
               "parity": par, "bubble": bub, "library": lib,
               "seconds": {"parity": t_parity, "bubble": t_bubble, "library": t_lib},
               "load_average": load_average(), "environment": environment()}
        write_result(info, opts["out_dir"], "pp_lab", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
