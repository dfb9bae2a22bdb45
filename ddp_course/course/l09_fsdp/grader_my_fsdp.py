"""Grader of exercise 09's third part (``lessons/exercises/09_my_fsdp.py``): FSDP (ZeRO-3) built by hand.

First, in its own process, it calls the learner's ``shard_of`` on weights whose element counts do not
divide by the world size (``shard_problem``): the ranks' shards, put end to end, must be the weight,
each of the contract's length, no padding in any. Then it runs the script with torchrun on 2
processes. Every rank reports, for each of the script's runs (MiniGPT with SGD and no prefetch, with
AdamW and prefetch, a model of odd sizes, MiniGPT in bf16): the losses next to those of the
script's one-process reference, whether the trained parameters equal the reference's bit for bit, any
gradient handed to the optimizer in another dtype or shape than its parameter's, the size of the
gradients at the first step against the reference's, the most parameter bytes it held at once, and
which all-gathers were in flight as each unit computed. The grader checks, against references of its
own:

- the gradients: fp32 and the shape of their shard; the sharded and the replicated ones each the
  reference's (an average over the ranks), not N times it (a sum);
- the memory: the peak of the run without prefetch equals the shards, the replicated parameters and
  the root's and one block's gathered weights (``predicted_peak``, from the lesson's calculator's
  table of MiniGPT's tensors), not every unit's at once; with prefetch, the root's and 1 + prefetch
  blocks';
- the prefetch: with ``prefetch=1`` some units compute while the next unit's all-gather is in flight;
  without it, none;
- the numbers: the fp32 runs equal to the one-process reference bit for bit, the bf16 run within the
  script's tolerance, and the AdamW run's losses equal to a one-process run on the global batch that
  the grader trains itself (``reference_losses``) within rounding;

and names the mistake behind what it measured. The verdict carries the job's RESULT rows.
"""

from __future__ import annotations

import math
from pathlib import Path

from ddp_course.check import GradedRun, Verdict, judged, nearest, run_exercise
from ddp_course.check.reference import harness_constants

EXERCISE = "09_my_fsdp.py"
# The course has no function with the contract of an answer here (lesson 09's strategy calls fully_shard).
DELEGATES: tuple[str, ...] = ()
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py).
GIVEAWAYS = ("dist.reduce_scatter_tensor(mine", "padded[:shard.numel()] = shard", "units[i:i + 1 + prefetch]",
             "flat[rank * chunk:(rank + 1) * chunk]", "mine[:shard_numel].float() / world_size",
             "start every unit first, then wait")
NPROC = 2
LOSS_RTOL = 1e-5  # one process on the concatenated batch vs the mean of the ranks' means: rounding only
FP32, BF16 = 4, 2


def sharded(shape: tuple[int, ...]) -> bool:
    """MiniGPT's Linear and Embedding weights are its 2-D tensors (the norms and biases are 1-D)."""
    return len(shape) == 2


def predicted_peak(shape: dict[str, int], rank: int, prefetch: int, compute_bytes: int = FP32,
                   world_size: int = NPROC) -> dict[str, int]:
    """The parameter bytes a rank holds at most, from the lesson's calculator's table of MiniGPT's tensors:
    its shards (fp32, real elements only), the replicated tensors (fp32), and gathered at once the root's
    weights and 1 + ``prefetch`` blocks' (``world_size * ceil(numel / world_size)`` elements each, padding
    included, in the compute dtype). ``every`` is the shards plus every unit gathered at once (not DDP's: DDP
    holds the fp32 parameters once, with no shards beside them)."""
    from ddp_course.course.l09_fsdp import memory

    table = memory.parameter_table(shape)
    shards = replicated = 0
    units: dict[str, int] = {}
    for t in table:
        if not sharded(t.shape):
            replicated += t.numel * FP32
            continue
        chunk = math.ceil(t.numel / world_size)
        shards += max(0, min(chunk, t.numel - rank * chunk)) * FP32
        units[t.unit] = units.get(t.unit, 0) + world_size * chunk * compute_bytes
    blocks = sorted((v for k, v in units.items() if k != "root"), reverse=True)
    base = shards + replicated
    return {"shards": shards, "replicated": replicated, "root": units["root"], "block": blocks[0],
            "peak": base + units["root"] + sum(blocks[:1 + prefetch]), "every": base + sum(units.values())}


