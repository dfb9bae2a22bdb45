"""Benchmarks: speed claims of the course, measured rather than asserted.

    python -m ddp_course.bench                      list the benchmarks and their options
    python -m ddp_course.bench overhead             the course's train_step against a hand-written loop
    python -m ddp_course.bench ddp_vs_threads       2-rank DDP on CPU against one process with 2 threads
    python -m ddp_course.bench clean_exit --launches=200   do finished jobs exit 0? (run after a torch upgrade)
    python -m ddp_course.bench overhead --n_layer=4 --rounds=9 --out=/tmp/bench
    python -m ddp_course.bench NAME --help          the options of one benchmark

``overhead``, ``ddp_vs_threads`` and ``clean_exit`` live in this file; every module ``ddp_course/course/lNN_<topic>/bench_NAME.py``
(with ``main(argv) -> int``) is a benchmark too, run the same way. Such a module may register itself with
``@bench`` to use this file's options and output (``l10_scaling/bench_gpu.py`` does).

Each benchmark prints a table and writes ``<out>/<name>.json`` (``--out`` defaults to
``bench_results``). Options are ``--key=value``; unknown keys are refused. Speed targets live here,
not in the timed tests: machines differ, and a benchmark reports its own noise.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddp_course.paths import show

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory holding ddp_course/


class BenchError(RuntimeError):
    """A benchmark cannot run or its result is not valid. The message says why."""


@dataclass(frozen=True)
class Bench:
    name: str
    run: Callable[[dict[str, Any]], dict[str, Any]]
    defaults: dict[str, Any]
    help: dict[str, str]

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


BENCHES: dict[str, Bench] = {}
COMMON = {"out": "bench_results"}
COMMON_HELP = {"out": "directory for <name>.json (and any run folders)"}


def bench(name: str, **options: tuple[Any, str]):
    """Register ``fn`` as benchmark ``name``; options are ``key=(default, help)``."""
    def register(fn):
        defaults = {**COMMON, **{k: v[0] for k, v in options.items()}}
        helps = {**COMMON_HELP, **{k: v[1] for k, v in options.items()}}
        BENCHES[name] = Bench(name, fn, defaults, helps)
        return fn
    return register


# --------------------------------------------------------------------------------------------------
# options

def parse_options(b: Bench, argv: list[str]) -> dict[str, Any]:
    """``--key=value`` overrides of ``b.defaults``, converted to each default's type."""
    values = dict(b.defaults)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise BenchError(f"unexpected argument {arg!r}: options are written --key=value "
                             f"(see `python -m ddp_course.bench {b.name} --help`).")
        key, value = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key not in b.defaults:
            close = difflib.get_close_matches(key, list(b.defaults), n=3)
            hint = f" Did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise BenchError(f"unknown option --{key} for benchmark {b.name}.{hint} "
                             f"Valid options: {', '.join('--' + k for k in b.defaults)}.")
        default = b.defaults[key]
        try:
            if isinstance(default, bool):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                values[key] = value.lower() in ("1", "true", "yes", "on")
            else:
                values[key] = type(default)(value)
        except ValueError:
            raise BenchError(f"--{key} expects {type(default).__name__} (got {value!r}).") from None
    return values


def module_benches() -> dict[str, str]:
    """{name: module} for the benchmark modules ``ddp_course/course/lNN_<topic>/bench_NAME.py``."""
    import pkgutil

    from ddp_course.course import lesson_folders

    found = {}
    for pkg in lesson_folders().values():
        path = [str(Path(__file__).parent / "course" / pkg.rsplit(".", 1)[1])]
        for m in pkgutil.iter_modules(path):
            if m.name.startswith("bench_") and m.name[6:] not in BENCHES:
                found[m.name[6:]] = f"{pkg}.{m.name}"
    return dict(sorted(found.items()))


