"""The nn.DataParallel mechanism by hand, step by step, on CPU tensors (lesson 03).

``nn.DataParallel`` only does its work on accelerator devices (CUDA, XPU, MTIA or a custom backend; not
Apple's MPS: ``DataParallel.__init__`` in ``torch/nn/parallel/data_parallel.py`` keeps ``device_ids``
empty when ``torch._utils._get_available_device_type()`` finds no accelerator or finds MPS), so on a
CPU machine this module does the same steps in plain PyTorch, each one a function the notebook calls and
prints:

1. :func:`scatter`      split the batch along dim 0 into one chunk per replica (``torch.chunk``, like DP)
2. :func:`replicate`    replica 0 is the model; the others are ``copy.deepcopy`` of it
3. :func:`parallel_forward`  one Python thread per replica, each runs its replica on its chunk
4. :func:`gather`       concatenate the outputs on replica 0's device; the loss is computed there
5. backward             autograd sends each replica the gradient of the loss w.r.t. its own weights
6. :func:`reduce_gradients`  sum the replicas' gradients into replica 0 (and clear the others)
7. update               the optimizer steps replica 0 only
8. :func:`broadcast`    copy replica 0's new weights into every other replica

:func:`dp_step` runs all eight and returns a :class:`StepReport` (shapes, which replica holds what,
timings, bytes); :func:`compare_with_single` checks that DP steps equal single-device steps on the
whole batch. Replicas can live on any devices (``devices=[cpu, cpu, ...]`` here); nothing in this
file needs CUDA.

How this maps onto ``nn.DataParallel``: DP re-replicates at the start of every forward (its
``replicate`` is a broadcast of every weight from GPU 0, so steps 2 and 8 are one operation there),
and the replicas' weights are outputs of that broadcast in the autograd graph, so backward sums the
gradients into the real model by itself (the broadcast's backward is a reduce-add, step 6). Here the
steps are separate so that each can be seen and timed.
"""

from __future__ import annotations

import copy
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ddp_course.check.records import notebook_exercise
from ddp_course.course import noise
from ddp_course.course.tiny import VOCAB
from ddp_course.parallel.dp import lm_loss

Chunk = torch.Tensor


# --------------------------------------------------------------------------------------------------
# the eight steps

def cpu_devices(n: int) -> list[torch.device]:
    """``n`` stand-in devices for the replicas on a CPU machine (all the same CPU)."""
    if n < 1:
        raise ValueError(f"need at least one replica (got {n}).")
    return [torch.device("cpu")] * n


def scatter(x: torch.Tensor, devices: Sequence[torch.device]) -> list[Chunk]:
    """Split the batch (dim 0) into one chunk per device, as DataParallel's scatter does.

    ``torch.chunk`` makes chunks of ceil(B / n) rows, so the last one may be smaller -- or missing:
    a batch of 5 over 4 devices gives chunks of 2, 2, 1 and only 3 replicas run (DP does the same).
    """
    if x.size(0) < 1:
        raise ValueError("cannot scatter an empty batch.")
    return [c.to(d) for c, d in zip(x.chunk(len(devices), dim=0), devices)]


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """Replica 0 is ``module`` itself (the one the optimizer updates); the others are deep copies.

    ``copy.deepcopy`` copies every parameter's storage (and keeps tied weights tied), then each copy
    moves to its device.
    """
    return [module.to(devices[0])] + [copy.deepcopy(module).to(d) for d in devices[1:]]


@dataclass
class ForwardRecord:
    """What one replica did in :func:`parallel_forward`."""

    replica: int
    device: str
    thread: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    start_s: float  # seconds after the threads were started
    end_s: float
    saved_bytes: int  # activations autograd keeps for this replica's backward


