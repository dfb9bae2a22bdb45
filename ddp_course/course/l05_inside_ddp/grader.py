"""Grader of exercise 05 (``lessons/exercises/05_my_ddp.py``): a minimal DDP built by hand.

The script runs for real with torchrun on 2 processes. Its harness trains the learner's ``MyDDP``
beside ``torch.nn.parallel.DistributedDataParallel`` (same initial weights, same batches, one
micro-batch under ``no_sync`` then one synced per optimizer step) and reports, per rank: the bucket
layout the learner built, every all-reduce the learner's code issued, however it called it (seen
where every collective reaches PyTorch's dispatcher, ``c10d.allreduce_`` for ``dist.all_reduce`` and
``_c10d_functional.all_reduce`` for the functional collectives: in which phase, the ``no_sync``
backward, the synced backward, or after it; asynchronous or not; how many gradients were final at
that moment; when it was first waited on; and at how many of the log's checks, made as each
gradient's hooks start and end, it was still in flight), the gradients and weights against torch's
DDP, the bytes both sent and their step times.

The grader computes its own expectations: the bucket layout from MiniGPT's parameter sizes and the
cap (a model it builds itself, bucketed here with the rule the exercise states), and torch's DDP as
the reference of the weights. It checks, in the order in which one mistake would hide the next:
the replicas start equal (rank 0's weights broadcast), the layout (reverse order, the cap), no
all-reduce under ``no_sync``, every all-reduce launched from the hooks during backward,
asynchronously and not waited on before backward has computed every gradient (by a wait the log
sees, or by any other: then every all-reduce had completed before backward went on from its hook),
the first while backward still had gradients to compute, one per bucket per step, and the weights
equal to torch's DDP within ``PARAM_ATOL``. Each failure names the mistake.

The verdict carries the RESULT records of the run (``verdict.records``): the notebook puts the
learner's DDP beside torch's from the same job (``comparison``).
"""

from __future__ import annotations

from pathlib import Path

from ddp_course.check import GradedRun, Verdict, graded_records, run_exercise

EXERCISE = "05_my_ddp.py"
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): the lines that
# build the buckets last parameter first, bind each bucket to its hook, and average the flat bucket.
GIVEAWAYS = ("for p in reversed(params)", "bucket=bucket: on_grad_ready", "bucket.flat /= ddp.world_size")
NPROC = 2
# The exercise's settings (its harness is compared with the shipped copy before grading, so these
# are what it runs; the RESULT lines repeat them and a mismatch is reported).
SEED = 0
SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
BUCKET_CAP_MB = 0.1
STEPS = 3

# Largest |learner's parameter - torch DDP's parameter| accepted after the STEPS optimizer steps.
# Both models run the same kernels on the same data on each rank, so they differ only in how the
# gradients are averaged: torch's reducer divides each gradient by 2 while copying it into its bucket
# and sums, the solution sums and then divides; on 2 ranks both are exact in float32 (a division by
# 2 only changes the exponent), and the solution was measured to end with exactly torch's weights
# (0.0) -- the passing verdict prints the measured value. The mistakes move the weights far more
# (measured after the 3 steps): gradients not divided by the world size (2x torch's) 2.5e-2, no_sync
# ignored (the no_sync backward's all-reduces replace the accumulated gradients) 2.3e-2, no initial
# broadcast 2.6e-2 on rank 0 and 1.2e-1 on rank 1. 1e-6 leaves room for an averaging written another
# way (multiplying by 1/2, dividing before the sum: also exact) and sits four orders of magnitude
# below the closest mistake.
PARAM_ATOL = 1e-6
INIT_ATOL = 0.0  # a broadcast copies the bytes: the replicas start bit-for-bit equal to rank 0's


def expected_buckets(names_sizes: list[tuple[str, int]], cap_bytes: int) -> list[list[str]]:
    """The exercise's rule, computed here: from the last parameter to the first, a bucket takes the
    next parameter as long as its bytes stay within ``cap_bytes`` (a parameter alone may exceed it)."""
    out: list[list[str]] = [[]]
    filled = 0
    for name, nbytes in reversed(names_sizes):
        if out[-1] and filled + nbytes > cap_bytes:
            out.append([])
            filled = 0
        out[-1].append(name)
        filled += nbytes
    return out