def reference_losses(constants: dict, world_size: int = NPROC) -> list[float]:
    """MiniGPT trained with AdamW in this process on every rank's micro-batch at once: the losses
    (exercise 09's one-process reference, ``grader.reference_training``)."""
    from ddp_course.course.l09_fsdp.grader import reference_training

    return reference_training(constants, world_size)[0]


def shard_problem(shard_of) -> str | None:
    """What the learner's ``shard_of`` does wrong on sizes that do not divide by the world size, or None."""
    import torch

    for world_size in (2, 3, 4):
        for shape in ((7,), (5, 3), (2, 2), (1,)):
            full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1
            chunk = math.ceil(full.numel() / world_size)
            try:
                parts = [shard_of(full, r, world_size) for r in range(world_size)]
            except Exception as exc:  # noqa: BLE001 -- the learner's code: any error is part of the verdict
                return f"shard_of(a weight of shape {shape}, rank, {world_size}) raised {type(exc).__name__}: {exc}"
            call = f"on {world_size} ranks, a weight of shape {shape} ({full.numel()} elements, c = {chunk})"
            lengths = [p.numel() for p in parts]
            want = [max(0, min(chunk, full.numel() - r * chunk)) for r in range(world_size)]
            if sum(lengths) > full.numel():
                return (f"uneven shards: {call} gives shards of {lengths} elements, {sum(lengths) - full.numel()} more "
                        "than the weight has: the padding is in the shards, where the optimizer would step it and "
                        f"keep state for it. A shard holds only real elements ({want}); pad only what travels.")
            if sum(lengths) < full.numel():
                return (f"uneven shards: {call} gives shards of {lengths} elements, {full.numel() - sum(lengths)} fewer "
                        f"than the weight has: the elements left over would belong to no rank. Each rank keeps c "
                        f"elements, the last ones fewer ({want}).")
            if lengths != want or not torch.equal(torch.cat([p.reshape(-1) for p in parts]), full.reshape(-1)):
                return (f"{call} gives shards of {lengths} elements, whose elements in rank order are not the weight's: "
                        f"rank r keeps elements [r * c, (r + 1) * c) of the flattened weight ({want}).")
            if any(p.dim() != 1 or p.dtype != torch.float32 for p in parts):
                return f"{call} returns shards of shapes {[tuple(p.shape) for p in parts]}: a shard is 1-D, fp32."
    return None