def _saved_bytes_hooks(params: set[int], storages: dict[int, int]):
    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def parallel_forward(replicas: Sequence[nn.Module], chunks: Sequence[Chunk]
                     ) -> tuple[list[torch.Tensor], list[ForwardRecord]]:
    """Run replica k on chunk k, one Python thread each (DP's ``parallel_apply``); return the outputs.

    Grad mode is thread-local in PyTorch, so each thread sets the caller's mode (as parallel_apply
    does). An exception in a thread is re-raised here, naming the replica.
    """
    n = len(chunks)
    if n > len(replicas):
        raise ValueError(f"{n} chunks but only {len(replicas)} replicas.")
    outputs: list[torch.Tensor | None] = [None] * n
    records: list[ForwardRecord | None] = [None] * n
    errors: list[BaseException | None] = [None] * n
    grad_enabled = torch.is_grad_enabled()
    t0 = time.perf_counter()

    def work(k: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                params = {p.untyped_storage().data_ptr() for p in replicas[k].parameters()}
                storages: dict[int, int] = {}
                start = time.perf_counter() - t0
                with _saved_bytes_hooks(params, storages):
                    out = replicas[k](chunks[k])
                end = time.perf_counter() - t0
            outputs[k] = out
            records[k] = ForwardRecord(k, str(chunks[k].device), threading.current_thread().name,
                                       tuple(chunks[k].shape), tuple(out.shape), start, end,
                                       sum(storages.values()))
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller's thread below
            errors[k] = exc

    threads = [threading.Thread(target=work, args=(k,), name=f"replica-{k}") for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, exc in enumerate(errors):
        if exc is not None:
            raise RuntimeError(f"replica {k} failed in its forward thread: {exc!r}") from exc
    return list(outputs), list(records)  # type: ignore[arg-type]


def gather(outputs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate the replicas' outputs along dim 0 on ``device`` (replica 0's): DP's ``gather``.

    ``torch.cat`` is differentiable: in backward it hands each replica the slice of the gradient
    that belongs to its chunk.
    """
    return torch.cat([o.to(device) for o in outputs], dim=0)


def reduce_gradients(replicas: Sequence[nn.Module]) -> None:
    """Sum every replica's gradients into replica 0's, then clear the others' (``.grad = None``).

    A sum, not a mean: the loss is the mean over the WHOLE gathered batch, so each replica's
    gradient is already its share of the total. (DDP averages instead, because each rank's loss is
    the mean over its own shard only.)
    """
    first = list(replicas[0].parameters())
    for other in replicas[1:]:
        for p0, p in zip(first, other.parameters(), strict=True):
            if p.grad is None:
                continue
            g = p.grad.to(p0.device)
            if p0.grad is None:
                p0.grad = g.clone()
            else:
                p0.grad.add_(g)
            p.grad = None


@torch.no_grad()
def broadcast(replicas: Sequence[nn.Module]) -> None:
    """Copy replica 0's parameters and buffers into every other replica (in place)."""
    src = list(replicas[0].parameters()) + list(replicas[0].buffers())
    for other in replicas[1:]:
        dst = list(other.parameters()) + list(other.buffers())
        for a, b in zip(src, dst, strict=True):
            b.copy_(a.to(b.device))


# --------------------------------------------------------------------------------------------------
# inspection helpers the notebook prints

def max_replica_diff(replicas: Sequence[nn.Module]) -> float:
    """Largest |w_k - w_0| over every parameter of every replica k (0.0 when all are in step)."""
    diff = 0.0
    first = list(replicas[0].parameters())
    for other in replicas[1:]:
        for p0, p in zip(first, other.parameters(), strict=True):
            diff = max(diff, (p.detach().to(p0.device) - p0.detach()).abs().max().item())
    return diff


def grad_norm(module: nn.Module) -> float:
    """L2 norm of all of a module's gradients (0.0 when it holds none)."""
    grads = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.stack(grads).norm().item() if grads else 0.0


def replica_table(replicas: Sequence[nn.Module]) -> list[dict]:
    """One row per replica: device, parameters, whether its weights share memory with replica 0's."""
    ptr0 = {p.untyped_storage().data_ptr() for p in replicas[0].parameters()}
    rows = []
    for k, r in enumerate(replicas):
        params = list(r.parameters())
        shares = any(p.untyped_storage().data_ptr() in ptr0 for p in params)
        rows.append({"replica": k, "device": str(params[0].device), "parameters": sum(p.numel() for p in params),
                     "MiB": sum(p.numel() * p.element_size() for p in params) / 2**20,
                     "storage": "the model itself" if k == 0 else ("SHARED with 0" if shares else "own copy"),
                     "holds grads": any(p.grad is not None for p in params), "grad norm": grad_norm(r)})
    return rows


def format_table(rows: Sequence[dict], floats: str = "{:.4g}") -> str:
    """A plain-text table of a list of dicts (same keys in every row)."""
    if not rows:
        return "(empty)"
    cols = list(rows[0])

    def cell(v) -> str:
        return floats.format(v) if isinstance(v, float) else str(v)

    cells = [[cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# one whole DP step

STAGES = ("scatter", "forward", "gather", "loss", "backward", "reduce", "update", "broadcast")


@dataclass
class StepReport:
    """What one :func:`dp_step` did: the numbers the notebook prints and plots."""

    loss: float
    chunk_shapes: list[tuple[int, ...]]
    forward: list[ForwardRecord]
    gathered_shape: tuple[int, ...]
    gathered_device: str
    grad_norms_before_reduce: list[float]  # per replica, right after backward
    grad_norm_after_reduce: float  # replica 0, after the sum
    diff_after_update: float  # max |w_k - w_0|: the replicas are stale after the update ...
    diff_after_broadcast: float  # ... and equal again after the broadcast
    seconds: dict[str, float]  # stage -> wall seconds
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)  # (stage, replica, start, end)
    memory: list[dict[str, int]] = field(default_factory=list)  # per replica: kind -> bytes held in this step

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def device0_only_s(self) -> float:
        """Seconds in stages that only replica 0 works in (everything but the parallel forward)."""
        return self.total_s - self.seconds["forward"]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dp_step(replicas: Sequence[nn.Module], optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
            *, reduce_fn: Callable[[Sequence[nn.Module]], None] = reduce_gradients,
            broadcast_fn: Callable[[Sequence[nn.Module]], None] | None = broadcast) -> StepReport:
    """One data-parallel training step over the whole batch ``x, y`` (targets stay on replica 0).

    ``optimizer`` holds replica 0's parameters. ``reduce_fn``/``broadcast_fn`` can be swapped to see
    what a wrong reduction or a missing broadcast does (``broadcast_fn=None`` skips the broadcast).
    """
    devices = [next(r.parameters()).device for r in replicas]
    seconds: dict[str, float] = {}
    spans: list[tuple[str, int, float, float]] = []
    t_start = time.perf_counter()

    def timed(stage: str, fn, replica: int = 0):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        seconds[stage] = t1 - t0
        spans.append((stage, replica, t0 - t_start, t1 - t_start))
        return out

    chunks = timed("scatter", lambda: scatter(x, devices))
    t_fwd = time.perf_counter()
    outputs, records = timed("forward", lambda: parallel_forward(replicas, chunks))
    spans.pop()  # the forward is drawn per replica, from the threads' own start and end times
    base = t_fwd - t_start
    spans += [("forward", r.replica, base + r.start_s, base + r.end_s) for r in records]
    logits = timed("gather", lambda: gather(outputs, devices[0]))
    loss_saved: dict[int, int] = {}
    with _saved_bytes_hooks(set(), loss_saved):
        loss = timed("loss", lambda: lm_loss(logits, y.to(devices[0])))
    timed("backward", loss.backward)
    before = [grad_norm(r) for r in replicas]
    grads_held = [_tensor_bytes(p.grad for p in r.parameters() if p.grad is not None) for r in replicas]
    timed("reduce", lambda: reduce_fn(replicas))
    after = grad_norm(replicas[0])

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    timed("update", update)
    stale = max_replica_diff(replicas)
    if broadcast_fn is not None:
        timed("broadcast", lambda: broadcast_fn(replicas))
    else:
        seconds["broadcast"] = 0.0
    fresh = max_replica_diff(replicas)

    opt_state = _tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor))
    memory = []
    for k, r in enumerate(replicas):
        row = {"parameters": _tensor_bytes(r.parameters()), "gradients": grads_held[k],
               "activations": records[k].saved_bytes if k < len(records) else 0,
               "optimizer state": opt_state if k == 0 else 0,
               "gathered outputs + loss": (logits.numel() * logits.element_size() + sum(loss_saved.values()))
               if k == 0 else 0}
        memory.append(row)
    return StepReport(loss=loss.item(), chunk_shapes=[tuple(c.shape) for c in chunks], forward=records,
                      gathered_shape=tuple(logits.shape), gathered_device=str(logits.device),
                      grad_norms_before_reduce=before, grad_norm_after_reduce=after, diff_after_update=stale,
                      diff_after_broadcast=fresh, seconds=seconds, spans=spans, memory=memory)


def single_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """The reference: one device, the whole batch, the model's own loss."""
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


# --------------------------------------------------------------------------------------------------
# the equivalence check

# Tolerances, fp32 (unit roundoff u = 2**-24 = 6e-8). Both paths do the same arithmetic; what differs
# is the order of the sums: a matrix product over 3 rows of the batch may be blocked differently from
# one over all 8, and each weight's gradient is a sum over B*T positions that DP adds up per replica
# first and then across replicas. Such reorderings move a sum of K terms by at most ~K*u of the sum of
# magnitudes; the largest sums here have K = B*T = 256 terms (the weight gradients), so K*u = 1.5e-5
# relative to the gradient's scale. GRAD_RTOL = 1e-4 leaves a factor of ~7 above that worst case.
# The bugs the check exists to catch are far larger: averaging instead of summing changes every
# gradient by a factor of n (error ~ 0.5..0.67 of the scale), a missing broadcast computes the next
# step's gradients on stale weights, a forgotten replica adds nothing to the sum, gradients left on
# the replicas pile onto the next step's: each moves the gradient by a sizeable fraction of its scale
# (0.2 and more on this model, measured in the lesson), thousands of times the tolerance.
GRAD_RTOL = 1e-4
# The loss is a mean of B*T = 256 per-token losses computed from logits that differ by rounding only:
# a few ulps of the loss value (~4 * 6e-8 = 2.4e-7 relative); 1e-6 relative is 4x that.
LOSS_RTOL = 1e-6
# Weights: the check steps both models with SGD + momentum, whose update is linear in the gradient,
# so the weights differ by lr times the gradient differences: the same relative size as GRAD_RTOL,
# measured against how far training has moved the weights. (AdamW divides every entry by its own
# running magnitude, which blows up the rounding noise of near-zero gradient entries to ~lr * 1e-3;
# a tolerance for that would be loose enough to hide real bugs, so AdamW is not used for the check.)
PARAM_RTOL = 1e-4


@dataclass
class Comparison:
    """DP steps against single-device steps from the same initial weights on the same batches."""

    n_replicas: int
    batch: int
    chunk_shapes: list[tuple[int, ...]]
    losses_single: list[float]
    losses_dp: list[float]
    grad_err: list[float]  # per step: max |g_dp - g_single| / max |g_single| (replica 0 vs the model)
    param_err: list[float]  # per step: max |w_dp - w_single| / max |w_single - w_initial| after the update
    stale_grads: list[bool]  # per step: some replica other than 0 still held gradients after the reduce
    ref_grad_norms: list[float]  # per step: norm of the single-device gradient
    reports: list[StepReport]

    @property
    def loss_err(self) -> float:
        return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(self.losses_single, self.losses_dp))

    @property
    def ok(self) -> bool:
        return (self.loss_err <= LOSS_RTOL and max(self.grad_err) <= GRAD_RTOL
                and max(self.param_err) <= PARAM_RTOL)

    def summary(self) -> str:
        return (f"{len(self.losses_dp)} step(s), batch {self.batch} over {self.n_replicas} replicas "
                f"(chunks {[s[0] for s in self.chunk_shapes]}): loss rel. diff {self.loss_err:.1e} "
                f"(tol {LOSS_RTOL:.0e}), gradient rel. diff {max(self.grad_err):.1e} (tol {GRAD_RTOL:.0e}), "
                f"weights rel. diff {max(self.param_err):.1e} (tol {PARAM_RTOL:.0e}) -> "
                f"{'EQUAL within tolerance' if self.ok else 'DIFFERENT'}")


