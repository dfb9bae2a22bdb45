"""Mixed precision seen from inside: what autocast does to MiniGPT, and what GradScaler does.

Lesson 07 calls these helpers; each runs in one process on the device at hand (CPU or one GPU) and
returns plain data (lists of dicts) that the notebook prints and plots:

- :func:`module_dtypes` -- forward hooks on every module: the dtypes going in and out, and the dtype
  of the module's own parameters, under ``torch.autocast``.
- :func:`op_dtypes` -- every ATen operation of one forward and backward, with the dtypes of its
  inputs and outputs (recorded below autocast with a ``TorchDispatchMode``), so the casts autocast
  inserts and the ops it runs in 16 bits are seen one by one.
- :func:`dtype_ranges` -- ``torch.finfo`` of fp32, bf16 and fp16 side by side.
- :func:`gradscaler_demo` -- fp16 training steps with ``torch.amp.GradScaler``, one of them forced to
  overflow, recording at every step the scale, the gradient norm before and after ``unscale_``,
  whether the optimizer step was skipped, and the scale after ``update``.
- :func:`clip_order` -- the same training with the clip before and after ``unscale_``, under each
  optimizer given: what the clip-while-scaled bug does to the loss.

The training loop itself stays in :mod:`ddp_course.train` (``--precision=fp32|bf16|fp16``); nothing
here changes global state.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddp_course.check.records import notebook_exercise
from ddp_course.course.tiny import VOCAB
from ddp_course.train import DTYPES, autocast

LOW_PRECISIONS = ("bf16", "fp16")
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")  # + every scaled_dot_product_* kernel


def short(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def default_device() -> torch.device:
    """The device this lesson measures on: the first GPU if there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse a precision this device cannot run, with a sentence that says what to use instead."""
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(DTYPES)}.")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("this GPU has no bfloat16 support (it needs compute capability 8.0, Ampere, or newer): "
                         "use precision='fp16' with a GradScaler, or 'fp32'.")


def _float_dtypes(obj: Any) -> tuple[str, ...]:
    """The dtypes of the floating-point tensors in a (nested) argument or result."""
    return tuple(short(t.dtype) for t in tree_flatten(obj)[0] if torch.is_tensor(t) and t.is_floating_point())


# --------------------------------------------------------------------------------------------------
# which module and which op runs in which dtype

def module_dtypes(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None, *,
                  precision: str = "bf16", device: torch.device | None = None) -> list[dict[str, Any]]:
    """One forward under autocast with a hook on every module; one row per module, in call order.

    Each row: ``name``, ``type``, ``depth`` (0 = the model), ``inputs`` / ``outputs`` (dtypes of the
    floating-point tensors; token ids are integers and are left out) and ``params`` (the dtype of the
    module's own parameters, ``None`` if it has none). Parameters stay fp32 under autocast: the
    16-bit copies are made on the fly, per op.
    """
    device = device or next(model.parameters()).device
    check_precision(precision, device)
    names = {id(mod): name for name, mod in model.named_modules()}
    rows: list[dict[str, Any]] = []
    slot: dict[int, dict[str, Any]] = {}

    def pre(mod: nn.Module, args: tuple) -> None:
        name = names[id(mod)]
        own = list(mod.parameters(recurse=False))
        row = {"name": name or f"({type(mod).__name__})", "type": type(mod).__name__,
               "depth": name.count(".") + 1 if name else 0, "inputs": _float_dtypes(args), "outputs": (),
               "params": short(own[0].dtype) if own else None}
        slot[id(mod)] = row
        rows.append(row)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        slot[id(mod)]["outputs"] = _float_dtypes(out)

    handles = []
    for mod in model.modules():
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with torch.no_grad(), autocast(device, precision):
            model(x.to(device), None if y is None else y.to(device))
    finally:
        for h in handles:
            h.remove()
    return rows


class _OpRecorder(TorchDispatchMode):
    """Records every ATen op below autocast: what autocast decided has already happened here."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.calls: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # views and detach move no data; they would only clutter the table
            ins, outs = _float_dtypes((args, kwargs)), _float_dtypes(out)
            if ins or outs:
                self.calls.append((self.phase, func.overloadpacket.__name__, ins, outs))
        return out


def op_kind(op: str, inputs: Sequence[str], outputs: Sequence[str]) -> str:
    """``cast`` (a dtype conversion), ``matmul`` (matrix products and attention), else ``other``."""
    if op in ("_to_copy", "to", "copy_") and inputs and outputs and inputs[0] != outputs[0]:
        return "cast"
    if op in MATMUL_OPS or "scaled_dot_product" in op:
        return "matmul"
    return "other"


def op_dtypes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, precision: str = "bf16",
              device: torch.device | None = None, backward: bool = True) -> list[dict[str, Any]]:
    """Every op of one forward (and backward) under autocast, grouped by (phase, op, dtypes).

    One row per distinct (phase, op, input dtypes, output dtypes) in order of first appearance, with
    ``count`` (how many calls), ``kind`` (see :func:`op_kind`) and ``compute`` (the dtype of the
    first output: the precision the op produced its result in). The model's gradients are cleared
    afterwards.
    """
    device = device or next(model.parameters()).device
    check_precision(precision, device)
    rec = _OpRecorder()
    with rec:
        with autocast(device, precision):
            _, loss = model(x.to(device), y.to(device))
        if backward:
            rec.phase = "backward"
            loss.backward()
    model.zero_grad(set_to_none=True)
    grouped: dict[tuple, dict[str, Any]] = {}
    for phase, op, ins, outs in rec.calls:
        key = (phase, op, ins, outs)
        if key not in grouped:
            grouped[key] = {"phase": phase, "op": op, "inputs": ins, "outputs": outs, "count": 0,
                            "kind": op_kind(op, ins, outs), "compute": outs[0] if outs else None}
        grouped[key]["count"] += 1
    return list(grouped.values())