def learner_shard_problem(path: str | Path) -> str | None:
    """``shard_problem`` of the ``shard_of`` in the script at ``path`` (None when it cannot be imported here:
    the job then shows why)."""
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("exercise_09_my_fsdp", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        shard_of = module.shard_of
    except Exception:  # noqa: BLE001 -- e.g. a syntax error: the job reports it, with its line
        return None
    problem = shard_problem(shard_of)
    return None if problem is None else (f"{problem} (called in the grader's own process, before any job; fix "
                                         "shard_of, then run the check again)")


def collect(path: str | Path, timeout: float = 180) -> list[dict] | Verdict:
    return run_exercise(path, NPROC, "a function of the exercise", timeout, hint=_hint)


def _hint(output: str) -> str:
    if "compute its backward with its weights gathering" in output:
        return (" before_backward started units[i]'s all-gather but did not wait for it: autograd would read the "
                "buffer before the data arrived. Wait for units[i] before its backward computes.")
    if "compute its backward with its weights" in output:
        return (" No gather before backward: after_forward freed the unit's weights, and nothing gathered them "
                "again before autograd needed them (a matrix product's backward reads the weight it multiplied "
                "by). In before_backward, gather units[i] and wait for it, as before_forward does.")
    if "compute its forward with its weights" in output:
        return " before_forward must start units[i]'s all-gather (unless prefetched) and wait for it."
    return ""


def references(path: str | Path) -> dict:
    from ddp_course.course.tiny import VOCAB

    constants = harness_constants(path)
    shape = {"vocab_size": VOCAB, **constants["SHAPE"]}
    return {"shape": shape, "losses": reference_losses(constants), "bf16_rtol": constants["BF16_LOSS_RTOL"]}


def _run(row: dict, kind: str, optimizer: str, dtype: str = "float32") -> dict:
    return next(r for r in row["runs"] if r["kind"] == kind and r["optimizer"] == optimizer and r["dtype"] == dtype)


def _gradient_problem(rows: list[dict]) -> str | None:
    for row in rows:
        for run in row["runs"]:
            for said in run["grad_problems"]:
                where = f"in the {run['dtype']} run of {run['kind']}"
                if "bfloat16" in said or "float16" in said:
                    return (f"gradients left in the compute dtype: {said} ({where}). The optimizer steps the fp32 "
                            "master weights: reduce_gradient must hand it fp32 gradients (.float()).")
                if "no gradient" in said:
                    return f"{said} ({where}): every parameter the loss depends on must get its gradient."
                return (f"gradients in the unsharded shape: {said} ({where}). The optimizer steps the shard: "
                        "reduce_gradient returns this rank's shard_numel elements, 1-D.")
    for row in rows:
        for run in row["runs"]:
            if run["shard_numels_summed"] != run["weight_numels"]:
                pairs = [(s, w) for s, w in zip(run["shard_numels_summed"], run["weight_numels"]) if s != w]
                return (f"uneven shards: the ranks' shards hold {pairs[0][0]} elements of a weight of {pairs[0][1]} "
                        f"(in the {run['kind']} model): padding in a shard reaches the optimizer; every element "
                        "must be kept by exactly one rank.")
    return None


def _ratio_problem(rows: list[dict]) -> str | None:
    run = _run(rows[0], "gpt", "sgd")
    for part, fix in (("sharded", "reduce_gradient: divide the reduce-scattered sum by the number of ranks"),
                      ("replicated", "average_replicated: all-reduce the gradient, then divide it by the number of ranks")):
        ratio = run["grad_ratio"][part]
        found = nearest([ratio], {"averaged": [1.0], "summed": [float(NPROC)]})
        if found.name == "averaged" and found.clear() and abs(ratio - 1) < 1e-4:
            continue
        said = f"the {part} parameters' gradients at the first step are {ratio:.2f} times the one-process reference's"
        if found.name == "summed" and found.clear():
            what = "gradients summed" if part == "sharded" else "replicated parameters' gradients summed"
            return f"{what}, not averaged: {said}, the sum over the {NPROC} ranks. In {fix}."
        if part == "replicated":
            return (f"replicated parameters' gradients not averaged over the ranks: {said}: each rank steps them with "
                    f"its own batch's gradient. In {fix}.")
        return f"{said}, neither the average nor the sum over the ranks. Check reduce_gradient."
    return None


def _memory_problem(rows: list[dict], shape: dict) -> str | None:
    for row in rows:
        run = _run(row, "gpt", "sgd")
        want = predicted_peak(shape, row["rank"], run["prefetch"])
        got = run["peak_param_bytes"]
        if got == want["peak"]:
            continue
        found = nearest([got], {"resharded": [want["peak"]], "kept": [want["every"]]})
        if found.name == "kept" and found.clear():
            return (f"the full weights are kept after forward, or every unit is gathered at once: rank {row['rank']} "
                    f"held {got:,} parameter bytes at once without prefetch, the shards and every unit's gathered "
                    f"weights together ({want['every']:,}: more than DDP's parameters, with FSDP's traffic); with "
                    f"one unit gathered at a time it holds {want['peak']:,} (shards {want['shards']:,} + replicated "
                    f"{want['replicated']:,} + the root's {want['root']:,} + one block's {want['block']:,}). Either "
                    "after_forward does not free the unit's weights, or before_forward starts more units than "
                    "1 + prefetch (with prefetch=0, only units[i]): the numbers are right, the memory is not.")
        return (f"rank {row['rank']} held {got:,} parameter bytes at once without prefetch, where shards, replicated "
                f"parameters, the root's and one block's gathered weights make {want['peak']:,}. Either after_forward "
                "does not free the unit's weights, or before_forward starts more units than 1 + prefetch (with "
                "prefetch=0, only units[i]).")
    return None


def _prefetch_memory_problem(rows: list[dict], shape: dict) -> str | None:
    """The peak of every MiniGPT run with prefetch against ``predicted_peak`` (checked after the prefetch itself)."""
    for row in rows:
        for run in row["runs"]:
            if run["kind"] != "gpt" or run["prefetch"] == 0:
                continue
            want = predicted_peak(shape, row["rank"], run["prefetch"], BF16 if run["dtype"] == "bfloat16" else FP32)
            if run["peak_param_bytes"] != want["peak"]:
                return (f"rank {row['rank']} held {run['peak_param_bytes']:,} parameter bytes at once in the "
                        f"{run['dtype']} run with prefetch={run['prefetch']}, where shards, replicated parameters, the "
                        f"root's and 1 + {run['prefetch']} blocks' gathered weights make {want['peak']:,}: does "
                        "before_forward or before_backward start another number of units than 1 + prefetch, or "
                        "after_forward keep what it gathered?")
    return None


def _prefetch_problem(rows: list[dict]) -> str | None:
    for run in rows[0]["runs"]:
        for phase in ("forward", "backward"):
            computes = [c for c in run["computes"] if c["phase"] == phase]
            flying = sum(bool(c["in_flight"]) for c in computes)
            if run["prefetch"] > 0 and flying == 0 and run.get("synchronous_gathers", 0):
                return (f"prefetch that waits at once: start_gather returned no handle ({run['synchronous_gathers']} "
                        "times), so each all-gather ran to its end before start() returned and none was ever in "
                        f"flight while a unit computed its {phase}. Start it asynchronously (async_op=True) and return "
                        "its handle: the wait belongs to wait().")
            if run["prefetch"] > 0 and flying == 0:
                return (f"prefetch that waits at once: with prefetch={run['prefetch']}, none of the {len(computes)} "
                        f"units' {phase} computations began with another unit's all-gather in flight, so "
                        "communication never overlaps compute there. Start the next units' all-gathers and leave "
                        f"them running: in before_{phase}, wait only for units[i].")
            if run["prefetch"] == 0 and flying > 0:
                return (f"with prefetch=0, {flying} unit {phase} computation(s) began with another unit's all-gather "
                        f"in flight: start only units[i] when prefetch is 0.")
    return None


def diagnose(found: list[dict], *, shape: dict, losses: list[float], bf16_rtol: float) -> Verdict:
    rows = sorted(found, key=lambda r: r["rank"])
    for check in (_gradient_problem(rows), _ratio_problem(rows), _memory_problem(rows, shape), _prefetch_problem(rows),
                  _prefetch_memory_problem(rows, shape)):
        if check:
            return Verdict(False, check)
    for run in rows[0]["runs"]:
        if run["dtype"] == "float32" and not run["bitwise"]:
            return Verdict(False, f"the {run['kind']} model trained with {run['optimizer']} ends {run['max_abs_diff']:.1e} "
                                  "away from the one-process reference, which computes the same sums in the same order "
                                  "(fp32: it should be 0 bit for bit). Check that every gradient is the average of the "
                                  "ranks' and that the gathered weights are the shards put end to end.")
    bf16 = _run(rows[0], "gpt", "adamw", "bfloat16")
    rel = max((abs(a - b) / abs(b) for a, b in zip(bf16["losses"], bf16["ref_losses"])), default=math.inf)
    if len(bf16["losses"]) != len(bf16["ref_losses"]) or rel > bf16_rtol:
        return Verdict(False, f"in bf16 the losses are {rel:.1e} (relative) from fp32's, more than {bf16_rtol:.1e}")
    adamw = _run(rows[0], "gpt", "adamw")
    off = max(abs(a - b) / abs(b) for a, b in zip(adamw["losses"], losses))
    if off > LOSS_RTOL:
        return Verdict(False, f"the AdamW run's losses differ from the grader's one-process run by {off:.1e} (relative)")
    peaks = [predicted_peak(shape, rows[0]["rank"], p) for p in (0, adamw["prefetch"])]
    flying = sum(bool(c["in_flight"]) for c in adamw["computes"])
    return Verdict(True, f"the fp32 runs (SGD and AdamW, MiniGPT and a model of odd sizes) equal the one-process "
                         f"reference bit for bit; bf16 within {rel:.1e} of fp32's losses; gradients fp32, in their shard's "
                         f"shape, averaged; peak parameter bytes per rank {peaks[0]['peak']:,} without prefetch and "
                         f"{peaks[1]['peak']:,} with prefetch {adamw['prefetch']}, as predicted; with prefetch "
                         f"{flying} of {len(adamw['computes'])} unit computations began with the next all-gather in flight; the "
                         f"AdamW losses within {off:.0e} (allowed {LOSS_RTOL:.0e}) of the grader's one-process run "
                         "on the global batch.")


def grade(path: str | Path, timeout: float = 180) -> GradedRun:
    """``shard_of`` on uneven sizes in this process, then the script on 2 ranks against the grader's references."""
    problem = learner_shard_problem(path)
    if problem:
        return GradedRun(False, problem)
    found = collect(path, timeout)
    return judged(found, lambda rows: diagnose(rows, **references(path)))