def model_parameters() -> list[tuple[str, int]]:
    """(name, bytes) of the exercise's MiniGPT parameters, in ``parameters()`` order (a tied weight once)."""
    from ddp_course.course.tiny import tiny_model

    model = tiny_model(SEED, **SHAPE)
    return [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]


def _hint(output: str) -> str:
    """A likely cause for a job that did not finish, from its output."""
    if "has no attribute 'wait'" in output:
        return (" A bucket had no handle to wait on: either its all-reduce was never launched (its last gradient "
                "was not counted, or the counts were not reset after the previous step) or it was launched "
                "without async_op=True, which returns None instead of a handle.")
    if "did not finish within" in output or "Timed out" in output or "timeout" in output.lower():
        return (" A rank waited for a collective the other never issued: every rank must build the same buckets "
                "and launch each one exactly once per synced backward, in the same order.")
    return ""


def _layout_problem(built: list[list[str]], params: list[tuple[str, int]], cap_bytes: int) -> str | None:
    """What is wrong with the learner's buckets, or None when they are the expected ones."""
    want = expected_buckets(params, cap_bytes)
    if built == want:
        return None
    names = [n for n, _ in params]
    flat = [n for b in built for n in b]
    missing = [n for n in names if n not in flat]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    cap = f"{BUCKET_CAP_MB} MB ({cap_bytes:,} bytes)"
    if missing or twice:
        return ("your buckets must hold every parameter exactly once; "
                + (f"missing: {missing[:3]}" if missing else f"more than once: {twice[:3]}")
                + ". build_buckets receives the parameters in order; put each in one bucket.")
    if len(built) == len(names) and len(want) < len(names):
        return (f"you built one bucket per parameter ({len(built)} all-reduces per step); with a cap of {cap} the "
                f"{len(names)} gradients fit in {len(want)} buckets. Each all-reduce pays a fixed cost (a message, "
                "a hand-off to the backend): keep adding parameters to the current bucket until the next one would "
                "pass the cap.")
    if built == expected_buckets(params[::-1], cap_bytes) or (built and names[0] in built[0]):
        return (f"your buckets are in forward order: bucket 0 holds {built[0][:2]}..., the first layers, whose "
                "gradients backward computes LAST, so bucket 0 is ready only at the very end and its all-reduce cannot "
                "overlap backward. Walk the parameters from the last to the first (bucket 0 then holds "
                f"{want[0][:2]}..., the first gradients backward produces).")
    if len(built) != len(want):
        return (f"with a cap of {cap} the parameters (last to first) fill {len(want)} buckets; you built "
                f"{len(built)}. A bucket takes the next parameter only if its bytes (numel x element_size) keep "
                "the bucket within the cap; the first parameter of a new bucket always goes in.")
    i = next(k for k, (a, b) in enumerate(zip(built, want)) if a != b)
    return (f"bucket {i} holds {built[i]}, expected {want[i]} (parameters from the last to the first, each bucket "
            f"within {cap}).")


def _waited_in_backward(call: dict, n_grads: int) -> bool:
    """True for an all-reduce whose handle was waited on while backward still had gradients to compute.

    A wait once every gradient is final (the last bucket's, or one in a callback at the very end of
    backward, where torch's DDP waits) holds nothing up; one before that stops backward for the network.
    """
    waited = call.get("waited")
    return waited is not None and waited["phase"] == "backward" and waited["ready"] < n_grads


def _held_in_backward(found: list[dict], n_grads: int) -> list[dict]:
    """The all-reduces launched while backward still had gradients to compute, when every one of them
    had completed before backward went on from where it was launched (the log saw none in flight);
    else [].

    That is a hook that waits for its all-reduce, whatever it waits through (``work.wait()``, a
    future's ``wait``, ``torch.futures.wait_all``, ``wait_tensor``, a loop on ``is_completed``). An
    all-reduce left running is still in flight at the log's next check, microseconds after its launch,
    on the rank that reached it first (it cannot finish before the other rank has sent); the rank that
    came second may find it done already, so a few complete that soon prove nothing, and only all of
    them, on every rank and step, count as waited for.
    """
    launched = [c for r in found for s in r["steps"] for c in s["calls"] if c["phase"] == "backward" and c["ready"] < n_grads]
    return launched if launched and all(c["in_flight"] == 0 for c in launched) else []