def _module_summary(module: str) -> str:
    """The first line of a module's docstring, read without importing it."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    try:
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError, TypeError, AttributeError):
        doc = ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def usage(b: Bench | None = None) -> str:
    if b is None:
        lines = [__doc__.strip(), "", "benchmarks:"]
        lines += [f"  {x.name:<16} {x.summary}" for x in BENCHES.values()]
        lines += [f"  {name:<16} {_module_summary(mod)}" for name, mod in sorted(module_benches().items())]
        lines += ["", "options of one benchmark: python -m ddp_course.bench NAME --help"]
        return "\n".join(lines)
    lines = [f"usage: python -m ddp_course.bench {b.name} [--key=value ...]", "", (b.run.__doc__ or "").strip(),
             "", "options:"]
    lines += [f"  --{k}={v!s:<18} {b.help[k]}" for k, v in b.defaults.items()]
    return "\n".join(lines)


def _check_positive(opts: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if opts[key] < 1:
            raise BenchError(f"--{key} must be at least 1 (got {opts[key]}).")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


NOISY = 0.10  # round-to-round spread of tokens/s above which a result is flagged as disturbed


def _spread(xs: list[float]) -> float:
    """(max - min) / median: how much one loop's speed moved between rounds."""
    return (max(xs) - min(xs)) / _median(xs) if xs else float("nan")


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _write_result(opts: dict[str, Any], name: str, result: dict[str, Any]) -> Path:
    from ddp_course.metrics import write_json

    path = Path(opts["out"]) / f"{name}.json"
    write_json(path, result)
    print(f"[{name}] wrote {show(path)}", flush=True)
    return path


# --------------------------------------------------------------------------------------------------
# overhead: train_step against a hand-written loop

