"""Pipeline schedules side by side: GPipe and 1F1B by hand, PyTorch's schedules, each measured.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.schedules_lab --out_dir=runs/schedules

The same MiniGPT is cut into stages (``pp_lab.Stage``) and trained one step by each schedule of
``--schedules``, from the same weights on the same batch of ``--micro_batches`` micro-batches:

- ``gpipe`` and ``1f1b``, **by hand** (``hand_step``): a schedule is nothing but each rank's order of
  forwards (F) and backwards (B), ``gpipe_order`` and ``one_f_one_b_order``; the sends and receives
  follow from it. 1F1B's order on the rank of stage s: p - 1 - s forwards (warm-up), then one forward
  and one backward in turn (steady phase), then the backwards left (cool-down).
- ``lib_1f1b``, ``interleaved_1f1b``, ``interleaved_zb``, ``zbv`` and ``dualpipev``: PyTorch's
  ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (``torch.distributed.pipelining``). The last
  four hold ``--stages_per_rank`` (v) stages on each rank: round-robin (rank r: stages r, r + p, ...)
  for the interleaved ones, a V for the last two (rank r: stages r and 2p - 1 - r, so rank 0 holds the
  first and the last). The zero-bubble schedules split a backward into the input's gradient (I, which
  the stage before waits for) and the weights' (W, which nobody waits for and fills the bubble).

For every schedule, on every rank:

- **parity**: the loss and every stage's gradients against one process computing the whole batch;
- **activations held**: the micro-batches whose graph a stage holds at once (``in_flight``: a forward
  opens one, its backward, or its W when the backward is split, closes it); and for the schedules
  written here, the bytes autograd keeps for backward (``SavedBytes``: every tensor a forward saves,
  counted until autograd lets it go, parameters excluded), after every slot and at their peak, in
  units of one micro-batch's (measured the same way);
- **time**: each forward, backward, I and W, timed alone (``Recorder``); after one untimed step,
  ``--repeats`` timed steps. Three idle fractions, each the mean over the ranks: the *measured* one,
  1 - busy / wall from a common barrier (it counts the transfers and everything between the slots,
  and means something only when each rank has a core of its own: the first line says how many cores
  there are); the *replayed* one (``replay``): each rank's order of slots, each lasting the shortest
  duration of its kind on its stage over every schedule's run (``pooled_durations``: the one least
  disturbed by another rank on the same core, one table for all the schedules), laid out with only
  the waits the data imposes, what the order costs on a machine with a core per rank and free
  transfers; and the same replay with *equal stages* (every slot of a kind lasting the kind's mean),
  the assumption of the textbook formulas (``bubble_formula``);
- **the timeline** of the median repeat, for the lesson's figure.

Rank 0 writes ``schedules_lab.json`` into ``--out_dir``. Every step runs under the process group's
timeout (``--timeout_s``): a schedule that hangs fails the job with each rank's line, it is never
waited on for ever. Options are ``--key=value`` (``--help`` lists them).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l11_beyond_data_parallel.held import SavedBytes
from ddp_course.course.l11_beyond_data_parallel.pp_lab import (
    TIED,
    Stage,
    batches,
    build_model,
    isend,
    lm_loss,
    recv,
    rel,
    stage_bounds,
)
from ddp_course.course.options import lab_help, require_device, write_result
from ddp_course.data import CharTokenizer, load_corpus
from ddp_course.dist import log, setup
from ddp_course.metrics import environment, load_average

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l11_beyond_data_parallel.schedules_lab"

# name: (PyTorch's class or None for by hand, stage placement, what it is)
SCHEDULES: dict[str, tuple[str | None, str, str]] = {
    "gpipe": (None, "one", "by hand: every forward, then every backward"),
    "1f1b": (None, "one", "by hand: warm-up forwards, one forward one backward, cool-down backwards"),
    "lib_1f1b": ("Schedule1F1B", "one", "PyTorch's 1F1B"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", "PyTorch's interleaved 1F1B, v stages per rank"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop", "PyTorch's interleaved zero bubble: B split into I and W"),
    "zbv": ("ScheduleZBVZeroBubble", "v", "PyTorch's zero bubble with V-shaped placement"),
    "dualpipev": ("ScheduleDualPipeV", "v", "PyTorch's DualPipeV (V-shaped placement)"),
}

# The V placement puts two adjacent stages on one rank (p - 1 and p). PyTorch 2.10.0 sets a schedule's
# stages up with a message from every stage to the next, that pair included (``_initialize_stages`` in
# torch/distributed/pipelining/schedules.py, ``_get_init_p2p_neighbors_ops`` in stage.py), and gloo
# cannot send to its own rank: the first step fails on that rank with "Pair is not connected" while the
# others wait for it. 2.13.0 runs both V schedules on gloo (measured); 2.11 and 2.12 were not tried, nor
# NCCL on 2.10 (a send to one's own rank is not what NCCL's point-to-point is for either), so below 2.13
# the lab leaves them out and says why.
V_PLACEMENT_SINCE = (2, 13)


def not_run_reason(name: str, version: str | None = None) -> str | None:
    """Why the schedule ``name`` is left out with this PyTorch (None when it runs): the V placement before 2.13."""
    major, minor = (int(x) for x in (version or torch.__version__).split(".")[:2])
    if SCHEDULES[name][1] == "v" and (major, minor) < V_PLACEMENT_SINCE:
        return (f"left out: PyTorch {major}.{minor} sets up a V-placed schedule by sending from a stage to the next "
                f"on the same rank, which gloo cannot do; it runs from PyTorch "
                f"{'.'.join(map(str, V_PLACEMENT_SINCE))} on")
    return None


# Parity tolerance: the pipeline computes the whole batch's loss and gradients as sums over
# micro-batches in another order than one process does, and adds the tied matrix's two parts with an
# all-reduce; pp_lab measures ~1e-7 relative for the same sums. 1e-5 leaves two decades of room and
# sits far below any real mistake (a loss not divided by m is off by a factor m).
GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5

DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/schedules",
    "n_layer": 4,  # at least p * v: every stage gets a block
    "n_head": 2,
    "n_embd": 64,
    "block_size": 32,
    "batch_size": 16,
    "micro_batches": 8,
    "stages_per_rank": 2,
    "schedules": ",".join(SCHEDULES),
    "repeats": 3,
    "corpus": "tinyshakespeare",
    "seed": 0,
    "timeout_s": 60.0,
    "device": "cpu",
}

HELP = lab_help("schedules_lab", DEFAULTS,
                n_layer="transformer blocks, at least ranks x stages_per_rank",
                batch_size="sequences of the step's batch, divisible by micro_batches",
                micro_batches="micro-batches per step (m), at least the number of ranks",
                stages_per_rank="stages on each rank (v) for the interleaved and V schedules",
                schedules=f"comma-separated, from {','.join(SCHEDULES)}",
                repeats="timed steps per schedule, after one untimed step",
                seed="model init and the batch",
                device="cpu (the lab's timings are of CPU ranks) | auto | cuda")


# --------------------------------------------------------------------------------------------------
# what a step is measured with

class Recorder:
    """Every compute slot of a step, ``(kind, stage, micro-batch, start, end)`` in seconds after
    ``clock``; the stage being computed is told to ``saved`` so that its tensors are counted there."""

    def __init__(self, saved: SavedBytes) -> None:
        self.saved, self.clock, self.slots = saved, 0.0, []
        self.held: list[tuple[int, float, int]] = []  # (stage, end of a slot, bytes the stage holds then)

    def start(self) -> None:
        self.clock, self.slots, self.held = time.perf_counter(), [], []

    @contextmanager
    def slot(self, kind: str, stage: int, chunk: int) -> Iterator[None]:
        self.saved.stage = stage
        t0 = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter() - self.clock
            self.slots.append((kind, stage, chunk, t0 - self.clock, end))
            self.held.append((stage, end, self.saved.live.get(stage, 0)))
            self.saved.stage = -1


# --------------------------------------------------------------------------------------------------
# by hand: a schedule is each rank's order of forwards and backwards

def gpipe_order(m: int, p: int, rank: int) -> list[str]:
    """GPipe on every rank: all m forwards, then all m backwards."""
    return ["F"] * m + ["B"] * m


def one_f_one_b_order(m: int, p: int, rank: int) -> list[str]:
    """1F1B on the rank of stage ``rank`` of ``p``: p - 1 - rank forwards to fill the pipeline (never more
    than m), then one forward and one backward in turn, then the backwards still owed."""
    warmup = min(p - 1 - rank, m)
    return ["F"] * warmup + ["F", "B"] * (m - warmup) + ["B"] * warmup


def hand_step(stage: Stage, x: torch.Tensor, y: torch.Tensor, m: int, order: list[str], *,
              act_shape: tuple[int, ...], rec: Recorder, peers: tuple[int, int] | None = None) -> float | None:
    """One forward-and-backward of the micro-batches of ``x``/``y`` on this rank's ``stage``, in ``order``.

    The i-th "F" is micro-batch i's forward: its input comes from the stage before (``recv``, blocking),
    its output goes to the stage after (``isend``). The i-th "B" is micro-batch i's backward: the
    gradient of its output comes from the stage after, the gradient of its input goes to the stage
    before. The micro-batch's graph is dropped right after its backward. Returns the loss of the
    whole batch on the last stage (micro-batch losses are divided by m), None elsewhere.

    ``peers``: the ranks of the stages before and after this one (default: this rank - 1 and + 1; on a
    mesh with more dimensions than the pipeline's, lesson 13's three-dimensional lab passes its own)."""
    device = x.device
    prev, nxt = peers if peers is not None else (dist.get_rank() - 1, dist.get_rank() + 1)
    xs, ys = x.chunk(m), y.chunk(m)
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output) until its B
    sends: list = []
    loss = torch.zeros((), device=device)
    f = b = 0
    for op in order:
        if op == "F":
            inp = xs[f]
            if not stage.first:
                inp = torch.empty((xs[f].shape[0], *act_shape), device=device)
                recv(inp, prev)
                inp.requires_grad_(True)
            with rec.slot("F", stage.index, f):
                out = stage(inp, ys[f]) / m if stage.last else stage(inp)
            if stage.last:
                loss += out.detach()
            else:
                sends.append(isend(out.detach(), nxt))
            held[f] = (inp, out)
            f += 1
        else:
            inp, out = held.pop(b)
            if stage.last:
                with rec.slot("B", stage.index, b):
                    out.backward()
            else:
                grad = torch.empty_like(out)
                recv(grad, nxt)
                with rec.slot("B", stage.index, b):
                    out.backward(grad)
            if not stage.first:
                sends.append(isend(inp.grad, prev))
            del inp, out
            b += 1
    for work, _ in sends:
        work.wait()
    return loss.item() if stage.last else None


# --------------------------------------------------------------------------------------------------
# PyTorch's schedules

def timed_stage_class():
    """``PipelineStage`` with each compute slot timed by the recorder: ``forward_one_chunk`` (F),
    ``backward_one_chunk`` (B, or I when the schedule asks for the input's gradient only) and
    ``backward_weight_one_chunk`` (W). The schedule receives before and sends after these calls."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        recorder: Recorder

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self.recorder.slot("F", self.stage_index, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with self.recorder.slot("B" if full_backward else "I", self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                  last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with self.recorder.slot("W", self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    return TimedStage


def library_step(name: str, stages: list[Stage], info, n_stages: int, m: int, rec: Recorder
                 ) -> Callable[[torch.Tensor, torch.Tensor], float | None]:
    """``(x, y) -> loss`` through PyTorch's schedule ``name`` over this rank's ``stages``. Each micro-batch's
    loss is divided by m and the gradients are left unscaled (``scale_grads=False``), as by hand."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[name][0])
    stage_cls = timed_stage_class()
    wrapped = []
    for s in stages:
        w = stage_cls(s, s.index, n_stages, info.device)
        w.recorder = rec
        wrapped.append(w)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) / m

    schedule = cls(wrapped[0] if len(wrapped) == 1 else wrapped, m, loss_fn=loss_fn, scale_grads=False)
    has_first, has_last = any(s.first for s in stages), any(s.last for s in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        kwargs = {"target": y, "losses": losses} if has_last else {}
        schedule.step(*args, **kwargs)
        return float(sum(loss.item() for loss in losses)) if has_last else None

    return step


# --------------------------------------------------------------------------------------------------
# placement, the tied matrix, one schedule's run

def placement(kind: str, p: int, v: int, rank: int) -> list[int]:
    """The stages this rank holds: ``one`` (stage = rank), ``loop`` (r, r + p, ...: round robin) or ``v``
    (r and 2p - 1 - r: down the ranks and back up, so that rank 0 holds the first and the last)."""
    if kind == "one":
        return [rank]
    if kind == "loop":
        return [rank + k * p for k in range(v)]
    return [rank, 2 * p - 1 - rank]


def owner(stage: int, kind: str, p: int, v: int) -> int:
    return next(r for r in range(p) if stage in placement(kind, p, v, r))


class TiedSum:
    """The tied matrix's gradient summed over its two copies when the first and the last stage are on
    two ranks (an all-reduce between them, as pp_lab's ``sync_tied``). On one rank (the V placement)
    both stages are built from one model and share the matrix: autograd adds the two parts itself."""

    def __init__(self, kind: str, p: int, v: int, n_stages: int, groups: dict) -> None:
        self.ends = sorted({owner(0, kind, p, v), owner(n_stages - 1, kind, p, v)})
        self.group = None if len(self.ends) < 2 else groups[tuple(self.ends)]

    def __call__(self, params: dict[str, nn.Parameter]) -> None:
        if len(self.ends) == 2 and dist.get_rank() in self.ends:
            dist.all_reduce(params[TIED].grad, group=self.group)


def run_schedule(name: str, opts: dict[str, Any], vocab: int, data: tuple[torch.Tensor, torch.Tensor], info,
                 groups: dict, ref: dict[str, Any]) -> dict[str, Any]:
    """One schedule on this rank: parity, activations held, the timed repeats."""
    p, m = info.world_size, opts["micro_batches"]
    lib_class, kind, _ = SCHEDULES[name]
    v = 1 if kind == "one" else opts["stages_per_rank"] if kind == "loop" else 2
    n_stages = p * v
    model = build_model(opts, vocab, info.device)
    names = {id(q): n for n, q in model.named_parameters()}
    stages = [Stage(model, s, n_stages) for s in placement(kind, p, v, info.rank)]
    params = {names[id(q)]: q for s in stages for q in s.parameters()}
    saved = SavedBytes({q.untyped_storage().data_ptr() for q in model.parameters()})
    rec = Recorder(saved)
    tied = TiedSum(kind, p, v, n_stages, groups)
    x, y = data
    if lib_class is None:
        order = (gpipe_order if name == "gpipe" else one_f_one_b_order)(m, p, info.rank)
        shape = (opts["block_size"], opts["n_embd"])

        def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
            return hand_step(stages[0], x, y, m, order, act_shape=shape, rec=rec)
    else:
        step = library_step(name, stages, info, n_stages, m, rec)

    # parity (and the step that sets the schedules' buffers up)
    with saved.hooks():
        rec.start()
        loss = step(x, y)
    tied(params)
    grad_err = rel([q.grad for q in params.values()], [ref["grads"][n] for n in params])
    per_stage_err = {s.index: rel([q.grad for q in s.parameters()],
                                  [ref["grads"][names[id(q)]] for q in s.parameters()]) for s in stages}
    for q in params.values():
        q.grad = None
    # one micro-batch's activations per stage: the forward of micro-batch 0 alone, counted the same way
    one = {}
    with saved.hooks():
        for s in stages:
            saved.stage, inp = s.index, x.chunk(m)[0]
            if not s.first:
                inp = torch.zeros((inp.shape[0], opts["block_size"], opts["n_embd"]), device=info.device,
                                  requires_grad=True)
            before = saved.live.get(s.index, 0)
            out = s(inp, y.chunk(m)[0]) if s.last else s(inp)
            one[s.index] = saved.live[s.index] - before
            del out, inp  # the graph and what it saved go with its output
            saved.stage = -1
    for q in params.values():
        q.grad = None
    # timed repeats; the bytes held are counted in the steps written here. Under PyTorch's zero-bubble
    # schedules the counter's wrappers on the last stage outlive the step (a part of each micro-batch's
    # saved tensors, every step: the counter itself keeps them, as the same schedules without it hold
    # no more memory after hundreds of steps), so for PyTorch's schedules the lab counts the
    # micro-batches in flight from the slots instead (``in_flight``)
    reps = []
    counting = saved.hooks if lib_class is None else nullcontext
    for _ in range(opts["repeats"]):
        saved.reset_peak()
        dist.barrier()
        with counting():
            rec.start()
            step(x, y)
            end = time.perf_counter() - rec.clock
        for q in params.values():
            q.grad = None
        reps.append({"clock": rec.clock, "end": end, "slots": list(rec.slots), "held": list(rec.held),
                     "peak": {s.index: saved.peak.get(s.index, 0) for s in stages} if lib_class is None else None})
    return {"loss": loss, "grad_rel_err": grad_err, "grad_rel_err_per_stage": per_stage_err,
            "one_micro_batch_bytes": one, "repeats": reps, "stages": [s.index for s in stages], "v": v,
            "placement": kind}


# --------------------------------------------------------------------------------------------------
# formulas and the replay

def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of GPipe and 1F1B (v = 1) and of interleaved 1F1B with v stages per rank, equal
    stages: (p - 1) / (v m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def replay(orders: list[list[tuple[str, int, int, float]]], n_stages: int) -> dict[str, Any]:
    """Lay each rank's slots ``(kind, stage, micro-batch, seconds)`` out in their order, each starting when
    its rank is free and its data has arrived: F(s, i) after F(s - 1, i); B or I(s, i) after F(s, i)
    and after B or I(s + 1, i); W(s, i) after I(s, i). Transfers take no time. Returns the makespan,
    each rank's idle fraction and the laid-out slots; an order that would wait for ever raises."""
    done: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * len(orders), [0.0] * len(orders)
    laid: list[list[tuple[str, int, int, float, float]]] = [[] for _ in orders]

    def ready(kind: str, s: int, i: int) -> float | None:
        needs = []
        if kind == "F" and s > 0:
            needs.append([("F", s - 1, i)])
        if kind in ("B", "I"):
            needs.append([("F", s, i)])
            if s < n_stages - 1:
                needs.append([("B", s + 1, i), ("I", s + 1, i)])
        if kind == "W":
            needs.append([("I", s, i), ("B", s, i)])
        times = []
        for alternatives in needs:
            t = [done[a] for a in alternatives if a in done]
            if not t:
                return None
            times.append(min(t))
        return max(times, default=0.0)

    while any(pos[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, o in enumerate(orders):
            while pos[r] < len(o):
                kind, s, i, d = o[pos[r]]
                t = ready(kind, s, i)
                if t is None:
                    break
                start = max(free[r], t)
                free[r] = start + d
                done[(kind, s, i)] = free[r]
                laid[r].append((kind, s, i, start, free[r]))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the order deadlocks: ranks stopped at {[o[k][:3] if k < len(o) else None for o, k in zip(orders, pos)]}")
    span = max(free)
    return {"makespan": span, "idle": [1 - sum(d for *_, d in o) / span for o in orders], "slots": laid}


def in_flight(slots: list[tuple], stages: list[int]) -> dict[int, int]:
    """The most micro-batches whose graph a stage held at once, from its slots in the order they ran: a
    forward opens one; a backward (B) closes it, or, when the backward is split, its W does (between
    I and W autograd keeps what the weights' gradients need)."""
    live = dict.fromkeys(stages, 0)
    most = dict.fromkeys(stages, 0)
    for kind, s, *_ in sorted(slots, key=lambda slot: slot[3]):
        live[s] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
        most[s] = max(most[s], live[s])
    return most


def equal_stages(orders: list[list[tuple[str, int, int, float]]]) -> list[list[tuple[str, int, int, float]]]:
    """The same orders with every slot of a kind given that kind's mean duration over all stages: the
    formulas' assumption (equal stages), to lay out with ``replay``."""
    spans: dict[str, list[float]] = {}
    for o in orders:
        for kind, *_, d in o:
            spans.setdefault(kind, []).append(d)
    mean = {k: statistics.fmean(v) for k, v in spans.items()}
    return [[(kind, s, i, mean[kind]) for kind, s, i, _ in o] for o in orders]


def pooled_durations(runs: dict[str, list[dict[str, Any]]]) -> dict[tuple[int, str, int], float]:
    """The duration of each kind of slot on each stage, ``(v, kind, stage) -> seconds``, pooled over every
    schedule run with the same stages (v stages per rank) and over every repeat and micro-batch: the
    shortest. A slot timed while another rank shared its core is longer, by as much as the other's
    work; with more ranks than cores most are, and the shortest had its core to itself. One table for
    all the schedules, so that their replays differ by their orders only, not by how each run happened
    to be disturbed; it keeps what differs between the stages (the first embeds, the last computes the
    head and the loss)."""
    spans: dict[tuple[int, str, int], list[float]] = {}
    for mine in runs.values():
        for r in mine:
            for rep in r["repeats"]:
                for kd, s, _, a, b in rep["slots"]:
                    spans.setdefault((r["v"], kd, s), []).append(b - a)
    return {key: min(d) for key, d in spans.items()}


def summarise(name: str, mine: list[dict[str, Any]], p: int, m: int, ref_loss: float,
              durations_of: dict[tuple[int, str, int], float]) -> dict[str, Any]:
    """Every rank's results of one schedule, put together (rank 0 has them all); ``durations_of``: the
    slots' durations for the replay (``pooled_durations``)."""
    reps = len(mine[0]["repeats"])
    v, kind = mine[0]["v"], mine[0]["placement"]
    n_stages = p * v
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) == p
    walls, measured = [], []
    for k in range(reps):
        first = min(r["repeats"][k]["clock"] for r in mine)
        shift = [r["repeats"][k]["clock"] - first if shared else 0.0 for r in mine]
        wall = max(r["repeats"][k]["end"] + d for r, d in zip(mine, shift))
        walls.append(wall)
        busy = [sum(b - a for *_, a, b in r["repeats"][k]["slots"]) for r in mine]
        measured.append([1 - x / wall for x in busy])
    idle = [statistics.mean(x) for x in measured]
    med = sorted(range(reps), key=lambda k: idle[k])[reps // 2]
    orders = [[(kd, s, i, durations_of[(v, kd, s)]) for kd, s, i, *_ in r["repeats"][med]["slots"]] for r in mine]
    replayed, equal = replay(orders, n_stages), replay(equal_stages(orders), n_stages)
    one = {s: b for r in mine for s, b in r["one_micro_batch_bytes"].items()}
    hand = mine[0]["repeats"][0]["peak"] is not None
    peak = {s: max(r["repeats"][k]["peak"][s] for k in range(reps)) for r in mine for s in r["stages"]} if hand else {}
    flight = {s: max(in_flight(r["repeats"][k]["slots"], r["stages"])[s] for k in range(reps))
              for r in mine for s in r["stages"]}
    durations: dict[str, list[float]] = {}
    for r in mine:
        for k in range(reps):
            for kd, *_, a, b in r["repeats"][k]["slots"]:
                durations.setdefault(kd, []).append(b - a)
    shift = [r["repeats"][med]["clock"] - min(q["repeats"][med]["clock"] for q in mine) if shared else 0.0
             for r in mine]
    loss = next(r["loss"] for r in mine if r["loss"] is not None)
    return {
        "description": SCHEDULES[name][2], "class": SCHEDULES[name][0], "placement": kind, "v": v,
        "stages_of_rank": [r["stages"] for r in mine],
        "loss": loss, "loss_rel_diff": abs(loss - ref_loss) / ref_loss,
        "grad_rel_err": max(r["grad_rel_err"] for r in mine),
        "grad_rel_err_per_stage": {s: e for r in mine for s, e in r["grad_rel_err_per_stage"].items()},
        "one_micro_batch_bytes": one, "peak_bytes": peak,
        "held_micro_batches": {s: peak[s] / one[s] for s in sorted(peak)}, "in_flight": dict(sorted(flight.items())),
        # per rank, in micro-batches of the rank's own layers: a stage is 1/v of them
        "in_flight_per_rank": [sum(flight[s] for s in r["stages"]) / v for r in mine],
        # bytes each stage holds after each slot of the median repeat, in micro-batches (by hand only)
        "held_trace": {s: [(k, b / one[s]) for k, (st, _, b) in enumerate(r["repeats"][med]["held"]) if st == s]
                       for r in mine for s in r["stages"]} if hand else {},
        "formula": bubble_formula(p, m, v) if name in ("gpipe", "1f1b", "lib_1f1b", "interleaved_1f1b") else None,
        "measured_idle": idle, "replayed_idle": statistics.mean(replayed["idle"]),
        "equal_stages_idle": statistics.mean(equal["idle"]),
        "stage_durations_s": {f"{kd}{s}": d for (w, kd, s), d in sorted(durations_of.items(), key=lambda t: (t[0][2], t[0][1]))
                              if w == v},
        "replayed_idle_per_rank": replayed["idle"],
        "wall_s": walls, "median_s": {kd: statistics.median(d) for kd, d in durations.items()},
        "timeline": [[(kd, s, i, a + d, b + d) for kd, s, i, a, b in r["repeats"][med]["slots"]]
                     for r, d in zip(mine, shift)],
        "replayed_timeline": replayed["slots"],
    }


# --------------------------------------------------------------------------------------------------

def check_options(opts: dict[str, Any], p: int) -> list[str]:
    names = [s.strip() for s in str(opts["schedules"]).split(",") if s.strip()]
    unknown = [s for s in names if s not in SCHEDULES]
    if unknown or not names:
        raise FlagError(f"--schedules: unknown {unknown}; choose from {','.join(SCHEDULES)}.")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "micro_batches", "repeats",
                "stages_per_rank"):
        if opts[key] < 1:
            raise FlagError(f"--{key} must be at least 1 (got {opts[key]}).")
    m = opts["micro_batches"]
    if opts["batch_size"] % m:
        raise FlagError(f"--batch_size={opts['batch_size']} must be divisible by --micro_batches={m}.")
    if m < p:
        raise FlagError(f"--micro_batches={m} is fewer than the {p} stages: the pipeline would never be full "
                        f"and PyTorch's 1F1B refuses it; use --micro_batches={p} or more.")
    most = max(opts["stages_per_rank"] if SCHEDULES[s][1] == "loop" else 2 if SCHEDULES[s][1] == "v" else 1
               for s in names)
    stage_bounds(opts["n_layer"], p * most)
    if opts["n_embd"] % opts["n_head"]:
        raise FlagError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")
    return names


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    require_device(opts["device"])
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed or info.world_size < 2:
            raise FlagError(f"a pipeline needs at least 2 stages, one per rank: launch it with `{PROG}`.")
        p, m = info.world_size, opts["micro_batches"]
        names = check_options(opts, p)
        corpus = load_corpus(opts["corpus"], announce=log)
        tok = CharTokenizer.from_text(corpus.text)
        tokens = torch.tensor(tok.encode(corpus.text), dtype=torch.long)
        vocab = tok.vocab_size
        data = batches(tokens, opts, 1, info.device)[0]
        # the ranks that hold the two ends when they are apart: the first and the last rank under every
        # placement here (round robin puts stage p * v - 1 on rank p - 1; V puts both ends on rank 0)
        groups = {(0, p - 1): dist.new_group([0, p - 1])}
        model = build_model(opts, vocab, info.device)
        _, ref_loss = model(*data)
        ref_loss.backward()
        ref = {"grads": {n: q.grad.detach().clone() for n, q in model.named_parameters()}}
        cores = os.cpu_count() or 1
        share = "a core each" if cores >= p else "fewer cores than ranks: only the replayed idle fractions are the schedules'"
        log(f"[schedules] {p} ranks on {cores} cores ({share}); "
            f"MiniGPT {model.num_params():,} parameters, {opts['n_layer']} blocks; batch {opts['batch_size']} "
            f"x {opts['block_size']} tokens in m = {m} micro-batches")
        del model
        out: dict[str, Any] = {}
        left_out = {n: r for n in names if (r := not_run_reason(n)) is not None}
        for name, reason in left_out.items():
            log(f"[schedules] {name:<17} {reason}")
        gathered: dict[str, list[dict[str, Any]]] = {}
        seconds = {}
        for name in (n for n in names if n not in left_out):
            t0 = time.perf_counter()
            mine = run_schedule(name, opts, vocab, data, info, groups, ref)
            gathered[name] = [None] * p
            dist.all_gather_object(gathered[name], mine)
            seconds[name] = time.perf_counter() - t0
        durations_of = pooled_durations(gathered)
        for name, every in gathered.items():
            s = out[name] = summarise(name, every, p, m, ref_loss.item(), durations_of)
            s["seconds"] = seconds[name]
            s["matches"] = s["grad_rel_err"] <= GRAD_RTOL and s["loss_rel_diff"] <= LOSS_RTOL
            held = ", ".join(str(h) for h in s["in_flight"].values())
            if s["held_micro_batches"]:
                held += " (bytes: " + ", ".join(f"{h:.2f}" for h in s["held_micro_batches"].values()) + ")"
            formula = "" if s["formula"] is None else f", formula {s['formula']:.1%}"
            log(f"[schedules] {name:<17} loss {s['loss']:.5f} (one process {ref_loss.item():.5f}), gradients "
                f"{s['grad_rel_err']:.1e}; idle replayed {s['replayed_idle']:.1%}, measured "
                f"{statistics.median(s['measured_idle']):.1%}, equal stages {s['equal_stages_idle']:.1%}{formula}; "
                f"micro-batches held per stage {held}")
        result = {"world_size": p, "cores": cores, "backend": info.backend, "device": info.device.type,
                  "options": opts, "vocab_size": vocab, "micro_batches": m, "reference_loss": ref_loss.item(),
                  "tolerances": {"grad_rtol": GRAD_RTOL, "loss_rtol": LOSS_RTOL}, "schedules": out, "left_out": left_out,
                  "load_average": load_average(), "environment": environment()}
        write_result(info, opts["out_dir"], "schedules_lab", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