def tiny_model_config(vocab_size: int = VOCAB, **changes):
    """The small MiniGPT the mechanism cells use (fast on a CPU, every kind of layer present)."""
    from ddp_course.model import GPTConfig

    return GPTConfig(**{"vocab_size": vocab_size, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64,
                        **changes})


def sample_batches(steps: int, batch: int, block_size: int, vocab_size: int, seed: int = 0):
    """``steps`` random (x, y) token batches, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab_size, (batch, block_size), generator=g),
             torch.randint(0, vocab_size, (batch, block_size), generator=g)) for _ in range(steps)]


def make_optimizer(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    """SGD with momentum for the equivalence check: an update linear in the gradient (see PARAM_RTOL)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def compare_with_single(n_replicas: int = 3, batch: int = 8, steps: int = 3, *, seed: int = 0, gpt_config=None,
                        batches=None, devices: Sequence[torch.device] | None = None,
                        reduce_fn: Callable[[Sequence[nn.Module]], None] = reduce_gradients,
                        broadcast_fn: Callable[[Sequence[nn.Module]], None] | None = broadcast) -> Comparison:
    """Train two copies of one MiniGPT for ``steps`` steps: one on one device with the whole batch,
    one with :func:`dp_step` over ``n_replicas`` replicas; compare losses, gradients and weights.

    The gradient is compared before the update, not only the weights after it: with an optimizer that
    divides by the gradient's own size (Adam), a gradient scaled by 1/n (a mean instead of a sum)
    would barely move the weights and could pass a weights-only check.
    """
    from ddp_course.model import MiniGPT

    cfg = gpt_config or tiny_model_config()
    devices = list(devices) if devices is not None else cpu_devices(n_replicas)
    batches = batches or sample_batches(steps, batch, cfg.block_size, cfg.vocab_size, seed)
    torch.manual_seed(seed)
    ref = MiniGPT(cfg).to(devices[0])
    dp_model = copy.deepcopy(ref)
    ref_opt, dp_opt = make_optimizer(ref), make_optimizer(dp_model)
    initial = [p.detach().clone() for p in ref.parameters()]
    replicas = replicate(dp_model, devices)
    captured: list[list[torch.Tensor]] = []  # replica 0's gradient right after each reduction

    def reduce_and_capture(reps: Sequence[nn.Module]) -> None:
        reduce_fn(reps)
        captured.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                         for p in reps[0].parameters()])

    comp = Comparison(len(devices), batches[0][0].size(0), [], [], [], [], [], [], [], [])
    for x, y in batches:
        x, y = x.to(devices[0]), y.to(devices[0])
        _, loss = ref(x, y)
        loss.backward()
        g_ref = [p.grad.detach().clone() for p in ref.parameters()]
        report = dp_step(replicas, dp_opt, x, y, reduce_fn=reduce_and_capture, broadcast_fn=broadcast_fn)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        scale = max(g.abs().max().item() for g in g_ref)
        comp.grad_err.append(max((a.to(b.device) - b).abs().max().item() for a, b in zip(captured[-1], g_ref)) / scale)
        moved = max((a.detach() - w0).abs().max().item() for a, w0 in zip(ref.parameters(), initial))
        comp.param_err.append(max((a.detach() - b.detach().to(a.device)).abs().max().item()
                                  for a, b in zip(ref.parameters(), dp_model.parameters())) / moved)
        comp.ref_grad_norms.append(torch.stack([g.norm() for g in g_ref]).norm().item())
        comp.stale_grads.append(any(p.grad is not None for r in replicas[1:] for p in r.parameters()))
        comp.losses_single.append(loss.item())
        comp.losses_dp.append(report.loss)
        comp.reports.append(report)
        comp.chunk_shapes = report.chunk_shapes
    return comp


