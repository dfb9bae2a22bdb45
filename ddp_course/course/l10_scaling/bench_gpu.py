"""GPU throughput: MiniGPT at two sizes in bf16, eager and compiled, the course loop against a hand-written one.

    python -m ddp_course.bench gpu                                 # both sizes, eager and compiled
    python -m ddp_course.bench gpu --sizes=gpt2 --compile=on --steps=30 --repeats=5
    python -m ddp_course.bench gpu --device=cpu --sizes=shakespeare --out=/tmp/bench

Sizes (``--scale=full``, the default on a GPU):

- ``shakespeare``: the character-level Tiny Shakespeare model: 6 layers x 6 heads x 384 wide, block
  256, batch 64, the corpus's vocabulary (65 characters);
- ``gpt2``: GPT-2 small: 12 layers x 12 heads x 768 wide, block 1024, batch 16, vocabulary 50304 (GPT-2's
  50257 padded to a multiple of 64) filled with synthetic tokens (speed does not depend on their values).

On a CPU the full sizes take seconds per step, so ``--scale=auto`` runs them scaled down there (2 layers
x 2 heads x 128 wide; shakespeare: block 64, batch 8; gpt2: block 128, batch 4, vocabulary 4096) and
``--compile=auto`` leaves torch.compile out (compiling takes minutes on a CPU; ``--compile=both`` asks
for it). The first printed line says what runs.

For each size and compile setting, the course's loop (``train_step`` with its per-step learning-rate
update, as ``run_training`` runs it) and a minimal hand-written loop (``hand_step`` of the ``overhead``
bench, with autocast written by hand) train the same model from the same seed on the same pre-made
batches, copied in from pinned host memory with ``non_blocking=True`` on a GPU. Each loop is timed in
``--repeats`` blocks of ``--steps`` steps (who goes first alternates), synchronising only at the
block's ends; medians and round-to-round spread are reported. Before timing, a same-work check runs
both loops eagerly from one state and requires the same losses.

Reported per configuration: tokens/s of each loop, course/hand, MFU (model FLOPs per second, from
``MiniGPT.flops_per_token``, over the GPU's dense bf16 peak in ``ddp_course.metrics.PEAK_FLOPS``; not
reported on a CPU or an unknown GPU, with the reason), peak memory of each loop
(``torch.cuda.max_memory_allocated`` during its blocks, less the other loop's parameters and optimizer
state, which share the process; not measured on a CPU) and the first step's time (it compiles).
Targets: course/hand >= ``--target`` everywhere, and MFU >= ``--mfu_target`` at the full gpt2 size where
MFU is known. Writes ``<out>/gpu.json``; exits 1 on FAIL.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddp_course import bench as harness
from ddp_course.bench import BenchError
from ddp_course.course.l01_minigpt import bench_overhead as loops  # the loops and checks of the overhead bench


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch: int
    vocab: int  # 0: the corpus's own (character-level), else synthetic tokens of this vocabulary

    def describe(self, batch: int = 0) -> str:
        vocab = "corpus vocabulary" if self.vocab == 0 else f"vocabulary {self.vocab} (synthetic)"
        return (f"{self.n_layer} layers x {self.n_head} heads x {self.n_embd} wide, block {self.block_size}, "
                f"batch {batch or self.batch}, {vocab}")


SIZES = {
    "full": {"shakespeare": Size(6, 6, 384, 256, 64, 0), "gpt2": Size(12, 12, 768, 1024, 16, 50304)},
    "small": {"shakespeare": Size(2, 2, 128, 64, 8, 0), "gpt2": Size(2, 2, 128, 128, 4, 4096)},
}
COMPILE = {"both": (False, True), "on": (True,), "off": (False,)}
NO_CPU_MEMORY = ("not measured on a CPU: the process's peak resident set is one figure for the whole run "
                 "(every configuration and both loops), not one per loop")


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a loop keeps between steps: its parameters and optimizer state (gradients are freed)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return n + sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))


def _flash_check(attn: torch.nn.Module, device: torch.device, dtype: torch.dtype | None, block_size: int,
                 n_embd: int) -> tuple[bool, str]:
    """Can the model's attention run forward and backward with SDPA's flash kernel alone, at this size?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(2, block_size, n_embd, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                y = attn(x)
            y.float().sum().backward()
    except RuntimeError as exc:
        return False, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    finally:
        attn.zero_grad(set_to_none=True)
    return True, ""


def _batches(size: Size, opts: dict[str, Any], batch: int, device: torch.device) -> tuple[list, int, str]:
    """Pre-made (x, y) batches in host memory (pinned on a GPU), their vocabulary, and where they come from."""
    if size.vocab == 0:
        from ddp_course.data import prepare, train_batches

        data = prepare(opts["corpus"], size.block_size, 0.1, announce=print)
        it = train_batches(data.train, batch, 0, 1, opts["seed"])
        pairs, vocab, source = [next(it) for _ in range(opts["n_batches"])], data.tokenizer.vocab_size, data.corpus.name
    else:
        g = torch.Generator().manual_seed(opts["seed"])
        seqs = [torch.randint(size.vocab, (batch, size.block_size + 1), generator=g) for _ in range(opts["n_batches"])]
        pairs, vocab, source = [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in seqs], size.vocab, "synthetic"
    if device.type == "cuda":
        pairs = [(x.pin_memory(), y.pin_memory()) for x, y in pairs]
    return pairs, vocab, source


def _run_size(name: str, size: Size, opts: dict[str, Any], device: torch.device, modes: tuple[bool, ...],
              peak: float | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every compile setting of one size: the same-work check, then the timed rows."""
    from ddp_course import parallel
    from ddp_course.config import ConfigError, from_dict
    from ddp_course.dist import DeviceError, DistInfo, seed_everything
    from ddp_course.model import GPTConfig, MiniGPT
    from ddp_course.train import DTYPES, _check_precision, build_optimizer, make_scaler

    batch = opts["batch"] or size.batch
    batches, vocab, source = _batches(size, opts, batch, device)
    per_mode = opts["warmup"] + opts["repeats"] * opts["steps"]
    try:
        cfg = from_dict({"n_layer": size.n_layer, "n_head": size.n_head, "n_embd": size.n_embd,
                         "block_size": size.block_size, "micro_batch_size": batch, "seed": opts["seed"],
                         "precision": opts["precision"], "device": device.type,
                         "max_steps": opts["check_steps"] + per_mode * len(modes)})
        _check_precision(cfg, device)
    except (ConfigError, DeviceError) as exc:
        raise BenchError(str(exc)) from None
    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    info = DistInfo(device=device)

    def build() -> torch.nn.Module:
        seed_everything(cfg.seed)
        m = MiniGPT(GPTConfig.from_train(cfg, vocab)).to(device)
        m.train()
        return m

    plain_c, plain_h = build(), build()
    cm = parallel.wrap(plain_c, info, cfg)
    c_opt, h_opt = build_optimizer(cm, cfg, device), loops.hand_optimizer(plain_h, cfg, device)
    loops.same_optimizer_config(c_opt, h_opt, cm, plain_h)
    scaler = make_scaler(device, cfg.precision)
    n_params, fpt = plain_c.num_params(), plain_c.flops_per_token()
    tokens_per_step = batch * size.block_size
    flash = _flash_check(plain_c.blocks[0].attn, device, dtype, size.block_size, size.n_embd)
    print(f"[gpu] {name}: {size.describe(batch)}; "
          f"{n_params:,} parameters, {fpt / 1e6:,.1f} MFLOP per token; tokens from {source}; "
          f"SDPA flash kernel {'usable' if flash[0] else 'NOT usable: ' + flash[1]}", flush=True)

    # same work: eager, from one state, on the same batches, at a constant learning rate. On a GPU the
    # attention runs through SDPA's math kernel here (flash's backward accumulates in a varying order)
    # and bf16 rounding can turn a last-bit difference into one of 2**-8: allow 1e-3 relative there.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    done = {"course": 0, "hand": 0}  # steps each loop has run: its batches and learning rate go on from there

    def run(which: str, models: dict[str, torch.nn.Module], n: int, schedule: bool = True) -> torch.Tensor:
        start, done[which] = done[which], done[which] + n
        if which == "course":
            return loops.course_steps(models["course"], c_opt, scaler, batches, cfg, device, start, n, schedule)
        return loops.hand_steps(models["hand"], h_opt, batches, start, n, cfg.grad_clip, dtype)

    eager = {"course": cm, "hand": plain_h}
    with sdpa_kernel([SDPBackend.MATH]) if device.type == "cuda" else contextlib.nullcontext():
        check = loops.same_work_check("gpu", lambda _: run("course", eager, 1, schedule=False),
                                         lambda _: run("hand", eager, 1), cm, plain_h, opts["check_steps"],
                                         rel_tol=1e-3 if device.type == "cuda" else 1e-6)
    check["flash_attention"], check["flash_reason"] = flash

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for compiled in modes:
        # the course compiles the plain model and then wraps it (run_training's order); the hand loop
        # compiles its model. The second compile of the same graph finds the first one's kernels cached.
        models = ({"course": parallel.wrap(torch.compile(plain_c), info, cfg), "hand": torch.compile(plain_h)}
                  if compiled else eager)
        first = {}
        for which in ("course", "hand"):
            sync()
            t0 = time.perf_counter()
            try:
                run(which, models, 1).item()
            except Exception as exc:  # inductor needs a C++ compiler (CPU) or Triton (GPU)
                if not compiled:
                    raise
                raise BenchError(f"torch.compile failed for the {which} loop at size {name}: {type(exc).__name__}: "
                                 f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''} "
                                 "(--compile=off times eager only)") from None
            first[which] = time.perf_counter() - t0
            if opts["warmup"] > 1:
                run(which, models, opts["warmup"] - 1).item()
        state = {"course": _state_bytes(cm, c_opt), "hand": _state_bytes(plain_h, h_opt)}
        tps: dict[str, list[float]] = {"course": [], "hand": []}
        mem, cpu = {"course": 0, "hand": 0}, {"course": 0.0, "hand": 0.0}
        gc.collect()
        for r in range(opts["repeats"]):
            for which in (("course", "hand") if r % 2 == 0 else ("hand", "course")):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                value = run(which, models, opts["steps"]).item()  # one host sync per block, in both loops
                sync()
                dt = time.perf_counter() - t0
                cpu[which] += time.process_time() - c0
                if not math.isfinite(value):
                    raise BenchError(f"the {which} loop's loss became {value} at size {name}")
                tps[which].append(tokens_per_step * opts["steps"] / dt)
                if device.type == "cuda":
                    other = state["hand" if which == "course" else "course"]
                    mem[which] = max(mem[which], torch.cuda.max_memory_allocated(device) - other)
        med = {k: harness.median(v) for k, v in tps.items()}
        row = {"size": name, "compile": compiled, "n_layer": size.n_layer, "n_head": size.n_head,
               "n_embd": size.n_embd, "block_size": size.block_size, "batch": batch, "vocab_size": vocab,
               "tokens": source, "n_params": n_params, "flops_per_token": fpt, "tokens_per_step": tokens_per_step,
               "course_tokens_per_s": tps["course"], "hand_tokens_per_s": tps["hand"],
               "course_tokens_per_s_median": med["course"], "hand_tokens_per_s_median": med["hand"],
               "ratio": med["course"] / med["hand"],
               "ratio_paired_median": harness.median([c / h for c, h in zip(tps["course"], tps["hand"])]),
               "spread": max(harness.spread(tps["course"]), harness.spread(tps["hand"])),
               # on a CPU, tokens per CPU-second of this process: time slices lost to other work do not count
               "ratio_cpu_time": cpu["hand"] / cpu["course"] if device.type == "cpu" and cpu["course"] > 0 else None,
               "course_step_ms": 1e3 * tokens_per_step / med["course"], "first_step_s": first,
               "course_mfu": fpt * med["course"] / peak if peak else None,
               "hand_mfu": fpt * med["hand"] / peak if peak else None,
               "course_peak_memory_bytes": mem["course"] if device.type == "cuda" else None,
               "hand_peak_memory_bytes": mem["hand"] if device.type == "cuda" else None}
        row["noisy"] = max(harness.span(tps["course"]), harness.span(tps["hand"])) > harness.DISTURBED_SPAN
        rows.append(row)
        mfu = f", MFU {row['course_mfu']:.1%}" if peak else ""
        print(f"[gpu] {name} {'compiled' if compiled else 'eager'}: course {med['course']:,.0f} tok/s, hand "
              f"{med['hand']:,.0f} tok/s, course/hand {row['ratio']:.3f}{mfu} (first step {first['course']:.1f} s)",
              flush=True)
    return rows, check


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


@harness.bench("gpu",
       sizes=("shakespeare,gpt2", f"comma-separated, from: {', '.join(SIZES['full'])}"),
       compile=("auto", "both | on | off | auto (both on a GPU, off on a CPU)"),
       device=("auto", "auto (the first GPU, else CPU) | cpu | cuda"),
       scale=("auto", "full | small | auto (full on a GPU, small on a CPU)"),
       precision=("bf16", "bf16 (autocast) | fp32"),
       batch=(0, "sequences per step (0: the size's own)"),
       steps=(0, "optimizer steps per timed block (0: 20 on a GPU, 5 on a CPU)"),
       warmup=(3, "untimed steps of each loop first, at least 1 (the first one compiles)"),
       repeats=(3, "timed blocks of each loop; who goes first alternates"),
       check_steps=(3, "steps of the same-work check (eager, from one state, same batches)"),
       n_batches=(8, "pre-made batches, cycled (pinned host memory on a GPU, copied in every step)"),
       threads=(0, "torch CPU threads (0: leave the default)"),
       seed=(1337, "model init and batches"),
       corpus=("tinyshakespeare", "tinyshakespeare | offline | a path (the shakespeare size)"),
       target=(0.97, "PASS needs course/hand tokens/s at least this in every configuration"),
       mfu_target=(0.45, "PASS needs the course loop's best MFU at the full gpt2 size at least this (where known)"))
def gpu(opts: dict[str, Any]) -> dict[str, Any]:
    """MiniGPT (Shakespeare and GPT-2-small sizes) in bf16, eager and compiled: tokens/s, MFU, memory, course/hand."""
    from ddp_course.metrics import peak_flops

    harness.positive(opts, "repeats", "check_steps", "n_batches", "warmup")
    for key, choices in (("compile", ("auto", *COMPILE)), ("device", ("auto", "cpu", "cuda")),
                         ("scale", ("auto", *SIZES)), ("precision", ("bf16", "fp32"))):
        if opts[key] not in choices:
            raise BenchError(f"--{key}={opts[key]!r} is not a choice; choose one of {', '.join(choices)}.")
    names = [s.strip() for s in opts["sizes"].split(",") if s.strip()]
    unknown = [s for s in names if s not in SIZES["full"]]
    if unknown or not names:
        raise BenchError(f"--sizes: unknown size(s) {unknown}; choose from {', '.join(SIZES['full'])} "
                         "(comma-separated).")
    for key in ("batch", "steps", "threads"):
        if opts[key] < 0:
            raise BenchError(f"--{key} must be 0 or more (got {opts[key]}).")
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device=cuda but PyTorch sees no CUDA GPU; use --device=cpu or --device=auto.")
    device = torch.device("cuda" if opts["device"] != "cpu" and torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    if opts["threads"] > 0:
        torch.set_num_threads(opts["threads"])
    scale = opts["scale"] if opts["scale"] != "auto" else ("full" if on_gpu else "small")
    modes = COMPILE[opts["compile"] if opts["compile"] != "auto" else ("both" if on_gpu else "off")]
    opts = {**opts, "steps": opts["steps"] or (20 if on_gpu else 5)}
    peak = peak_flops(device, opts["precision"])
    gpu_name = torch.cuda.get_device_name(device) if on_gpu else None
    if not on_gpu:
        mfu_reason = "no CUDA GPU: MFU is measured against a GPU's dense peak"
    elif peak is None:
        mfu_reason = (f"no dense {opts['precision']} peak known for {gpu_name}: add it, with its data-sheet source, "
                      "to ddp_course.metrics.PEAK_FLOPS")
    else:
        mfu_reason = ""
    compile_text = ("eager and compiled" if len(modes) == 2 else "compiled only" if modes[0] else "eager only")
    if opts["compile"] == "auto" and not on_gpu:
        compile_text += " (compiling takes minutes on a CPU; --compile=both adds it)"
    sizes_text = "; ".join(f"{n}: {SIZES[scale][n].describe()}" for n in names)
    where = "no CUDA GPU" if opts["device"] != "cpu" else "--device=cpu"
    if on_gpu:
        print(f"[gpu] {gpu_name}: {scale} sizes ({sizes_text}), {opts['precision']}, {compile_text}; "
              + (f"MFU against a dense {opts['precision']} peak of {peak / 1e12:,.0f} TFLOP/s" if peak
                 else f"MFU not reported ({mfu_reason})"), flush=True)
    else:
        print(f"[gpu] {where}: running the {scale} sizes ({sizes_text}) on CPU in {opts['precision']}, {compile_text}, "
              f"{torch.get_num_threads()} thread(s), MFU not reported", flush=True)
    print(f"[gpu] {opts['repeats']} timed blocks of {opts['steps']} steps per loop after {opts['warmup']} warm-up "
          f"step(s); float32 matmul precision {torch.get_float32_matmul_precision()!r} (no MiniGPT matmul runs in "
          "fp32 under bf16 autocast)", flush=True)

    rows, checks = [], {}
    for name in names:
        size_rows, checks[name] = _run_size(name, SIZES[scale][name], opts, device, modes, peak)
        rows.extend(size_rows)
        # free this size's models before the next one; its compiled code too (the next size compiles afresh)
        if True in modes:
            torch._dynamo.reset()
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()

    print()
    print(f"{'size':<12} {'compile':<8} {'course tok/s':>13} {'hand tok/s':>13} {'course/hand':>11} {'spread':>7} "
          f"{'MFU':>6} {'course peak mem':>16} {'hand peak mem':>14} {'first step':>10}")
    for r in rows:
        mfu = f"{r['course_mfu']:.1%}" if r["course_mfu"] is not None else "-"
        print(f"{r['size']:<12} {'on' if r['compile'] else 'off':<8} {r['course_tokens_per_s_median']:>13,.0f} "
              f"{r['hand_tokens_per_s_median']:>13,.0f} {r['ratio']:>11.3f} {r['spread']:>7.1%} {mfu:>6} "
              f"{_gib(r['course_peak_memory_bytes']):>16} {_gib(r['hand_peak_memory_bytes']):>14} "
              f"{r['first_step_s']['course']:>9.1f}s")
    ratio_pass = all(r["ratio"] >= opts["target"] for r in rows)
    gpt2_mfu = [r["course_mfu"] for r in rows if r["size"] == "gpt2" and r["course_mfu"] is not None]
    mfu_best = max(gpt2_mfu) if gpt2_mfu and scale == "full" else None
    mfu_pass = None if mfu_best is None else mfu_best >= opts["mfu_target"]
    passed = ratio_pass and mfu_pass is not False
    print(f"\ncourse/hand >= {opts['target']} in every configuration: {'PASS' if ratio_pass else 'FAIL'} "
          f"(lowest {min(r['ratio'] for r in rows):.3f})")
    if mfu_best is not None:
        print(f"MFU at the gpt2 size >= {opts['mfu_target']:.0%}: {'PASS' if mfu_pass else 'FAIL'} "
              f"(best {mfu_best:.1%})")
    else:
        why = mfu_reason or ("the gpt2 size did not run" if "gpt2" not in names else "the sizes ran scaled down")
        print(f"MFU target not checked: {why}")
    if not on_gpu:
        print("course/hand per CPU-second of this process (less disturbed by other work): "
              + ", ".join(f"{r['size']} {'compiled' if r['compile'] else 'eager'} {r['ratio_cpu_time']:.3f}" for r in rows))
        print(f"peak memory: {NO_CPU_MEMORY}")
    span = max(harness.span(r[f"{k}_tokens_per_s"]) for r in rows for k in ("course", "hand"))
    harness.noise_warning("gpu", span, "Rerun on an idle machine (on a CPU: or with "
                          "--threads=1 and more --repeats) before trusting the ratio"
                          + ("; the CPU-second ratio above is the less disturbed figure." if not on_gpu else "."))
    return {"bench": "gpu", "options": opts, "device": str(device), "gpu": gpu_name, "scale": scale,
              "precision": opts["precision"], "compile_modes": list(modes), "threads": torch.get_num_threads(),
              "peak_flops": peak, "mfu_reason": mfu_reason or None,
              "peak_memory_reason": None if on_gpu else NO_CPU_MEMORY,
              "float32_matmul_precision": torch.get_float32_matmul_precision(), "rows": rows,
              "same_work_check": checks, "target": opts["target"], "ratio_pass": ratio_pass,
              "mfu_target": opts["mfu_target"], "mfu_best_gpt2": mfu_best, "mfu_pass": mfu_pass, "pass": passed}


_, main = harness.entry_points("gpu")


if __name__ == "__main__":
    sys.exit(main())
