"""Instruments shared by the lesson-05 labs (``ddp_internals``, ``ddp_profile``) and ``benchmarks/buckets``.

- :class:`BucketRecorder`: a DDP communication hook that records every bucket DDP hands it (index,
  parameter names, size) before passing it on to the real hook -- so it counts all-reduces per step.
- :func:`collective_kind`: which collective a dispatched operator issues, however it was called
  (``c10d``'s operators or the functional collectives'); exercise 05's log uses it too, and so does
  lesson 13's counter (``l13_two_dimensions.two_d_harness.CollectiveCounter``), which also counts what
  DTensor issues inside its own operator handlers.
- :class:`CollectiveCounter`: sees every collective issued inside its ``with`` block -- DDP's own
  all-reduces included -- with its dtype and bytes: the traffic, measured.
- :func:`ring_bytes_sent`: what one rank sends over the network for a collective of a given payload.
- :func:`read_trace`: the spans of a ``torch.profiler`` Chrome trace that the overlap timeline draws.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# --------------------------------------------------------------------------------------------------
# what DDP does, observed

class BucketRecorder:
    """Register as DDP's communication hook; records each bucket, then runs ``inner`` on it.

    ``inner`` is any hook ``(process_group, bucket) -> Future`` (default: the plain averaging
    all-reduce, what DDP does without a hook). DDP calls the hook once per bucket, in bucket-index
    order (a bucket ready early waits for the ones before it: ``mark_bucket_ready`` in
    ``torch/csrc/distributed/c10d/reducer.cpp``), so ``len(recorder.calls_in(step))`` is the number
    of all-reduces that step.
    """

    def __init__(self, ddp, names: dict[int, str], inner=None, process_group=None, events: list | None = None):
        self.names = names  # id(parameter) -> name
        self.inner = inner or default_hooks.allreduce_hook
        self.process_group = process_group
        self.events = events  # optional shared, time-ordered event log
        self.step = 0
        self.calls: list[dict[str, Any]] = []
        ddp.register_comm_hook(self, BucketRecorder._hook)

    @staticmethod
    def _hook(self, bucket):  # no annotations: DDP compares them with the real classes
        params = [self.names.get(id(p), "?") for p in bucket.parameters()]
        call = {"step": self.step, "index": bucket.index(), "params": params, "numel": bucket.buffer().numel(),
                "bytes": bucket.buffer().numel() * bucket.buffer().element_size(), "is_last": bucket.is_last()}
        self.calls.append(call)
        if self.events is not None:
            self.events.append({"t": time.perf_counter(), "kind": "all-reduce launched", "what": f"bucket {call['index']}"})
        return self.inner(self.process_group, bucket)

    def calls_in(self, step: int) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["step"] == step]


# A collective's kind from its operator's name, by prefix: c10d's names (``allreduce_``,
# ``_allgather_base_``, ``alltoall_base_``) and the functional collectives' (``all_reduce``,
# ``all_gather_into_tensor``, ``all_to_all_single``). Other operators of these namespaces are no
# collective: ``wait_tensor``, ``_wrap_tensor_autograd``, ``barrier``, point-to-point sends...
_KINDS = {"all_gather": "all_gather", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
          "all_reduce": "all_reduce", "allreduce": "all_reduce", "broadcast": "broadcast",
          "all_to_all": "all_to_all", "alltoall": "all_to_all"}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def collective_kind(func) -> str | None:
    """The collective a dispatched operator issues ("all_reduce", "all_gather", "reduce_scatter",
    "broadcast" or "all_to_all"), or None for any other operator.

    Every collective reaches PyTorch's dispatcher as an operator, which a dispatch mode sees when it is
    issued on plain tensors: ``dist.all_reduce`` (whatever name it is called by) and DDP's C++ reducer reach
    ``c10d.allreduce_``; ``torch.distributed._functional_collectives`` (and DTensor, FSDP2's
    redistributions) reach ``_c10d_functional.all_reduce`` or ``all_reduce_``, whose result is then
    waited on with ``_c10d_functional.wait_tensor`` (not a collective: None). A mode that runs an
    operator on DTensors itself runs DTensor's handler with the mode off, so it does not see what DTensor
    issues there; lesson 13's counter hands those operators back to DTensor (``NotImplemented``) and sees
    them (its test shows the difference: ``loss_parallel``'s three all-reduces).
    """
    if func.namespace not in COLLECTIVE_NAMESPACES:
        return None
    base = func._schema.name.split("::")[-1].lstrip("_")
    return next((kind for prefix, kind in _KINDS.items() if base.startswith(prefix)), None)


# how CollectiveCounter names a functional collective: as the c10d operator that does the same
_C10D_NAMES = {"all_reduce": "allreduce", "all_gather": "allgather_base", "reduce_scatter": "reduce_scatter_base",
               "broadcast": "broadcast", "all_to_all": "alltoall_base"}


class CollectiveCounter(TorchDispatchMode):
    """Every collective issued inside ``with CollectiveCounter() as c:`` -- DDP's included.

    Collectives reach the backend through ``c10d`` operators (``c10d.allreduce_``,
    ``c10d._allgather_base_``, ``c10d.broadcast_`` ...), also when DDP's C++ reducer issues them, or
    through the functional collectives' (``_c10d_functional.all_reduce`` ..., counted under the name
    of the c10d operator that does the same); a dispatch mode sees each one with its tensors.
    ``payload_bytes`` counts the tensors a rank hands in (for an all-gather, its own input, not the
    gathered output).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors: list[torch.Tensor] = []
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].strip("_")
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if name in ("allgather_base", "allgather_into_tensor_coalesced", "reduce_scatter_base"):
                tensors = tensors[1:2]  # (output, input): the rank's payload is its input
            elif name == "allgather":
                tensors = tensors[-1:]
        elif (kind := collective_kind(func)) is not None:  # a functional collective: its positional tensors are its input
            name = _C10D_NAMES[kind]
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        if tensors:
            self.ops.append({"op": name, "dtype": str(tensors[0].dtype).replace("torch.", ""),
                             "numel": sum(t.numel() for t in tensors),
                             "bytes": sum(t.numel() * t.element_size() for t in tensors)})
        return func(*args, **kwargs)

    def summary(self, world_size: int) -> dict[str, Any]:
        counts = Counter(o["op"] for o in self.ops)
        return {"ops": dict(counts), "payload_bytes": sum(o["bytes"] for o in self.ops),
                "sent_bytes_ring": sum(ring_bytes_sent(o["op"], o["bytes"], world_size) for o in self.ops),
                "dtypes": sorted({o["dtype"] for o in self.ops})}


