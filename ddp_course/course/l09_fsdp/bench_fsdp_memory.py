"""Memory per rank under DDP and FSDP: the calculator's prediction against a real run.

    python -m ddp_course.course.l09_fsdp.bench_fsdp_memory                      # 2 and 4 processes
    python -m ddp_course.course.l09_fsdp.bench_fsdp_memory --world_sizes=2 --n_embd=128 --out=/tmp/bench
    python -m ddp_course.bench fsdp_memory                           # the same, through the bench command

For each world size W it starts one job, ``torchrun --nproc_per_node=W -m ddp_course.course.l09_fsdp.fsdp_lab``,
which trains MiniGPT with every variant (DDP; FSDP2 full shard, no reshard after forward, bf16 mixed
precision, activation checkpointing, hybrid on a 2-D mesh when W >= 4; FSDP1 full shard, grad-op,
hybrid) and measures on every rank, after the first optimizer step, the bytes of the storages
behind its parameters, gradients and AdamW states, and the bytes autograd saved in forward
(``ddp_course.course.l09_fsdp.memory``). Targets, checked on every rank:

1. sharding works: under full sharding (``fsdp``), parameters + gradients + optimizer states are
   within 2 % of (DDP's measured bytes / W) + the padding the calculator predicts;
2. the calculator is right: its prediction is within 5 % of the measurement for every variant, for
   each of parameters, gradients, optimizer states and activations.

On a GPU (``--device=auto`` with one GPU per process) the table adds the CUDA caching allocator's
peak next to the calculator's estimate of the peak (states + activations + gathered parameters);
that column has no target: the allocator's peak also holds temporary buffers the calculator does
not model.

Prints a table and writes ``<out>/fsdp_memory.json`` (``--out`` defaults to ``bench_results``).
Exit code 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError

NAME = "fsdp_memory"
SHARDING_TOL = 0.02  # target 1
CALC_TOL = 0.05  # target 2
ALL_VARIANTS = ("ddp", "fsdp", "fsdp_noreshard", "fsdp_bf16", "fsdp_ac", "fsdp_hybrid", "fsdp1", "fsdp1_noreshard",
                "fsdp1_hybrid")
QUANTITIES = ("params", "grads", "optimizer", "activations")


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a measurement; ``world_sizes`` becomes a list."""
    opts["world_sizes"] = harness.int_list(opts, "world_sizes", "2,4")
    if not opts["world_sizes"] or min(opts["world_sizes"]) < 2:
        raise OptionError("--world_sizes lists processes per job, each at least 2 (FSDP shards over ranks), e.g. 2,4.")
    unknown = [v for v in opts["variants"].split(",") if v and v not in ALL_VARIANTS]
    if unknown or "ddp" not in opts["variants"].split(","):
        raise OptionError(f"--variants must include ddp (the reference) and only names from {', '.join(ALL_VARIANTS)}"
                          f"{f'; unknown: {unknown}' if unknown else ''}.")


def variants_for(world_size: int, variants: str) -> list[str]:
    """The variants that exist at this world size (hybrid needs 4+ ranks, an even number)."""
    return [v for v in variants.split(",") if v and not (v.endswith("hybrid") and (world_size < 4 or world_size % 2))]


def rel(a: float, b: float) -> float:
    """|a - b| / |b| (0 when both are 0)."""
    return abs(a - b) / abs(b) if b else (0.0 if a == 0 else float("inf"))


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (variant, rank): measured and predicted bytes, and the two targets' errors."""
    ws = report["world_size"]
    ddp = report["variants"]["ddp"]["per_rank"]
    rows = []
    for name, v in report["variants"].items():
        for rank, r in enumerate(v["per_rank"]):
            m, p = r["measured"], r["predicted"]
            row = {"world_size": ws, "variant": name, "rank": rank, "measured_states": m["states"],
                   "predicted_states": p["states"], "padding": p["padding"],
                   "calc_error": max(rel(p[q], m[q]) for q in QUANTITIES),
                   "step_time_s": v["step_time_s"], **{f"measured_{q}": m[q] for q in QUANTITIES},
                   **{f"predicted_{q}": p[q] for q in QUANTITIES}}
            if name == "fsdp":
                expected = ddp[rank]["measured"]["states"] / ws + p["padding"]
                row["sharding_expected"] = expected
                row["sharding_error"] = rel(m["states"], expected)
            if r.get("cuda"):
                row["cuda_peak_allocated"] = r["cuda"]["peak_allocated"]
                row["predicted_peak"] = p["states"] + p["activations"] + p["gathered"]
            rows.append(row)
    return rows