def _runs_course_reduce(fn: Callable[[Sequence[nn.Module]], None], replicas: Sequence[nn.Module]) -> bool:
    """Call ``fn(replicas)``; True when it ran the course's own :func:`reduce_gradients`, however it reached
    it (the function itself, an alias, a wrapper, an import inside it). A profile hook on this thread sees
    every Python call ``fn`` makes; the previous hook is put back."""
    found = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is reduce_gradients.__code__:
            found.append(True)

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        fn(replicas)
    finally:
        sys.setprofile(previous)
    return bool(found)


@notebook_exercise("my_reduce")
def check_reduce(fn: Callable[[Sequence[nn.Module]], None]):
    """Notebook exercise: a hand-written gradient reduction must make DP steps equal single-device steps.

    Returns a :class:`ddp_course.check.Verdict` that says what is wrong when it is not. A reduction that
    runs the course's own :func:`reduce_gradients` is refused: that is the code the exercise asks for.
    """
    from ddp_course.check import Verdict, not_complete

    delegated = []

    def watched(replicas: Sequence[nn.Module]) -> None:
        if _runs_course_reduce(fn, replicas):
            delegated.append(True)

    try:
        comp = compare_with_single(n_replicas=3, batch=8, steps=3, reduce_fn=watched)
    except NotImplementedError:
        return not_complete("my_reduce()")
    except Exception as exc:  # noqa: BLE001 -- a learner's bug is reported, not raised
        return Verdict(False, f"your reduction raised {type(exc).__name__}: {exc}")
    if delegated:
        return Verdict(False, f"my_reduce() hands its work to the course's own version, {__name__}.reduce_gradients: "
                              "that is the code this exercise asks you to write. Write my_reduce() with PyTorch's own "
                              "calls (the hints above the exercise say which), then re-run the check.")
    if comp.ok:
        return Verdict(True, f"DP with your reduction equals the single-device step. {comp.summary()}")
    first = comp.grad_err[0]
    n = comp.n_replicas
    # which simple mistake is it? Measure the ratio of the reduced gradient to the true one on step 1.
    if first > GRAD_RTOL:
        ratio = comp.reports[0].grad_norm_after_reduce / max(comp.ref_grad_norms[0], 1e-12)
        if abs(ratio - 1 / n) < 0.05 / n:
            hint = (f"replica 0's gradient is 1/{n} of the right one: you averaged. The loss is the mean over the "
                    "whole gathered batch, so each replica's gradient is already its share -- sum them.")
        elif ratio < 0.9:
            hint = ("replica 0's gradient is too small: add every other replica's .grad into replica 0's "
                    "(parameters pair up in the same order in every replica).")
        else:
            hint = "replica 0's gradient is not the sum of the replicas' gradients."
        return Verdict(False, f"after the first step's reduction the gradient differs from the single-device "
                              f"one by {first:.2g} of its scale: {hint}")
    if any(comp.stale_grads):
        return Verdict(False, "step 1 is right, but the other replicas still hold their gradients after the "
                              "reduction, so the next backward adds onto them: set p.grad = None on replicas "
                              "1.. once their gradients are in replica 0.")
    return Verdict(False, f"the first step is right but later ones drift: {comp.summary()}")