def _calls_problem(found: list[dict], n_buckets: int, model_bytes: int) -> str | None:
    """What is wrong with the all-reduces the learner's code issued, or None."""
    r = found[0]
    steps = r["steps"]
    during_no_sync = [sum(c["phase"] == "no_sync backward" for c in s["calls"]) for s in steps]
    if any(during_no_sync):
        return (f"your code issued all-reduces during the backward under no_sync() ({during_no_sync} in the "
                f"{len(steps)} optimizer steps): no_sync must stop all communication, so that the gradients accumulate locally "
                "and the next synced backward reduces their sum. Set the flag off inside the with block (and on "
                "again after it), and have on_grad_ready return at once while it is off.")
    after = [sum(c["phase"] == "after backward" for c in s["calls"]) for s in steps]
    if any(after):
        return (f"{after[0]} all-reduce(s) per step were issued after loss.backward() had returned, so none of them "
                "overlaps backward: the network waits for the whole backward, then backward's caller waits for "
                "the network. Launch each bucket's all-reduce from the hook (on_grad_ready) the moment its last "
                "gradient is ready; finish_reduction only waits on the handles.")
    blocking = sum(not c["async"] for s in steps for c in s["calls"])
    if blocking:
        return (f"{blocking} all-reduce(s) were synchronous (async_op=False): backward stops in the hook until the "
                "bucket has crossed the network, so nothing overlaps. Pass async_op=True, keep the handle in "
                "bucket.work and wait on it in finish_reduction.")
    n_grads = r["n_grads"]
    early = [[c for c in s["calls"] if _waited_in_backward(c, n_grads)] for s in steps]
    if any(early):
        first = next(c for cs in early for c in cs)
        return (f"{[len(cs) for cs in early]} all-reduce(s) per step were waited on inside backward, in the hook, "
                f"while backward still had gradients to compute (the first with {first['waited']['ready']} of "
                f"{n_grads} gradients final): each was launched asynchronously and then waited on at once, so "
                "backward stops at every bucket until it has crossed the network, and nothing overlaps -- a "
                "synchronous all-reduce in all but name. Keep the handle in bucket.work and wait on it in "
                "finish_reduction, which runs once backward has returned (as finish_gradient_sync).")
    held = _held_in_backward(found, n_grads)
    if held:
        return (f"all {len(held)} all-reduces launched while backward still had gradients to compute (over the "
                f"{len(found)} ranks and {len(steps)} steps) had completed before backward went on from the hook that "
                "launched them: the hook waits for each one (a wait on the handle or on its future, "
                "torch.futures.wait_all, wait_tensor or an in-place functional all-reduce all do), so backward "
                "stops at every bucket until it has crossed the network, and nothing overlaps -- a synchronous "
                "all-reduce in all but name. Launch it and return: keep the handle (or the functional all-reduce's "
                "result) in the bucket and wait on it in finish_reduction, which runs once backward has returned "
                "(as finish_gradient_sync).")
    counts = [len(s["calls"]) for s in steps]
    if any(c != n_buckets for c in counts):
        return (f"you built {n_buckets} buckets but your code issued {counts} all-reduces in the synced backward "
                "of the steps: exactly one per bucket per synced backward (reset each bucket's count after "
                "the step, so that the next backward launches it again).")
    sent = [sum(c["bytes"] for c in s["calls"]) for s in steps]
    if any(b != model_bytes for b in sent):
        return (f"your all-reduces carried {sent} bytes per step; the gradients are {model_bytes:,} bytes: each "
                "bucket's all-reduce carries exactly its parameters' gradients, flattened.")
    if steps and steps[0]["calls"] and all(c["ready"] == n_grads for s in steps for c in s["calls"]):
        return (f"every all-reduce was launched when all {n_grads} gradients were already final (at the end of "
                "backward), so none overlaps backward's computation. Launch a bucket when ITS last gradient is ready, "
                "not when the last gradient of the model is.")
    return None


def _weights_problem(found: list[dict]) -> str | None:
    """What is wrong with the gradients and weights against torch's DDP, or None."""
    worst = max(found, key=lambda r: r["steps"][-1]["param_diff"])
    diff = worst["steps"][-1]["param_diff"]
    if diff <= PARAM_ATOL:
        return None
    first = worst["steps"][0]
    ratio = first["grad_norm_ratio"]
    measured = (f"after {len(worst['steps'])} steps your weights differ from torch's DDP by up to {diff:.1e} on rank "
                f"{worst['rank']} (tolerance {PARAM_ATOL:.0e})")
    if abs(ratio - NPROC) < 1e-3:
        return (f"{measured}: your averaged gradients are {ratio:.2f} times torch's at step 0: the all-reduce sums "
                f"over the {NPROC} ranks and the sum was not divided by the world size. Divide each bucket by "
                "ddp.world_size before copying it back.")
    return (f"{measured}; at step 0 your gradients differ from torch's by up to {first['grad_diff']:.1e} (norm ratio "
            f"{ratio:.3f}). Check that finish_reduction copies each parameter's slice of the averaged bucket back "
            "into its own p.grad (same order as the flattening), and that the no_sync step's gradients are "
            "accumulated, not replaced.")