def _hand_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.AdamW:
    """Written out here on purpose (not build_optimizer): decay on matrices, none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _same_optimizer_config(course: torch.optim.Optimizer, hand: torch.optim.Optimizer,
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


def _hand_step(model, optimizer, x, y, grad_clip: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The minimal loop body: forward (under autocast to ``dtype`` if given), backward, clip, step, zero_grad."""
    with torch.autocast(x.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _hand_steps(model, optimizer, batches: list, start: int, n: int, grad_clip: float,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``n`` steps of the hand-written loop from step ``start`` over the cycled ``batches``.

    Each batch is copied to the model's device (non-blocking: from pinned memory the copy overlaps
    the GPU's work; a batch already there is not copied). Returns the last loss, a tensor: no host sync.
    """
    device = next(model.parameters()).device
    loss = None
    for step in range(start, start + n):
        x, y = batches[step % len(batches)]
        loss = _hand_step(model, optimizer, x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                          grad_clip, dtype)
    return loss


def _course_steps(model, optimizer, scaler, batches: list, cfg, device: torch.device, start: int, n: int,
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


def _same_work_check(name: str, course: Callable[[int], torch.Tensor], hand: Callable[[int], torch.Tensor],
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


@bench("overhead",
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
    from ddp_course.metrics import environment
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import build_optimizer, make_scaler

    _check_positive(opts, "rounds", "steps", "chunk", "check_steps", "n_batches")
    if opts["warmup"] < 0:
        raise BenchError(f"--warmup must be 0 or more (got {opts['warmup']}).")
    if opts["device"] not in ("cpu", "cuda"):
        raise BenchError(f"--device must be cpu or cuda (got {opts['device']!r}).")
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
        return _course_steps(model, optimizer, scaler, batches, cfg, device, start, n, schedule)

    def hand_loop(model, optimizer, start: int, n: int) -> torch.Tensor:
        return _hand_steps(model, optimizer, batches, start, n, cfg.grad_clip)

    # ---- 1. same work: one state, same batches, same (constant) learning rate ----------------------
    cm, hm = build(), build()
    c_opt, h_opt = build_optimizer(cm, cfg, device), _hand_optimizer(hm, cfg, device)
    _same_optimizer_config(c_opt, h_opt, cm, hm)
    scaler = make_scaler(device, cfg.precision)
    check = _same_work_check("overhead", lambda step: course_loop(cm, c_opt, scaler, step, 1, schedule=False),
                             lambda step: hand_loop(hm, h_opt, step, 1), cm, hm, opts["check_steps"])
    del cm, hm, c_opt, h_opt

    # ---- 2. timing: warm-up, then alternating rounds ------------------------------------------------
    cm, hm = build(), build()
    c_opt, h_opt = build_optimizer(cm, cfg, device), _hand_optimizer(hm, cfg, device)
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
    course_med, hand_med = _median(course_tps), _median(hand_tps)
    ratio = course_med / hand_med
    paired = _median([r["ratio"] for r in rounds])
    best = max(course_tps) / max(hand_tps)  # the fastest round of each: least disturbed by other work
    spread = (min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds))
    noise = max(_spread(course_tps), _spread(hand_tps))
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
    if noise > NOISY:
        print(f"warning: tokens/s varied by {noise:.0%} between rounds (load average {_load()}): other work "
              "shared the CPU. Rerun on an idle machine (or with --threads=1 and more --rounds) before trusting "
              "the ratio; the CPU-second ratio above is the less disturbed figure.")
    result = {
        "bench": "overhead", "options": opts, "device": str(device), "threads": torch.get_num_threads(),
        "n_params": parallel.unwrap(cm).num_params(), "tokens_per_step": tokens_per_step,
        "rounds": rounds, "course_tokens_per_s_median": course_med, "hand_tokens_per_s_median": hand_med,
        "ratio": ratio, "ratio_paired_median": paired, "ratio_min": spread[0], "ratio_max": spread[1],
        "ratio_best_rounds": best, "ratio_cpu_time": cpu_ratio, "round_spread": noise, "noisy": noise > NOISY, "load_average": _load(),
        "target": opts["target"], "pass": passed, "same_work_check": check, "environment": environment(),
    }
    _write_result(opts, "overhead", result)
    return result


# --------------------------------------------------------------------------------------------------
# ddp_vs_threads: two processes with DDP against one process with two threads

def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the child's whole process group (torchrun and its ranks), SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> float:
    """Run ``cmd`` in its own process group, output to ``log_path``; returns wall seconds.

    On timeout or Ctrl-C the whole group is stopped, so no rank is left behind.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=PACKAGE_ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise BenchError(f"{' '.join(cmd)} did not finish in {timeout_s:.0f}s (stopped); see {log_path}") from None
        except BaseException:  # KeyboardInterrupt included: never leave the ranks running
            _kill_group(proc)
            raise
    if rc != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
        raise BenchError(f"{' '.join(cmd)} exited {rc}; last lines of {log_path}:\n{tail}")
    return time.perf_counter() - t0


DDP_VS_THREADS_CPU = "the question is whether N processes with DDP beat one process with N threads on the same cores"


@bench("ddp_vs_threads",
       steps=(60, "optimizer steps of each run"), repeats=(1, "runs of each kind, alternating order"),
       nproc=(2, "DDP ranks (1 thread each) = threads of the single process"),
       batch=(16, "sequences per optimizer step in both runs (DDP: batch / nproc per rank)"),
       n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(128, "model width"),
       block_size=(64, "tokens per sequence"), log_interval=(10, "steps per metrics row (the first is warm-up)"),
       corpus=("tinyshakespeare", "tinyshakespeare | offline | a path"),
       timeout_s=(600.0, "wall-clock limit of each run (the process group is stopped after it)"))
def ddp_vs_threads(opts: dict[str, Any]) -> dict[str, Any]:
    """DDP with N CPU processes x 1 thread against one process with N threads, same global batch.

    Runs ``torchrun --standalone --nproc_per_node=N -m ddp_course.train --strategy=ddp --threads=1``
    with batch/N sequences per rank, and ``python -m ddp_course.train --threads=N`` with the whole
    batch, for the same number of steps; reads tokens_per_s (steady state, first log interval left
    out) from each run's summary.json.
    """
    from ddp_course.config import ConfigError, from_dict, to_cli
    from ddp_course.metrics import environment

    _check_positive(opts, "steps", "repeats", "nproc", "batch", "log_interval")
    if opts["nproc"] < 2:
        raise BenchError("--nproc must be at least 2 for a DDP run.")
    if opts["batch"] % opts["nproc"]:
        raise BenchError(f"--batch={opts['batch']} must divide evenly over --nproc={opts['nproc']} ranks.")
    if opts["steps"] <= opts["log_interval"]:
        raise BenchError(f"--steps={opts['steps']} must exceed --log_interval={opts['log_interval']}: "
                         "the first interval is warm-up and is not counted in tokens_per_s.")
    base_dir = Path(opts["out"]).resolve() / "ddp_vs_threads"
    n = opts["nproc"]
    common = {k: opts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "log_interval", "corpus")}
    common |= {"max_steps": opts["steps"], "eval_interval": 0, "eval_batches": 1}
    common["device"] = "cpu"  # by design: processes against threads on one CPU (DDP_VS_THREADS_CPU)
    kinds = {
        "ddp": ({**common, "strategy": "ddp", "threads": 1, "micro_batch_size": opts["batch"] // n}, 1),
        "threads": ({**common, "strategy": "single", "threads": n, "micro_batch_size": opts["batch"]}, n),
    }
    for flags, _ in kinds.values():
        try:
            from_dict(flags)  # refuse bad values here, before any process starts
        except ConfigError as exc:
            raise BenchError(str(exc)) from None

    def command(kind: str, out_dir: Path) -> list[str]:
        flags = to_cli({**kinds[kind][0], "out_dir": str(out_dir)})
        if kind == "ddp":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                    "-m", "ddp_course.train", *flags]
        return [sys.executable, "-m", "ddp_course.train", *flags]

    label = {"ddp": f"DDP {n} ranks x 1 thread", "threads": f"1 process x {n} threads"}
    print(f"[ddp_vs_threads] CPU with gloo by design: {DDP_VS_THREADS_CPU}", flush=True)
    print(f"[ddp_vs_threads] {label['ddp']} (micro batch {opts['batch'] // n}) vs {label['threads']} "
          f"(micro batch {opts['batch']}); {opts['steps']} steps, {opts['repeats']} run(s) each; "
          f"runs in {base_dir}", flush=True)
    load_at_start = _load()
    runs = []
    for r in range(opts["repeats"]):
        order = ("ddp", "threads") if r % 2 == 0 else ("threads", "ddp")
        for kind in order:
            out_dir = base_dir / f"{kind}_{r + 1}"
            (out_dir / "summary.json").unlink(missing_ok=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(kinds[kind][1]),
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
            wall = run_logged(command(kind, out_dir), out_dir / "run.log", opts["timeout_s"], env)
            summary_path = out_dir / "summary.json"
            if not summary_path.is_file():
                raise BenchError(f"{label[kind]} finished but wrote no {summary_path}; see {out_dir / 'run.log'}")
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
            tps = float(summary["tokens_per_s"])
            runs.append({"round": r + 1, "kind": kind, "tokens_per_s": tps, "wall_s": wall,
                         "final_loss": summary.get("final_loss"), "out_dir": str(out_dir)})
            print(f"[ddp_vs_threads] round {r + 1}/{opts['repeats']}: {label[kind]:<24} {tps:>10,.0f} tok/s "
                  f"(final loss {summary.get('final_loss', float('nan')):.4f}, {wall:.1f} s wall)", flush=True)

    ddp_med = _median([x["tokens_per_s"] for x in runs if x["kind"] == "ddp"])
    thr_med = _median([x["tokens_per_s"] for x in runs if x["kind"] == "threads"])
    ratio = ddp_med / thr_med if thr_med > 0 else float("nan")
    not_slower = ratio >= 1.0
    print()
    print(f"{'run':<26}  {'tokens/s (median)':>17}")
    print(f"{label['ddp']:<26}  {ddp_med:>17,.0f}")
    print(f"{label['threads']:<26}  {thr_med:>17,.0f}")
    print(f"\nDDP / threads = {ratio:.3f}: DDP is {'not slower' if not_slower else 'slower'} "
          f"on this machine ({os.cpu_count()} CPU(s) visible)")
    spreads = [_spread([x["tokens_per_s"] for x in runs if x["kind"] == k]) for k in kinds]
    cores = os.cpu_count() or 1
    busy = (load_at_start is not None and load_at_start[0] > 0.5 * cores) or max(spreads) > NOISY
    if busy:
        print(f"warning: the machine was busy (load average {load_at_start} at the start on {cores} CPU(s); "
              f"spread between repeats {max(spreads):.0%}). Other processes on the same cores stall the "
              "multi-threaded run's OpenMP barriers and the DDP ranks' collectives differently, so the "
              "ratio can swing either way: rerun on an idle machine with --repeats=3.")
    result = {"bench": "ddp_vs_threads", "options": opts, "runs": runs, "ddp_tokens_per_s": ddp_med,
              "threads_tokens_per_s": thr_med, "ratio": ratio, "ddp_not_slower": not_slower,
              "cpu_count": os.cpu_count(), "load_average_at_start": load_at_start, "load_average_at_end": _load(),
              "repeat_spread": max(spreads), "noisy": busy, "environment": environment()}
    _write_result(opts, "ddp_vs_threads", result)
    return result


# --------------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------------
# clean_exit: finished jobs must exit 0 (a stress check for ddp_course.dist.clean_exit)

_TINY_MODEL = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--micro_batch_size=4"]
CLEAN_EXIT_JOBS = {
    # name: (module, arguments); {out} is the job's own folder
    "train": ("ddp_course.train", ["--strategy=ddp", "--max_steps=5", "--eval_interval=0", "--eval_batches=2",
                                   *_TINY_MODEL, "--out_dir={out}"]),
    "profile": ("ddp_course.course.l05_inside_ddp.ddp_profile", ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16",
                                                "--micro_batch_size=4", "--trace_steps=1", "--steps=2", "--rounds=1",
                                                "--warmup=2", "--bucket_cap_mb=0.01", "--out_dir={out}"]),
}


@bench("clean_exit",
       launches=(20, "jobs to launch, alternating between the jobs in --jobs"),
       jobs=("train,profile", f"comma-separated, from: {', '.join(CLEAN_EXIT_JOBS)}"),
       nproc=(2, "ranks per job"),
       timeout_s=(120.0, "wall-clock limit of one job (a job past it counts as abnormal: a hang)"))
def clean_exit(opts: dict[str, Any]) -> dict[str, Any]:
    """Launch tiny finished jobs again and again and count abnormal exits (target: 0 of 200)."""
    from tqdm.auto import tqdm

    from ddp_course.launch import torchrun_command

    _check_positive(opts, "launches", "nproc")
    jobs = [j.strip() for j in opts["jobs"].split(",") if j.strip()]
    unknown = [j for j in jobs if j not in CLEAN_EXIT_JOBS]
    if unknown or not jobs:
        raise BenchError(f"--jobs: unknown job(s) {unknown}; choose from {', '.join(CLEAN_EXIT_JOBS)}.")
    root = Path(opts["out"]) / "clean_exit"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # as the launcher runs jobs
    abnormal: list[dict[str, Any]] = []
    counts = {j: 0 for j in jobs}
    t0 = time.perf_counter()
    bar = tqdm(range(opts["launches"]), desc="clean_exit", unit="job")
    for i in bar:
        job = jobs[i % len(jobs)]
        module, args = CLEAN_EXIT_JOBS[job]
        out = root / f"{i:04d}_{job}"
        cmd = torchrun_command(module, opts["nproc"], [a.replace("{out}", str(out)) for a in args])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=PACKAGE_ROOT, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=opts["timeout_s"])
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, rc = (proc.stdout.read() if proc.stdout else ""), "timeout"
        except BaseException:  # Ctrl-C included: no rank is left behind
            _kill_group(proc)
            raise
        counts[job] += 1
        if rc != 0:
            abnormal.append({"launch": i, "job": job, "returncode": rc, "out_dir": str(out),
                             "tail": output.splitlines()[-15:]})
            bar.set_postfix(abnormal=len(abnormal))
        else:
            shutil.rmtree(out, ignore_errors=True)  # keep only the folders of abnormal exits
    wall = time.perf_counter() - t0
    bar.close()
    print(f"abnormal exits: {len(abnormal)} of {opts['launches']} "
          f"({', '.join(f'{n} {j}' for j, n in counts.items())}; {wall:.0f} s, load {_load()})")
    for a in abnormal:
        print(f"\n--- launch {a['launch']} ({a['job']}) exited {a['returncode']}; its last lines:")
        print("\n".join("    " + line for line in a["tail"]))
    result = {"launches": opts["launches"], "jobs": counts, "abnormal": abnormal, "wall_s": round(wall, 1),
              "load": _load(), "torch": torch.__version__, "pass": not abnormal}
    _write_result(opts, "clean_exit", result)
    return result


def run(name: str, **overrides: Any) -> dict[str, Any]:
    """Run benchmark ``name`` from Python: ``run("overhead", rounds=3, steps=5)``. Returns its result."""
    if name not in BENCHES and name in module_benches():  # a module that registers itself with @bench
        import importlib

        importlib.import_module(module_benches()[name])
    if name not in BENCHES:
        raise BenchError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHES)}.")
    b = BENCHES[name]
    return b.run(parse_options(b, [f"--{k}={v}" for k, v in overrides.items()]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    modules = module_benches()
    if name in modules:  # a benchmark of its own module: it parses its own options
        import importlib

        return int(importlib.import_module(modules[name]).main(rest) or 0)
    if name not in BENCHES:
        print(f"error: unknown benchmark {name!r}; choose one of {', '.join([*BENCHES, *sorted(modules)])} "
              "(`python -m ddp_course.bench --help`).", file=sys.stderr)
        return 2
    b = BENCHES[name]
    if any(a in ("-h", "--help") for a in rest):
        print(usage(b))
        return 0
    try:
        opts = parse_options(b, rest)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = b.run(opts)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 1 if result.get("pass") is False else 0


if __name__ == "__main__":
    sys.exit(main())