# --------------------------------------------------------------------------------------------------
# costs: replication, and what threads can and cannot run in parallel

def _median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def replication_cost(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_replicas: int = 2,
                     repeats: int = 5) -> dict[str, float]:
    """Median seconds to replicate ``model`` (deepcopy per extra replica) and to broadcast its weights,
    against one forward+backward of the model on the batch ``x, y``.

    nn.DataParallel pays a replication at the start of EVERY forward: the weights are broadcast from
    GPU 0 and Python module objects are rebuilt for every other GPU.
    """
    replicas = replicate(model, cpu_devices(n_replicas))
    replicate_s = _median_time(lambda: replicate(model, cpu_devices(n_replicas)), repeats)
    broadcast_s = _median_time(lambda: broadcast(replicas), repeats)

    def fwd_bwd() -> None:
        _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    fwd_bwd()  # warm-up
    step_s = _median_time(fwd_bwd, repeats)
    n_params = sum(p.numel() for p in model.parameters())
    return {"parameters": n_params, "MiB": n_params * 4 / 2**20, "replicas": n_replicas,
            "replicate_s": replicate_s, "broadcast_s": broadcast_s, "fwd_bwd_s": step_s,
            "replicate_vs_step": replicate_s / step_s, "broadcast_vs_step": broadcast_s / step_s}