def diagnose(found: list[dict]) -> GradedRun:
    """The verdict on the RESULT records of one run (one per rank)."""
    def fail(message: str) -> GradedRun:
        return GradedRun(False, message, found)

    if sorted(r.get("rank", -1) for r in found) != list(range(NPROC)):
        return fail(f"the ranks reported {[r.get('rank') for r in found]}; expected 0..{NPROC - 1}.")
    cfg = found[0].get("config", {})
    if (cfg.get("shape"), cfg.get("bucket_cap_mb"), cfg.get("steps"), cfg.get("seed")) != (SHAPE, BUCKET_CAP_MB, STEPS, SEED):
        return fail(f"the script ran with other settings than the exercise's ({cfg}); restore SHAPE, BUCKET_CAP_MB, "
                    "STEPS and SEED from lessons/exercises/05_my_ddp.py.")
    found = sorted(found, key=lambda r: r["rank"])
    unequal = [r["rank"] for r in found if r["init_diff"] > INIT_ATOL]
    if unequal:
        worst = max(r["init_diff"] for r in found)
        return fail(f"after wrapping, rank(s) {unequal} still hold their own initial weights (up to {worst:.1e} from "
                    "rank 0's): this script initialises every rank differently, and without a broadcast the replicas "
                    "train different models. broadcast_parameters must copy rank 0's parameters to every rank "
                    "(dist.broadcast from rank 0, in place, under torch.no_grad()).")
    if any(r["buckets"] != found[0]["buckets"] for r in found):
        return fail("the ranks built different buckets: every rank must build the same layout (the same parameters "
                    "in the same order), or their all-reduces do not match.")
    params = model_parameters()
    cap_bytes = int(BUCKET_CAP_MB * 2**20)
    problem = _layout_problem(found[0]["buckets"], params, cap_bytes)
    if problem:
        return fail(problem)
    n_buckets = len(found[0]["buckets"])
    problem = _calls_problem(found, n_buckets, sum(b for _, b in params))
    if problem:
        return fail(problem)
    problem = _weights_problem(found)
    if problem:
        return fail(problem)
    diff = max(r["steps"][-1]["param_diff"] for r in found)
    first = found[0]["steps"][0]["calls"][0]
    return GradedRun(True, f"your DDP trains like torch's: max |param - DDP param| {diff:.1e} after {STEPS} steps "
                           f"(tolerance {PARAM_ATOL:.0e}); {n_buckets} buckets within {BUCKET_CAP_MB} MB, as the cap "
                           f"gives, one asynchronous all-reduce each per step, all launched during backward (the "
                           f"first with {first['ready']} of {found[0]['n_grads']} gradients ready), none under no_sync.",
                     found)


def grade(path: str | Path, timeout: float = 180.0) -> GradedRun:
    found = run_exercise(path, NPROC, "a function of the exercise", timeout, hint=_hint)
    if isinstance(found, Verdict):
        return GradedRun(found.ok, found.message)
    return diagnose(found)


def comparison(verdict: Verdict | list[dict]) -> dict[str, dict]:
    """The learner's DDP beside torch's, from one graded run (its verdict, or its records): all-reduces
    and payload bytes per step (counted at the c10d operators), and the milliseconds per training step
    of every timing round (each the slowest rank's, so rank 0's record holds them)."""
    records = verdict if isinstance(verdict, list) and verdict else graded_records(verdict, "run of your DDP to compare")
    r = min(records, key=lambda x: x["rank"])
    return {name: {"all_reduces_per_step": r["traffic"][name]["ops"].get("allreduce", 0),
                   "payload_bytes_per_step": r["traffic"][name]["payload_bytes"],
                   "sent_bytes_ring": r["traffic"][name]["sent_bytes_ring"],
                   "step_ms": r["step_ms"][name]}
            for name in ("mine", "torch")}
