"""The course's training step against a minimal hand-written loop: what the course's loop costs.

    python -m ddp_course.bench overhead
    python -m ddp_course.bench overhead --n_layer=4 --rounds=9 --out=/tmp/bench

The loops and the same-work check here (``hand_step``, ``hand_steps``, ``course_steps``,
``same_work_check``, ...) are also what ``ddp_course.course.l10_scaling.bench_gpu`` times on a GPU.
Writes ``<out>/overhead.json``; exits 1 on FAIL.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ddp_course import bench as harness
from ddp_course.bench import BenchError


def hand_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """Written out here on purpose (not build_optimizer): decay on matrices, none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def same_optimizer_config(course: torch.optim.Optimizer, hand: torch.optim.Optimizer,
                           course_model: torch.nn.Module, hand_model: torch.nn.Module) -> None:
    """Refuse to compare loops whose optimizers differ (a bench of different work is meaningless)."""
    if course.defaults != hand.defaults:
        raise BenchError(f"optimizer defaults differ: course {course.defaults} vs hand {hand.defaults}")
    c_index = {id(p): i for i, p in enumerate(course_model.parameters())}
    h_index = {id(p): i for i, p in enumerate(hand_model.parameters())}
    if len(course.param_groups) != len(hand.param_groups):
        raise BenchError("optimizer param groups differ in number")
    for i, (cg, hg) in enumerate(zip(course.param_groups, hand.param_groups)):
        c_rest = {k: v for k, v in cg.items() if k != "params"}
        h_rest = {k: v for k, v in hg.items() if k != "params"}
        if c_rest != h_rest:
            raise BenchError(f"optimizer group {i} differs: course {c_rest} vs hand {h_rest}")
        if [c_index[id(p)] for p in cg["params"]] != [h_index[id(p)] for p in hg["params"]]:
            raise BenchError(f"optimizer group {i} holds different parameters in the two loops")


def hand_step(model, optimizer, x, y, grad_clip: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The minimal loop body: forward (under autocast to ``dtype`` if given), backward, clip, step, zero_grad."""
    with torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def hand_steps(model, optimizer, batches: list, start: int, n: int, grad_clip: float,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``n`` steps of the hand-written loop from step ``start`` over the cycled ``batches``.

    Each batch is copied to the model's device (non-blocking: from pinned memory the copy overlaps
    the GPU's work; a batch already there is not copied). Returns the last loss, a tensor: no host sync.
    """
    device = next(model.parameters()).device
    loss = None
    for step in range(start, start + n):
        x, y = batches[step % len(batches)]
        loss = hand_step(model, optimizer, x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                          grad_clip, dtype)
    return loss


def course_steps(model, optimizer, scaler, batches: list, cfg, device: torch.device, start: int, n: int,
                  schedule: bool = True) -> torch.Tensor:
    """``n`` steps of the course's loop from step ``start``: per step, what ``run_training`` does (the
    scheduled learning rate, the micro-batches copied in, non-blocking on a GPU), then ``train_step``.

    ``batches`` are cycled; ``schedule=False`` keeps the optimizer's learning rate. Returns the last
    step's mean loss, a tensor: no host sync.
    """
    from ddp_course.train import lr_at, train_step

    non_blocking = device.type == "cuda"  # as run_training: its batches come pinned on a GPU
    loss = None
    for step in range(start, start + n):
        if schedule:
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
        micro = [(x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking))
                 for x, y in (batches[(step * cfg.grad_accum_steps + k) % len(batches)]
                              for k in range(cfg.grad_accum_steps))]
        loss, _ = train_step(model, optimizer, scaler, micro, device=device, precision=cfg.precision,
                             grad_clip=cfg.grad_clip, no_sync=cfg.no_sync)
    return loss