def _python_work(n: int) -> int:
    s = 0
    for i in range(n):  # pure Python bytecode: holds the GIL the whole time
        s += i * i
    return s


def gil_demo(n_threads: int = 2, python_iters: int = 300_000, matmul_size: int = 768, matmuls: int = 6,
             repeats: int = 5) -> dict:
    """Run the same work ``n_threads`` times one after another, then in ``n_threads`` threads at once,
    for pure Python (holds the GIL) and for torch matrix products (release it while they compute).

    For each it reports wall seconds, the speed-up (sequential / threaded), and ``cores``: the CPU
    seconds the process burned during the threaded run divided by its wall seconds -- how many cores
    were busy at once on average. Under the GIL pure Python cannot exceed about 1 core whatever the
    machine is doing; kernels that release it can reach ``n_threads`` when that many cores are free.
    torch runs one intra-op thread during the measurement, so any parallelism comes from the threads.
    The work is large enough (about 50 ms per thread for the matmuls) that starting the threads costs
    little beside it: with 6 products of 384 x 384 each, two threads kept 1.6 cores busy on 2 idle
    cores and finished no sooner.
    """
    a = torch.randn(matmul_size, matmul_size)

    def torch_work() -> None:
        for _ in range(matmuls):
            a @ a

    def measure(work: Callable[[], object], threaded: bool) -> tuple[float, float]:
        def once() -> None:
            if threaded:
                ts = [threading.Thread(target=work) for _ in range(n_threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
            else:
                for _ in range(n_threads):
                    work()

        once()  # warm-up
        walls, cpus = [], []
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            once()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        return walls, [c / w for c, w in zip(cpus, walls)]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {"threads": n_threads, "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)()}
    try:
        for kind, work in (("python", lambda: _python_work(python_iters)), ("torch", torch_work)):
            seq_walls, seq_cores = measure(work, threaded=False)
            thr_walls, thr_cores = measure(work, threaded=True)
            seq_wall, thr_wall = statistics.median(seq_walls), statistics.median(thr_walls)
            out[kind] = {"sequential_s": seq_wall, "threaded_s": thr_wall, "speedup": seq_wall / thr_wall,
                         "sequential_rounds_s": seq_walls, "threaded_rounds_s": thr_walls,
                         "cores_sequential": statistics.median(seq_cores), "cores": statistics.median(thr_cores)}
    finally:
        torch.set_num_threads(before)
    return out


# Two threads "ran side by side" when they kept clearly more cores busy than one thread alone.
BUSY_FACTOR = 1.3


def matmul_verdict(gil: dict) -> str:
    """What :func:`gil_demo`'s threaded matmuls show, resting on both of its numbers: how many cores the
    threads kept busy, and whether they finished sooner (over the repeats, through ``noise``)."""
    r, n = gil["torch"], gil["threads"]
    c = noise.compare(r["threaded_rounds_s"], r["sequential_rounds_s"], workers=n,
                      names=(f"{n} threads at once", "one after another"))
    busy = (f"The matmuls kept {r['cores']:.2f} cores busy (one thread alone: {r['cores_sequential']:.2f}) and "
            f"took {c['ratio']:.2f}x the time of running one after another")
    if c["disturbed"]:
        return f"{busy}: {c['verdict']}"
    if r["cores"] <= BUSY_FACTOR * r["cores_sequential"]:
        return (f"{busy}: on this run no second core was free for the second thread (see the load average), so "
                "the kernels could not overlap either. Rerun the cell when two cores are idle to see them "
                "overlap; the Python loop cannot, whatever the load.")
    if c["verdict"] == "faster":
        return (f"{busy}, every repeat sooner: the kernels ran side by side, because PyTorch releases the GIL "
                "while a kernel computes.")
    return (f"{busy}; {c['verdict']}: the threads computed at the same time, so the GIL did not hold them "
            "back, yet finished no sooner: the cores they shared (with each other's memory traffic, or with "
            "other processes; see the load average) did no more work in total. Rerun the cell on an idle machine.")


# --------------------------------------------------------------------------------------------------
# nn.DataParallel itself on a machine without CUDA

def dataparallel_probe(batch: int = 6) -> dict:
    """Wrap a module with ``nn.DataParallel`` and record what it does, here, on one call.

    Counts the module's forward calls and the batch size each saw, and whether DataParallel's own
    scatter / replicate / parallel_apply / gather were called. Run on a machine with CUDA GPUs, this
    starts a fresh Python with ``CUDA_VISIBLE_DEVICES=""`` so the answer is always the no-CUDA one.
    """
    if torch.cuda.is_available():
        import json
        import os
        import subprocess

        code = "import json; from ddp_course.course.l03_data_parallel.dp_mechanism import dataparallel_probe as p; print(json.dumps(p(%d)))"
        out = subprocess.run([sys.executable, "-c", code % batch], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    seen: list[int] = []
    module = nn.Linear(4, 3)
    module.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    dp = nn.DataParallel(module)
    calls = {name: 0 for name in ("scatter", "replicate", "parallel_apply", "gather")}
    for name in calls:
        real = getattr(dp, name)

        def counted(*a, _name=name, _real=real, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(dp, name, counted)  # an instance attribute: DataParallel.forward calls self.<name>
    x = torch.randn(batch, 4)
    out = dp(x)
    forward_calls, batch_seen = len(seen), list(seen)
    with torch.no_grad():
        same = bool(torch.equal(out, module(x)))  # (this direct call is not counted above)
    return {"cuda_available": torch.cuda.is_available(), "device_ids": list(dp.device_ids),
            "forward_calls": forward_calls, "batch_seen_by_module": batch_seen, "batch": batch,
            "dp_machinery_calls": calls, "same_as_module": same, "wrapped_is_module": dp.module is module}