def ring_bytes_sent(op: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective of ``payload_bytes`` per rank, with ring algorithms.

    all-reduce: reduce-scatter then all-gather, each passing (n-1) chunks of payload/n: 2(n-1)/n x B.
    all-gather: each rank's B travels to the n-1 others, one hop at a time: (n-1) x B.
    broadcast (pipelined ring): about B.
    """
    n = world_size
    if op.startswith("allreduce"):
        return 2 * (n - 1) / n * payload_bytes
    if op.startswith("allgather"):
        return (n - 1) * payload_bytes
    return float(payload_bytes)


def record_grad_ready(model: torch.nn.Module, events: list) -> list:
    """A post-accumulate-grad hook on every parameter: logs when each gradient is final.

    ``Tensor.register_post_accumulate_grad_hook`` runs right after autograd has written ``p.grad``
    -- the moment DDP's own hook (on the same gradient accumulator) marks the parameter ready.
    """
    handles = []
    for name, p in model.named_parameters():
        def hook(param, name=name):
            events.append({"t": time.perf_counter(), "kind": "grad ready", "what": name})
        handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles


# --------------------------------------------------------------------------------------------------
# timing and traces

def time_steps(step_fn, n: int, group=None, device: torch.device | None = None) -> float:
    """Seconds per call of ``step_fn`` over ``n`` calls, the slowest rank's (all ranks must call).

    On a CUDA ``device`` the clock is read only after ``torch.cuda.synchronize``: the calls return
    as soon as their kernels are queued, and the time is that of the work, not of its queueing.
    """
    cuda = device is not None and device.type == "cuda"
    dist.barrier(group=group)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step_fn()
    if cuda:
        torch.cuda.synchronize(device)
    dt = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # a step is done when every rank is done
    return float(dt.item())


COMM_EVENTS = ("gloo:all_reduce", "nccl:all_reduce", "gloo:all_gather", "nccl:all_gather")
BACKWARD_FN = "autograd::engine::evaluate_function:"
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # where the CPU side of a kernel launch is recorded


def read_trace(path: str | Path, step_name: str = "step") -> dict[str, Any]:
    """The spans of a profiler Chrome trace that tell the overlap story, in ms from the first step.

    Returns ``steps`` (``record_function`` ranges named ``step ...``), ``phases`` (ranges named
    forward / backward / allreduce by hand / optimizer), ``functions`` (backward's autograd
    functions), ``compute`` (backward's computation), ``comm`` (the all-reduces as the backend runs
    them), ``launch`` (where each all-reduce was handed to the backend) and ``timeline``.

    A CPU trace (``timeline`` "cpu"): backward computes in its autograd functions on the main
    thread, so ``compute`` is those functions; ``comm`` is gloo's spans on its own threads.

    A trace with GPU kernels (``ProfilerActivity.CUDA``; ``timeline`` "gpu"): the autograd functions
    only *queue* kernels (and run on the autograd engine's thread for the GPU, not the main thread),
    so ``compute`` is the GPU kernels that backward's functions launched (matched to their launch
    by the trace's ``correlation`` id), with their times on the GPU, and ``comm`` is NCCL's kernels
    (gloo's CPU spans when no NCCL kernel is in the trace, without their GPU-timeline mirrors). Each
    GPU span also carries ``launched``: when the CPU queued it, which is what places it in a step (a
    step's kernels may still run after its CPU range has ended).
    """
    events = json.loads(Path(path).read_text(encoding="utf-8"))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if str(e["name"]).startswith(step_name + " ")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"{path}: no record_function range named '{step_name} ...' in the trace")
    t0 = steps[0]["ts"]
    main_tid = steps[0]["tid"]

    def ms(e, launched=None):
        out = {"name": e["name"], "start": (e["ts"] - t0) / 1e3, "end": (e["ts"] + e["dur"] - t0) / 1e3}
        if launched is not None:
            out["launched"] = (launched - t0) / 1e3
        return out

    kernels = [e for e in spans if e.get("cat") == "kernel"]
    phases = [ms(e) for e in spans if e["name"] in ("forward", "backward", "allreduce by hand", "optimizer")
              and e["tid"] == main_tid]
    if not kernels:  # the CPU computes: backward's functions run on the main thread
        functions = [e for e in spans if e["tid"] == main_tid and str(e["name"]).startswith(BACKWARD_FN)]
        compute = [ms(e) for e in functions]
        comm = [ms(e) for e in spans if e["name"] in COMM_EVENTS]
        launch = [ms(e) for e in spans if e["tid"] == main_tid and str(e["name"]).startswith("c10d::allreduce")]
        timeline = "cpu"
    else:
        functions = [e for e in spans if str(e["name"]).startswith(BACKWARD_FN)]  # on the engine's GPU thread
        by_tid: dict[Any, list[tuple[float, float]]] = {}
        for f in functions:
            by_tid.setdefault(f["tid"], []).append((f["ts"], f["ts"] + f["dur"]))
        launched_at = {e["args"]["correlation"]: e for e in spans
                       if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}

        def from_backward(k) -> bool:
            la = launched_at.get(k.get("args", {}).get("correlation"))
            return la is not None and any(a <= la["ts"] <= b for a, b in by_tid.get(la["tid"], ()))

        def launch_ts(k) -> float:
            la = launched_at.get(k.get("args", {}).get("correlation"))
            return la["ts"] if la is not None else k["ts"]

        nccl = [k for k in kernels if str(k["name"]).lower().startswith("nccl")]
        nccl_ids = {id(k) for k in nccl}
        compute = [ms(k, launch_ts(k)) for k in kernels if id(k) not in nccl_ids and from_backward(k)]
        # gloo with CUDA tensors: its CPU spans; the profiler also mirrors each of them onto the GPU
        # timeline (category gpu_user_annotation), which is the same all-reduce, not a second one
        comm = ([ms(k, launch_ts(k)) for k in nccl] if nccl else
                [ms(e) for e in spans if e["name"] in COMM_EVENTS and e.get("cat") != "gpu_user_annotation"])
        launch = [ms(e) for e in spans if str(e["name"]).startswith("c10d::allreduce")]
        timeline = "gpu"
    return {"steps": [ms(e) for e in steps], "phases": sorted(phases, key=lambda s: s["start"]),
            "functions": sorted((ms(e) for e in functions), key=lambda s: s["start"]),
            "compute": sorted(compute, key=lambda s: s["start"]), "comm": sorted(comm, key=lambda s: s["start"]),
            "launch": sorted(launch, key=lambda s: s["start"]), "timeline": timeline}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap_stats(trace: dict[str, Any]) -> dict[str, float]:
    """Per step (averaged over the trace's steps), in ms: how long at least one all-reduce was in
    flight, how much of that fell while backward was still computing, and how much came after.

    Backward *compute* ends with the last of its computation (on a CPU: the last autograd function;
    on a GPU: the last kernel backward launched); all-reduce time after that point is exposed: the
    step waits for it. Several all-reduces can be in flight at once (the backend has more than one
    thread, or stream), so times are of the union of their spans, not the sum.
    ``launched_during_backward`` counts the all-reduces handed to the backend before backward's
    last autograd function started (0 when there is no overlap); it uses the launch, not the
    backend's start, which a busy machine can delay. A span belongs to the step in which it was
    launched (on a CPU: in which it started).
    """
    def placed(c):
        return c.get("launched", c["start"])

    out = []
    for step in trace["steps"]:
        inside = [c for c in trace["compute"] if step["start"] <= placed(c) < step["end"]]
        comm = [c for c in trace["comm"] if step["start"] <= placed(c) < step["end"]]
        functions = [c for c in trace.get("functions", trace["compute"]) if step["start"] <= c["start"] < step["end"]]
        if not inside or not functions:
            continue
        bwd_start = min(c["start"] for c in inside)
        bwd_end = max(c["end"] for c in inside)
        busy = _union([(c["start"], c["end"]) for c in comm])
        in_flight = sum(b - a for a, b in busy)
        hidden = sum(max(0.0, min(b, bwd_end) - max(a, bwd_start)) for a, b in busy)
        exposed = sum(max(0.0, b - max(a, bwd_end)) for a, b in busy)
        last_fn_start = max(c["start"] for c in functions)
        launches = [c for c in trace["launch"] if step["start"] <= c["start"] < step["end"]]
        step_end = step["end"]
        if trace.get("timeline") == "gpu":  # the CPU range ends once the kernels are queued; the step, with the last
            step_end = max([step_end, *(c["end"] for c in inside + comm)])
        out.append({"launched_during_backward": sum(c["start"] < last_fn_start for c in launches),
                    "step_ms": step_end - step["start"], "backward_compute_ms": bwd_end - bwd_start,
                    "allreduce_in_flight_ms": in_flight, "allreduce_during_backward_ms": hidden,
                    "allreduce_after_backward_ms": exposed, "n_allreduce": len(comm)})
    if not out:
        raise ValueError("no step of the trace holds backward functions")
    return {k: sum(o[k] for o in out) / len(out) for k in out[0]}