def summarize_ops(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over :func:`op_dtypes` rows: calls per output dtype per phase, matmuls by dtype, casts."""
    out: dict[str, Any] = {"calls_by_dtype": {}, "matmul_by_dtype": {}, "casts": {}}
    for r in rows:
        key = f"{r['phase']}:{r['compute']}"
        out["calls_by_dtype"][key] = out["calls_by_dtype"].get(key, 0) + r["count"]
        if r["kind"] == "matmul":
            out["matmul_by_dtype"][r["compute"]] = out["matmul_by_dtype"].get(r["compute"], 0) + r["count"]
        if r["kind"] == "cast":
            k = f"{r['phase']}:{r['inputs'][0]}->{r['outputs'][0]}"
            out["casts"][k] = out["casts"].get(k, 0) + r["count"]
    return out


def format_op_table(rows: list[dict[str, Any]], phase: str | None = None) -> str:
    """The rows of :func:`op_dtypes` as an aligned text table."""
    rows = [r for r in rows if phase is None or r["phase"] == phase]
    lines = [f"{'phase':<9} {'op':<46} {'calls':>5}  {'inputs':<30} -> output"]
    for r in rows:
        ins = ", ".join(r["inputs"]) or "-"
        outs = ", ".join(r["outputs"]) or "-"
        mark = {"cast": "  (cast)", "matmul": "  (matmul)"}.get(r["kind"], "")
        lines.append(f"{r['phase']:<9} {r['op'][:46]:<46} {r['count']:>5}  {ins[:30]:<30} -> {outs}{mark}")
    return "\n".join(lines)


def format_module_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`module_dtypes` as an indented text table."""
    lines = [f"{'module':<34} {'type':<20} {'params':<9} {'input':<10} -> output"]
    for r in rows:
        name = "  " * r["depth"] + r["name"].split(".")[-1] if r["depth"] else r["name"]
        lines.append(f"{name[:34]:<34} {r['type'][:20]:<20} {r['params'] or '-':<9} "
                     f"{', '.join(r['inputs']) or 'token ids':<10} -> {', '.join(r['outputs'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# ranges

def dtype_ranges() -> list[dict[str, Any]]:
    """``torch.finfo`` of the three training precisions: largest value, smallest normal and
    subnormal value, machine epsilon, and the bits of exponent and mantissa."""
    bits = {torch.float32: (8, 23), torch.bfloat16: (8, 7), torch.float16: (5, 10)}
    rows = []
    for name, dt in DTYPES.items():
        fi = torch.finfo(dt)
        exp, man = bits[dt]
        rows.append({"precision": name, "dtype": short(dt), "bits": fi.bits, "exponent_bits": exp,
                     "mantissa_bits": man, "max": fi.max, "smallest_normal": fi.smallest_normal,
                     "smallest_subnormal": fi.smallest_normal * 2.0 ** -man,
                     "eps": fi.eps})
    return rows


# --------------------------------------------------------------------------------------------------
# GradScaler, step by step

def gradient_spike(module: nn.Module, factor: float, when: Callable[[], bool]) -> torch.utils.hooks.RemovableHandle:
    """Multiply the gradient flowing back through ``module``'s output by ``factor`` whenever ``when()``.

    Attached to the output head it mimics a batch whose gradients are ``factor`` times larger than
    usual. The product is taken in the output's own dtype, so under fp16 autocast a large enough
    factor overflows fp16 for real (values above 65504 become inf), exactly as a large scale would.
    """
    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if when() and out.requires_grad:
            out.register_hook(lambda g: g * factor)

    return module.register_forward_hook(hook)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm in fp32 (inf or nan when a gradient holds inf or nan)."""
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def _all_finite(grads: list[torch.Tensor]) -> bool:
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def _recorded_fp16_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                        x: torch.Tensor, y: torch.Tensor, grad_clip: float) -> dict[str, Any]:
    """One fp16 step of :func:`gradscaler_demo`, the recipe of ``train.train_step`` with each stage recorded."""
    params = [p for p in model.parameters() if p.requires_grad]
    scale = scaler.get_scale()
    with autocast(x.device, "fp16"):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    grads = _grads(model)
    norm_scaled = _norm(grads)
    scaler.unscale_(optimizer)
    found_inf = not _all_finite(grads)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    before = [p.detach().clone() for p in params]
    scaler.step(optimizer)
    skipped = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
    scaler.update()
    steps_taken = optimizer.state[params[0]].get("step", torch.zeros(())) if optimizer.state else torch.zeros(())
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "scale": scale, "grad_norm_scaled": norm_scaled, "grad_norm": grad_norm,
            "found_inf": found_inf, "skipped": skipped, "scale_after": scaler.get_scale(),
            "optimizer_steps": int(steps_taken)}


def _bf16_spiked_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, multiplier: float) -> dict[str, Any]:
    """The spiked step again, in bf16 with no scaler at all, and the gradient made as large as the
    scaled fp16 one that overflowed: bf16 has fp32's exponent, so it does not overflow."""
    h = gradient_spike(model.head, multiplier, lambda: True)
    try:
        with autocast(x.device, "bf16"):
            _, loss = model(x, y)
        loss.backward()
    finally:
        h.remove()
    g = _grads(model)
    return {"ran": True, "multiplier": multiplier, "all_finite": _all_finite(g), "grad_norm": _norm(g)}


def gradscaler_demo(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                    spike_step: int = 3, spike: float = 2.0 ** 12, init_scale: float = 2.0 ** 16,
                    growth_interval: int = 3, grad_clip: float = 1.0, lr: float = 1e-3,
                    device: torch.device | None = None) -> dict[str, Any]:
    """fp16 steps with a GradScaler, one per batch; at ``spike_step`` the gradient overflows fp16.

    Every step is the recipe of ``ddp_course.train.train_step`` written out so that each stage can
    be recorded::

        scaler.scale(loss).backward()      # gradients are `scale` times too large (no underflow)
        scaler.unscale_(optimizer)         # divide them back, and note any inf/nan
        clip_grad_norm_(params, grad_clip)  # clip the TRUE gradient (hence unscale_ first)
        scaler.step(optimizer)             # skipped when inf/nan was found
        scaler.update()                    # scale x0.5 after an overflow, x2 after growth_interval good steps

    Returns ``{"rows": [...], "settings": {...}, "bf16_check": {...}}``; each row holds ``step``,
    ``loss``, ``scale`` (used this step), ``spiked``, ``grad_norm_scaled`` (what clipping would see
    without ``unscale_``), ``grad_norm`` (after ``unscale_``, what clipping uses), ``found_inf``,
    ``skipped`` (no parameter changed: checked, not assumed), ``scale_after`` (after ``update``) and
    ``optimizer_steps`` (AdamW's own step counter). ``bf16_check`` runs the spiked backward in bf16
    with no scaler and reports whether every gradient stayed finite. The model is trained in place.
    """
    from ddp_course.config import TrainConfig
    from ddp_course.train import build_optimizer

    device = device or next(model.parameters()).device
    check_precision("fp16", device)
    if not 0 <= spike_step < len(batches):
        raise ValueError(f"spike_step={spike_step} must index one of the {len(batches)} batches.")
    bf16_model = copy.deepcopy(model) if device.type == "cpu" or torch.cuda.is_bf16_supported() else None
    optimizer = build_optimizer(model, TrainConfig(lr=lr, warmup_steps=1), device)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)
    state = {"spike": False}
    handle = gradient_spike(model.head, spike, lambda: state["spike"])
    rows = []
    try:
        for step, (x, y) in enumerate(batches):
            state["spike"] = step == spike_step
            row = _recorded_fp16_step(model, optimizer, scaler, x.to(device), y.to(device), grad_clip)
            rows.append({"step": step, "loss": row["loss"], "scale": row["scale"], "spiked": state["spike"], **row})
    finally:
        handle.remove()
        state["spike"] = False

    bf16_check: dict[str, Any] = {"ran": False, "reason": "this GPU has no bfloat16 support"}
    if bf16_model is not None:
        x, y = (t.to(device) for t in batches[spike_step])
        bf16_check = _bf16_spiked_backward(bf16_model, x, y, spike * rows[spike_step]["scale"])
    settings = {"device": str(device), "init_scale": init_scale, "growth_interval": growth_interval,
                "growth_factor": scaler.get_growth_factor(), "backoff_factor": scaler.get_backoff_factor(),
                "spike_step": spike_step, "spike": spike, "grad_clip": grad_clip,
                "fp16_max": torch.finfo(torch.float16).max}
    return {"rows": rows, "settings": settings, "bf16_check": bf16_check}


CLIP_ORDERS = {"unscale, then clip": True, "clip while scaled": False}


def clip_order(make_model: Callable[[], nn.Module], batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
               optimizers: dict[str, Callable[[nn.Module], torch.optim.Optimizer]], scale: float = 2.0 ** 16,
               grad_clip: float = 1.0) -> dict[str, dict[str, dict[str, list[float]]]]:
    """The clip-while-scaled bug, run: for each optimizer, the same training (one step per batch, the
    same initial weights from ``make_model``) once in the right order (``unscale_``, then clip) and
    once with the clip applied to the scaled gradients. A ``GradScaler`` with a fixed ``scale`` does
    the scaling (growth_interval beyond the run: the scale never changes, and no step overflows);
    the forward runs in fp32, so the only difference between the two orders is the clip.

    Returns ``{optimizer: {order: {"loss": [...], "grad_norm": [...], "below_eps": [...]}}}`` over the
    orders of ``CLIP_ORDERS``, one value per step: the loss, the norm of the gradient the optimizer
    steps with (clipped and unscaled), and the fraction of its coordinates below AdamW's ``eps`` (1e-8)."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, make_optimizer in optimizers.items():
        out[name] = {}
        for order, unscale_first in CLIP_ORDERS.items():
            model = make_model()
            device = next(model.parameters()).device
            optimizer = make_optimizer(model)
            scaler = torch.amp.GradScaler(device.type, init_scale=scale, growth_interval=len(batches) + 1)
            rows: dict[str, list[float]] = {"loss": [], "grad_norm": [], "below_eps": []}
            for x, y in batches:
                _, loss = model(x.to(device), y.to(device))
                scaler.scale(loss).backward()
                if unscale_first:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).abs()
                g = g if unscale_first else g / scaler.get_scale()  # what the optimizer will step with
                rows["grad_norm"].append(torch.linalg.vector_norm(g).item())
                rows["below_eps"].append((g < 1e-8).float().mean().item())
                scaler.step(optimizer)  # unscales here when unscale_ was not called
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                rows["loss"].append(loss.item())
            out[name][order] = rows
    return out


def format_scaler_rows(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`gradscaler_demo` as an aligned table."""
    lines = [f"{'step':>4}  {'scale':>9}  {'loss':>7}  {'|g| scaled':>11}  {'|g| unscaled':>12}  {'inf/nan':>7}  "
             f"{'optimizer step':<14}  {'scale after':>11}"]
    for r in rows:
        lines.append(f"{r['step']:>4}  {r['scale']:>9.0f}  {r['loss']:>7.4f}  {r['grad_norm_scaled']:>11.4g}  "
                     f"{r['grad_norm']:>12.4g}  {'yes' if r['found_inf'] else 'no':>7}  "
                     f"{'SKIPPED' if r['skipped'] else 'taken':<14}  {r['scale_after']:>11.0f}"
                     + ("   <- gradient spike" if r["spiked"] else ""))
    return "\n".join(lines)


__all__ = ["module_dtypes", "op_dtypes", "summarize_ops", "format_op_table", "format_module_table",
           "dtype_ranges", "gradscaler_demo", "format_scaler_rows", "gradient_spike", "default_device",
           "check_precision", "op_kind", "check_amp_step", "LOW_PRECISIONS"]


# --------------------------------------------------------------------------------------------------
# the notebook exercise: one fp16 step with a GradScaler, checked against the course's train_step

def _raised_hint(exc: Exception) -> str:
    """The first line of what the learner's step raised, with what usually causes it."""
    text = str(exc)
    hint = (" -- the loss must go through scaler.scale(loss).backward()" if "_scale is None" in text else
            " -- call scaler.update() at the end of every step (it resets the scaler for the next one)"
            if "after step()" in text or "already been called" in text else
            " -- step with scaler.step(optimizer): it checks the gradients for inf/nan (and skips the step "
            "if it finds any), and update() needs that check" if "No inf checks" in text else "")
    return f"{text.splitlines()[0]}{hint}"


def _skipped_step_problem(step: int, d_mine: torch.Tensor, scale: float, ref_scale: float) -> str | None:
    """What is wrong with the learner's step that overflowed fp16 (it must be skipped), or None."""
    if not torch.isfinite(d_mine).all():
        return (f"step {step} overflowed fp16 and your step wrote inf/nan into the weights: "
                "step through the scaler, scaler.step(optimizer), which skips such a step.")
    if d_mine.abs().max() > 0:
        return (f"step {step} overflowed fp16 but the weights still changed: the step must "
                "be skipped -- call scaler.step(optimizer), not optimizer.step().")
    if scale != ref_scale:
        return (f"after the overflow at step {step} the scale is {scale:g}, expected {ref_scale:g}: "
                "call scaler.update() once per step, after scaler.step(optimizer).")
    return None


def _update_problem(d_mine: torch.Tensor, d_ref: torch.Tensor, scale: float, ref_scale: float) -> str | None:
    """What is wrong with the learner's weight update ``d_mine`` against the reference's, or None."""
    # Both run the same fp16 kernels on the same inputs in the same order, so the updates agree to
    # float rounding; 1e-3 relative leaves room for a different (valid) order of the same operations
    # while every mistake checked here changes the update by a factor of 2 or more.
    n_ref, n_mine = d_ref.norm().item(), d_mine.norm().item()
    if (d_mine - d_ref).norm() <= 1e-3 * n_ref and scale == ref_scale:
        return None
    ratio = n_mine / n_ref if n_ref else float("inf")
    if not math.isfinite(ratio) or not torch.isfinite(d_mine).all():
        return "the weights became inf/nan."
    if ratio < 1e-2:
        return (f"the weights moved {ratio:.1e} times as far as they should: the gradient was still multiplied by the "
                "scale when it was clipped (call scaler.unscale_(optimizer) before clip_grad_norm_), or the loss "
                "was not scaled before backward (scaler.scale(loss).backward()).")
    if ratio > 1.05:
        return (f"the weights moved {ratio:.2f} times as far as they should: clip the unscaled gradient to "
                "grad_clip with torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) before the step.")
    if scale != ref_scale:
        return f"the scale is {scale:g}, expected {ref_scale:g}: call scaler.update() once at the end of every step."
    return (f"the update differs from the reference by {(d_mine - d_ref).norm().item() / n_ref:.1%}: "
            "compare your order of operations with the recipe (autocast forward, scaled backward, "
            "unscale_, clip, scaler.step, scaler.update, zero_grad).")


def _course_steps() -> dict[Any, str]:
    """The course's own fp16 steps (code object -> dotted name): what an ``amp_step`` may not hand its work to."""
    from ddp_course.train import train_step

    return {train_step.__code__: "ddp_course.train.train_step",
            _recorded_fp16_step.__code__: f"{__name__}._recorded_fp16_step"}


def _runs_course_step(fn: Callable[..., Any], *args: Any) -> tuple[str | None, Any]:
    """Call ``fn(*args)`` and say which of the course's own fp16 steps it ran, however it reached it (an
    alias, a wrapper, an import inside the function): ``(dotted name or None, what fn returned)``. A
    profile hook on this thread sees every Python call ``fn`` makes; the previous hook is put back."""
    import sys

    steps, found = _course_steps(), []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in steps:
            found.append(steps[frame.f_code])

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(previous)
    return (found[0] if found else None), out


@notebook_exercise("amp_step")
def check_amp_step(fn: Callable[..., Any], *, device: torch.device | None = None, steps: int = 5,
                   spike_step: int = 2) -> Any:
    """Run ``fn(model, optimizer, scaler, x, y, grad_clip)`` -- one fp16 optimizer step -- next to the
    course's ``train.train_step`` from the same weights, on the same batches, with the same overflow
    forced at ``spike_step``; return a :class:`ddp_course.check.Verdict` that says what differs.

    Plain SGD is used here (not AdamW): its update is proportional to the gradient, so a gradient
    left scaled, clipped while scaled, or not clipped at all shows up as a wrong step size. An ``fn`` that
    runs the course's own step (``train.train_step``, or the demo's ``_recorded_fp16_step``) is refused.
    """
    from ddp_course.check import Verdict, not_complete
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import train_step

    device = device or torch.device("cpu")
    clip, lr = 1.0, 0.05
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(65, (4, 17), generator=g)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))

    def setup():
        torch.manual_seed(0)
        model = MiniGPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=32)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16, growth_interval=2)
        now = {"step": -1, "dtype": None}
        gradient_spike(model.head, 2.0 ** 12, lambda: now["step"] == spike_step)
        model.head.register_forward_hook(lambda mod, args, out: now.update(dtype=out.dtype))
        return model, opt, scaler, now

    ref, ref_opt, ref_scaler, ref_now = setup()
    mine, my_opt, my_scaler, my_now = setup()
    for step, (x, y) in enumerate(batches):
        ref_now["step"] = my_now["step"] = step
        w_ref = [p.detach().clone() for p in ref.parameters()]
        w_mine = [p.detach().clone() for p in mine.parameters()]
        train_step(ref, ref_opt, ref_scaler, [(x, y)], device=device, precision="fp16", grad_clip=clip)
        try:
            delegated, _ = _runs_course_step(fn, mine, my_opt, my_scaler, x, y, clip)
        except NotImplementedError:
            return not_complete("amp_step()")
        except Exception as exc:  # the learner's bug, reported in one line, with what usually causes it
            return Verdict(False, f"step {step}: amp_step raised {type(exc).__name__}: {_raised_hint(exc)}")
        if delegated is not None:
            return Verdict(False, f"amp_step() hands its work to the course's own version, {delegated}: that is the "
                                  "code this exercise asks you to write. Write amp_step() with PyTorch's own calls "
                                  "(the hints above the exercise say which), then re-run the check.")
        if my_now["dtype"] != torch.float16:
            return Verdict(False, f"step {step}: the output layer ran in {my_now['dtype']}, not float16: run the "
                                  "forward under torch.autocast(device_type=x.device.type, dtype=torch.float16).")
        if any(p.grad is not None and bool(p.grad.ne(0).any()) for p in mine.parameters()):
            return Verdict(False, f"after step {step} the gradients are still there: zero them at the end of the "
                                  "step (optimizer.zero_grad(set_to_none=True)), or the next step adds to them.")
        d_ref = torch.cat([(p.detach() - w).reshape(-1) for p, w in zip(ref.parameters(), w_ref)])
        d_mine = torch.cat([(p.detach() - w).reshape(-1) for p, w in zip(mine.parameters(), w_mine)])
        scales = (my_scaler.get_scale(), ref_scaler.get_scale())
        if step == spike_step:
            problem = _skipped_step_problem(step, d_mine, *scales)
        else:
            problem = _update_problem(d_mine, d_ref, *scales)
            problem = problem and f"step {step}: {problem}"
        if problem:
            return Verdict(False, problem)
    return Verdict(True, f"{steps} fp16 steps match the course's train_step, including the skipped step {spike_step} "
                         "(overflow) and the scale's back-off after it.")
