"""torch.compile under DDP: what the first step costs, and what every later step gains.

    python -m ddp_course.bench compile_ddp                         # inductor, a cold compile cache
    python -m ddp_course.course.l10_scaling.bench_compile_ddp --n_layer=4 --n_embd=256 --cold=false --out=/tmp/bench

Runs the lab ``ddp_course.course.l10_scaling.compile_ddp`` on ``--nproc`` processes with ``--backend`` (default
inductor: real code generation, which on a CPU needs a C++ compiler) and ``--timing=true``:

- **cold compile** -- the first step of ``torch.compile(DDP(model))`` in a fresh process. With
  ``--cold=true`` inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``) is a new, empty folder, as on
  a machine that never compiled this model; with ``--cold=false`` it is the user's cache, which a
  previous run may have filled;
- **warm compile** -- the first step of a second compile of the same model in the same process: dynamo
  traces again, inductor finds the generated code in its cache;
- **steady state** -- the median step time, eager DDP against the compiled model, after two warm-up steps;
- **break-even** -- the compile time (warm, and cold) divided by the time saved per step (none when
  compiled steps are not faster).

Speed on a CPU with a small model says little about a GPU, where fusing kernels pays most:
``--device=auto`` (default) runs on the GPUs with NCCL when every process has one, else on the CPU,
and the bench says which device it ran on. Not run by the tests (it takes minutes).
Prints a table and writes ``<out>/compile_ddp.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError

NAME = "compile_ddp"
LAB = "ddp_course.course.l10_scaling.compile_ddp"


def _check(opts: dict[str, Any]) -> None:
    """Refuse options the lab cannot run."""
    if opts["nproc"] < 2:
        raise OptionError("--nproc must be at least 2: the lab compiles a DDP model.")
    harness.choice(opts, "device", ("auto", "cpu", "cuda"))
    harness.choice(opts, "backend", ("inductor", "aot_eager", "eager"))


@harness.bench(NAME, check=_check,
               nproc=(2, "DDP processes"),
               backend=("inductor", "inductor | aot_eager | eager"),
               cold=(True, "true: an empty inductor cache for this run; false: the user's cache"),
               n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(192, "model width"),
               block_size=(64, "tokens per sequence"), micro_batch_size=(8, "sequences per rank per step"),
               timing_steps=(20, "steady-state steps timed (after two warm-up steps)"),
               device=("auto", "auto (NCCL on GPUs when each process has one, else gloo on CPU) | cpu | cuda"),
               timeout_s=(900.0, "wall-clock limit of the job"))
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the lab with timing on; returns the result written to ``<out>/compile_ddp.json``."""
    base = Path(opts["out"]).resolve()
    lab_dir = base / NAME
    env = {}
    cold_dir = tempfile.mkdtemp(prefix="ddp_course_inductor_") if opts["cold"] else None
    if cold_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cold_dir
    flags = {k: opts[k] for k in ("backend", "n_layer", "n_head", "n_embd", "block_size", "micro_batch_size",
                                  "timing_steps", "device")}
    _, _, reason = harness.device_for(opts["device"], opts["nproc"])
    print(f"[compile_ddp] {opts['nproc']} processes, {reason}; backend {opts['backend']}, "
          f"{'an empty' if opts['cold'] else 'the existing'} inductor cache; MiniGPT {opts['n_layer']} x "
          f"{opts['n_embd']}, {opts['micro_batch_size']} x {opts['block_size']} tokens per rank", flush=True)
    try:
        r = harness.launch(LAB, opts["nproc"], what="the lab", out_dir=lab_dir, timeout=opts["timeout_s"], env=env,
                           timing=True, breakages=False, variants="eager,compile(DDP(model))", steps=3, **flags)
    finally:
        if cold_dir:
            shutil.rmtree(cold_dir, ignore_errors=True)
    lab = harness.job_result(r, "compile_ddp.json")
    t = lab["timing"]
    a = lab["variants"]["compile(DDP(model))"]
    res = {
        "cold_compile_first_step_s": a["first_step_s"],
        "warm_compile_first_step_s": t["compile(DDP(model))"]["first_step_s"],
        "warm_cache_hits": t["compile(DDP(model))"]["fxgraph_cache_hits"],
        "eager_step_s": t["eager"]["steady_step_s"],
        "compiled_step_s": t["compile(DDP(model))"]["steady_step_s"],
        "saved_per_step_s": t["saved_per_step_s"],
        "break_even_steps": t["break_even_steps"],
        "cold_break_even_steps": (a["first_step_s"] / t["saved_per_step_s"]) if t["saved_per_step_s"] > 0 else None,
        "losses_match_eager": a["matches_eager"],
        "graphs_compiled": a["backend_compiles"],
        "device": lab["device"], "process_group_backend": lab["backend"],
    }
    print(f"\nmeasured on {lab['device_reason']}")
    print(f"first step, cold cache ({'fresh' if opts['cold'] else 'as found'}):  {res['cold_compile_first_step_s']:8.2f} s")
    print(f"first step, warm cache ({res['warm_cache_hits']} hits):     {res['warm_compile_first_step_s']:8.2f} s")
    print(f"steady step, eager DDP:               {res['eager_step_s'] * 1e3:8.2f} ms")
    print(f"steady step, compile(DDP(model)):     {res['compiled_step_s'] * 1e3:8.2f} ms")
    for label, be in (("warm", res["break_even_steps"]), ("cold", res["cold_break_even_steps"])):
        print(f"break-even, {label} compile:                {f'{be:,.0f} steps' if be else 'never (compiled steps are not faster here)'}")
    return {"bench": NAME, "options": opts, "result": res, "lab": lab, "job_wall_s": r.elapsed_s}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