def same_work_check(name: str, course: Callable[[int], torch.Tensor], hand: Callable[[int], torch.Tensor],
                     course_model: torch.nn.Module, hand_model: torch.nn.Module, steps: int,
                     rel_tol: float = 1e-6) -> dict[str, Any]:
    """Run ``course(step)`` and ``hand(step)`` (one step each, from one state, on the same batches)
    ``steps`` times; raise BenchError unless their losses agree within ``rel_tol``.

    Both loops run the same kernels on the same data in the same order, and dividing by K = 1 is
    exact in floating point, so the losses agree to the last bit on a deterministic backend. The
    default tolerance leaves room only for a few ulps of float32 (2**-23 = 1.2e-7 relative), e.g. from
    a backend that splits a reduction differently between calls: 1e-6 relative is far below any real
    difference in the work (a missed clip, a different LR or weight decay moves the loss by >1e-4).
    """
    c_losses, h_losses = [], []
    for step in range(steps):
        c_losses.append(course(step).item())
        h_losses.append(hand(step).item())
    param_diff = max((a.float() - b.float()).abs().max().item()
                     for a, b in zip(course_model.parameters(), hand_model.parameters()))
    loss_diff = max(abs(a - b) for a, b in zip(c_losses, h_losses))
    tol = rel_tol * max(1.0, max(abs(v) for v in c_losses))
    check = {"steps": steps, "loss_course": c_losses, "loss_hand": h_losses, "max_abs_loss_diff": loss_diff,
             "max_abs_param_diff": param_diff, "tolerance": tol, "ok": loss_diff <= tol}
    print(f"[{name}] same-work check: {steps} steps from one state, loss {c_losses[-1]:.6f} "
          f"(course) vs {h_losses[-1]:.6f} (hand), max |diff| {loss_diff:.2e}, params {param_diff:.2e} "
          f"(tolerance {tol:.1e})", flush=True)
    if not check["ok"]:
        raise BenchError(f"the two loops do not do the same work: losses {c_losses} vs {h_losses} "
                         f"(max difference {loss_diff:.3e} > {tol:.1e})")
    return check


@harness.bench("overhead",
       n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(128, "model width"),
       block_size=(64, "tokens per sequence"), micro_batch_size=(16, "sequences per step"),
       rounds=(7, "timed rounds; each round runs both loops, in alternating order"),
       steps=(20, "optimizer steps per loop per round"),
       chunk=(1, "steps of one loop before switching to the other within a round (1: alternate every step)"),
       warmup=(10, "untimed steps of each loop first (allocations, first kernels)"),
       check_steps=(5, "steps of the same-work check (both loops from one state, same batches)"),
       n_batches=(16, "pre-made batches, cycled (no data loading is timed)"),
       threads=(0, "torch CPU threads (0: leave the default)"),
       device=("cpu", "cpu or cuda"), seed=(1337, "model init and batch order"),
       corpus=("tinyshakespeare", "tinyshakespeare | offline | a path"),
       target=(0.97, "PASS when course/hand tokens/s is at least this"))