@harness.bench(NAME, check=_check,
               world_sizes=("2,4", "processes per job (comma-separated); each is one torchrun job"),
               variants=(",".join(ALL_VARIANTS), "comma-separated, ddp among them"),
               steps=(2, "optimizer steps of each variant"),
               n_layer=(2, "transformer blocks"), n_head=(4, "attention heads"), n_embd=(64, "model width"),
               block_size=(32, "tokens per sequence"), micro_batch_size=(4, "sequences per rank per step"),
               device=("auto", "auto (GPUs when each process has one, else CPU) | cpu | cuda"),
               timeout_s=(300.0, "wall-clock limit of each job (all its processes are stopped after it)"))
def run(opts: dict[str, Any]) -> dict[str, Any]:
    """Run the lab at every world size, print the table; PASS when both targets are met."""
    out = Path(opts["out"])
    reports, rows = [], []
    device, world_sizes, reason = harness.study_device(opts["device"], opts["world_sizes"])
    opts = {**opts, "device": device, "world_sizes": world_sizes}  # one kind of device for every job
    print(f"[{NAME}] {reason}", flush=True)
    lab_opts = {k: opts[k] for k in ("steps", "n_layer", "n_head", "n_embd", "block_size", "micro_batch_size",
                                     "device")}
    for ws in opts["world_sizes"]:
        run_dir = out / f"{NAME}_w{ws}"
        t0 = time.perf_counter()
        r = harness.launch("ddp_course.course.l09_fsdp.fsdp_lab", ws, what=f"the job with {ws} processes",
                           out_dir=run_dir, timeout=opts["timeout_s"],
                           variants=",".join(variants_for(ws, opts["variants"])), **lab_opts)
        report = harness.job_result(r, "fsdp_lab.json")
        report["wall_s"] = time.perf_counter() - t0
        reports.append(report)
        rows += evaluate(report)
    sharding = [r for r in rows if "sharding_error" in r]
    worst_shard = max((r["sharding_error"] for r in sharding), default=float("nan"))
    worst_calc = max(r["calc_error"] for r in rows)
    targets = {"sharding": {"tolerance": SHARDING_TOL, "worst": worst_shard,
                            "met": bool(sharding) and worst_shard <= SHARDING_TOL},
               "calculator": {"tolerance": CALC_TOL, "worst": worst_calc, "met": worst_calc <= CALC_TOL}}
    result = {"name": NAME, "options": opts, "device": device, "device_reason": reason, "rows": rows, "targets": targets,
              "jobs": [{"world_size": r["world_size"], "wall_s": r["wall_s"]} for r in reports],
              "pass": all(t["met"] for t in targets.values())}
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    gpu = any("cuda_peak_allocated" in r for r in result["rows"])
    head = (f"{'W':>2} {'variant':<16}{'rank':>4} {'states (B)':>12} {'predicted':>12} {'padding':>9} "
            f"{'activations':>12} {'calc err':>9} {'vs DDP/W':>9} {'step ms':>8}")
    if gpu:
        head += f" {'CUDA peak':>12} {'est. peak':>12}"
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        line = (f"{r['world_size']:>2} {r['variant']:<16}{r['rank']:>4} {r['measured_states']:>12,} "
                f"{r['predicted_states']:>12,.0f} {r['padding']:>9,.0f} {r['measured_activations']:>12,} "
                f"{r['calc_error']:>8.2%} {(format(r['sharding_error'], '>8.2%') if 'sharding_error' in r else ''):>9} "
                f"{r['step_time_s'] * 1e3:>8.1f}")
        if gpu:
            line += f" {r.get('cuda_peak_allocated', 0):>12,} {r.get('predicted_peak', 0):>12,}"
        lines.append(line)
    t = result["targets"]
    lines += ["", f"target 1 (full shard within {SHARDING_TOL:.0%} of DDP/W + padding, every rank): worst "
                  f"{t['sharding']['worst']:.3%} -> {'met' if t['sharding']['met'] else 'NOT met'}",
              f"target 2 (calculator within {CALC_TOL:.0%} of the measurement, every variant, rank and quantity): "
              f"worst {t['calculator']['worst']:.3%} -> {'met' if t['calculator']['met'] else 'NOT met'}",
              f"device: {result['device']}"]
    return "\n".join(lines)


_, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