def overhead(opts: dict[str, Any]) -> dict[str, Any]:
    """The course's train_step (plus its per-step LR update) against a minimal hand-written loop.

    Both build the same MiniGPT from the same seed with the same AdamW configuration and clip the
    gradient norm alike. They are timed in one process, in rounds of ``steps`` steps each that
    alternate between the loops every ``chunk`` steps (who goes first flips every round), so machine
    noise hits both equally. First, both loops run from one state on the same batches and must
    reach the same loss: they do the same work. Reports tokens/s (median over rounds), course/hand,
    and PASS when course/hand >= target. Exits 1 on FAIL.
    """
    from ddp_course import parallel
    from ddp_course.config import ConfigError, from_dict
    from ddp_course.data import prepare, train_batches
    from ddp_course.dist import DistInfo, seed_everything
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import build_optimizer, make_scaler

    harness.positive(opts, "rounds", "steps", "chunk", "check_steps", "n_batches")
    harness.positive(opts, "warmup", least=0)
    harness.choice(opts, "device", ("cpu", "cuda"))
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device=cuda but PyTorch sees no CUDA GPU; use --device=cpu.")
    device = torch.device(opts["device"])
    if opts["threads"] > 0:
        torch.set_num_threads(opts["threads"])
    total_steps = opts["warmup"] + opts["rounds"] * opts["steps"]
    try:
        cfg = from_dict({k: opts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size",
                                              "seed", "corpus")}
                        | {"max_steps": total_steps, "device": opts["device"], "precision": "fp32"})
    except ConfigError as exc:
        raise BenchError(str(exc)) from None
    if cfg.grad_clip <= 0:
        raise BenchError("the bench compares clipped steps; TrainConfig.grad_clip must be positive")

    data = prepare(cfg.corpus, cfg.block_size, cfg.val_fraction, announce=print)
    vocab = data.tokenizer.vocab_size
    it = train_batches(data.train, cfg.micro_batch_size, 0, 1, cfg.seed)
    batches = [(x.to(device), y.to(device)) for x, y in (next(it) for _ in range(opts["n_batches"]))]
    tokens_per_step = cfg.micro_batch_size * cfg.block_size

    def build():
        seed_everything(cfg.seed)
        m = parallel.wrap(MiniGPT(GPTConfig.from_train(cfg, vocab)).to(device), DistInfo(device=device), cfg)
        m.train()
        return m

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ---- the two loops ----------------------------------------------------------------------------
    def course_loop(model, optimizer, scaler, start: int, n: int, schedule: bool = True) -> torch.Tensor:
        return course_steps(model, optimizer, scaler, batches, cfg, device, start, n, schedule)

    def hand_loop(model, optimizer, start: int, n: int) -> torch.Tensor:
        return hand_steps(model, optimizer, batches, start, n, cfg.grad_clip)

    # ---- 1. same work: one state, same batches, same (constant) learning rate ----------------------
    cm, hm = build(), build()
    c_opt, h_opt = build_optimizer(cm, cfg, device), hand_optimizer(hm, cfg, device)
    same_optimizer_config(c_opt, h_opt, cm, hm)
    scaler = make_scaler(device, cfg.precision)
    check = same_work_check("overhead", lambda step: course_loop(cm, c_opt, scaler, step, 1, schedule=False),
                             lambda step: hand_loop(hm, h_opt, step, 1), cm, hm, opts["check_steps"])
    del cm, hm, c_opt, h_opt

    # ---- 2. timing: warm-up, then alternating rounds ------------------------------------------------
    cm, hm = build(), build()
    c_opt, h_opt = build_optimizer(cm, cfg, device), hand_optimizer(hm, cfg, device)
    scaler = make_scaler(device, cfg.precision)
    if opts["warmup"]:
        course_loop(cm, c_opt, scaler, 0, opts["warmup"]).item()
        hand_loop(hm, h_opt, 0, opts["warmup"]).item()

    def timed(which: str, start: int, n: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) for ``n`` steps of one loop from step ``start``."""
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        if which == "course":
            loss = course_loop(cm, c_opt, scaler, start, n)
        else:
            loss = hand_loop(hm, h_opt, start, n)
        value = loss.item()  # one host sync per chunk, in both loops
        sync()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if not math.isfinite(value):
            raise BenchError(f"the {which} loop's loss became {value}")
        return dt, cpu

    chunk = min(opts["chunk"], opts["steps"])
    print(f"[overhead] MiniGPT {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, batch "
          f"{cfg.micro_batch_size} x {cfg.block_size} tokens, fp32 on {device} ({torch.get_num_threads()} thread(s)); "
          f"{opts['rounds']} rounds x {opts['steps']} steps (alternating every {chunk}) after {opts['warmup']} "
          f"warm-up steps", flush=True)
    rounds = []
    for r in range(opts["rounds"]):
        order = ("course", "hand") if r % 2 == 0 else ("hand", "course")
        seconds, cpu_seconds = {"course": 0.0, "hand": 0.0}, {"course": 0.0, "hand": 0.0}
        gc.collect()
        done = 0
        while done < opts["steps"]:
            n = min(chunk, opts["steps"] - done)
            for which in order:
                wall, cpu = timed(which, opts["warmup"] + r * opts["steps"] + done, n)
                seconds[which] += wall
                cpu_seconds[which] += cpu
            done += n
        tps = {k: tokens_per_step * opts["steps"] / v for k, v in seconds.items()}
        row = {"round": r + 1, "first": order[0], "course_tokens_per_s": tps["course"],
               "hand_tokens_per_s": tps["hand"], "ratio": tps["course"] / tps["hand"],
               "course_cpu_s": cpu_seconds["course"], "hand_cpu_s": cpu_seconds["hand"],
               "cpu_ratio": cpu_seconds["hand"] / cpu_seconds["course"] if cpu_seconds["course"] > 0 else float("nan")}
        rounds.append(row)
        print(f"[overhead] round {r + 1}/{opts['rounds']} ({order[0]} first): course {tps['course']:,.0f} tok/s, "
              f"hand {tps['hand']:,.0f} tok/s, ratio {row['ratio']:.3f}", flush=True)

    course_tps = [r["course_tokens_per_s"] for r in rounds]
    hand_tps = [r["hand_tokens_per_s"] for r in rounds]
    course_med, hand_med = harness.median(course_tps), harness.median(hand_tps)
    ratio = course_med / hand_med
    paired = harness.median([r["ratio"] for r in rounds])
    best = max(course_tps) / max(hand_tps)  # the fastest round of each: least disturbed by other work
    spread = (min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds))
    noise = max(harness.spread(course_tps), harness.spread(hand_tps))
    # tokens per CPU-second: with one thread, time slices lost to other processes do not count
    cpu_ratio = sum(r["hand_cpu_s"] for r in rounds) / max(1e-12, sum(r["course_cpu_s"] for r in rounds))
    passed = ratio >= opts["target"]

    print()
    print(f"{'round':>5}  {'first':<6}  {'course tok/s':>12}  {'hand tok/s':>12}  {'course/hand':>11}")
    for r in rounds:
        print(f"{r['round']:>5}  {r['first']:<6}  {r['course_tokens_per_s']:>12,.0f}  "
              f"{r['hand_tokens_per_s']:>12,.0f}  {r['ratio']:>11.3f}")
    print(f"{'median':>5}  {'':<6}  {course_med:>12,.0f}  {hand_med:>12,.0f}  {ratio:>11.3f}")
    print(f"\ncourse/hand = {ratio:.3f} (median of per-round ratios {paired:.3f}, range {spread[0]:.3f}..{spread[1]:.3f}); "
          f"target >= {opts['target']}: {'PASS' if passed else 'FAIL'}")
    print(f"fastest round of each: course/hand = {best:.3f}; per CPU-second of this process: {cpu_ratio:.3f}; "
          f"round-to-round spread {noise:.0%}")
    noisy = harness.noise_warning("overhead", max(harness.span(course_tps), harness.span(hand_tps)), "Rerun on an idle machine (or with --threads=1 and more "
                                  "--rounds) before trusting the ratio; the CPU-second ratio above is the less "
                                  "disturbed figure.")
    return {
        "bench": "overhead", "options": opts, "device": str(device), "threads": torch.get_num_threads(),
        "n_params": parallel.unwrap(cm).num_params(), "tokens_per_step": tokens_per_step,
        "rounds": rounds, "course_tokens_per_s_median": course_med, "hand_tokens_per_s_median": hand_med,
        "ratio": ratio, "ratio_paired_median": paired, "ratio_min": spread[0], "ratio_max": spread[1],
        "ratio_best_rounds": best, "ratio_cpu_time": cpu_ratio, "round_spread": noise, "noisy": noisy,
        "target": opts["target"], "pass": passed, "same_work_check": check,
    }


_, main = harness.entry_points("overhead")

if __name__ == "__main__":
    sys.exit(main())
