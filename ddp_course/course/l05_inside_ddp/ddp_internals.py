"""Inside DistributedDataParallel: buckets, buffers, unused parameters, hooks and uneven inputs.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l05_inside_ddp.ddp_internals --out_dir=runs/ddp_internals

One launch, several experiments (``--parts``, default all of them), each on the CPU with gloo, on
any machine (``CPU_BY_DESIGN`` says why; the first line prints it):

- ``buckets``: MiniGPT wrapped with each ``--bucket_caps`` (MB); a recording communication hook logs
  which parameters every bucket holds and how many all-reduces each step issues (first step: DDP's
  initial layout; later steps: the layout DDP rebuilt in the order the gradients arrived), and a
  time-ordered log interleaves "gradient ready" (post-accumulate-grad hooks) with "all-reduce
  launched" (the comm hook).
- ``gradhook``: a ``Tensor.register_hook`` that doubles one gradient on rank 0 only, under DDP.
- ``buffers``: a BatchNorm model whose ranks see different data: the running mean each rank holds
  when its forward starts, with ``broadcast_buffers`` on and off.
- ``unused``: a model with a branch used only on some steps (or some ranks): the errors without
  ``find_unused_parameters`` -- one of them a rank waiting for a collective that never comes, bounded
  by a ``--pg_timeout_s`` process-group timeout -- the fix, and its cost against ``static_graph``.
- ``static``: a branch never used: ``static_graph=True`` copes without the per-step graph walk.
- ``hooks``: communication hooks (none, built-in fp16, the course's bf16 and int8): reduced
  gradients against the exact mean, bytes each rank hands to the network per step (counted), and the
  loss of ``--hook_steps`` training steps with each.
- ``join``: rank r gets ``--join_batches`` + 2r batches: without ``join()`` the longer rank waits for
  a partner that has stopped (a timeout error); with ``with model.join():`` training completes.

Rank 0 writes ``internals.json`` into ``--out_dir``. Options are ``--key=value``.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course import parallel
from ddp_course.cli import FlagError, command, number_list, parse_flags
from ddp_course.course.l05_inside_ddp.ddp_common import (
    BucketRecorder,
    CollectiveCounter,
    record_grad_ready,
    time_steps,
)
from ddp_course.data import prepare, train_batches
from ddp_course.dist import DistInfo, log, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.parallel import ddp as ddp_strategy
from ddp_course.paths import show

PARTS = ("buckets", "gradhook", "buffers", "unused", "static", "hooks", "join")
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/ddp_internals",
    "parts": ",".join(PARTS),
    "bucket_caps": "25,0.1,0.04",  # MB; 25 is DDP's default size, but given explicitly: no 1 MiB first bucket
    "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "micro_batch_size": 8,
    "hook_steps": 40,  # training steps per communication hook for the loss comparison
    "hook_lr": 3e-3,
    "cost_steps": 10, "cost_rounds": 7,  # timing of find_unused_parameters / static_graph: rounds give the spread
    "join_batches": 3,  # rank r gets join_batches + 2 r batches
    "pg_timeout_s": 2.0,  # timeout of the process groups in which something is meant to fail
    "corpus": "tinyshakespeare",
    "seed": 1337,
}
PROG = "python -m ddp_course.course.l05_inside_ddp.ddp_internals"
CPU_BY_DESIGN = ("the unused-parameter and join experiments let a collective time out on purpose and record "
                 "the error each rank gets, which gloo raises and the rank can catch; under NCCL the watchdog "
                 "aborts the process instead")


# --------------------------------------------------------------------------------------------------
# helpers

def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _gpt(opts: dict[str, Any], vocab: int) -> MiniGPT:
    torch.manual_seed(opts["seed"])  # the same initial weights on every rank
    return MiniGPT(GPTConfig(vocab_size=vocab, block_size=opts["block_size"], n_layer=opts["n_layer"],
                             n_head=opts["n_head"], n_embd=opts["n_embd"]))


def _cfg(**changes) -> SimpleNamespace:
    """The DDP fields of TrainConfig, for ddp_strategy.ddp_kwargs."""
    base = {"bucket_cap_mb": 25.0, "find_unused_parameters": False, "static_graph": False, "broadcast_buffers": True}
    return SimpleNamespace(**{**base, **changes})


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fragile_group(opts: dict[str, Any]):
    """A process group of all ranks with a short timeout, for an experiment that is meant to fail.

    When one of its collectives times out, the group is left broken; the world group is untouched,
    so the lab carries on after a barrier.
    """
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=opts["pg_timeout_s"]))


def _error(exc: BaseException, t0: float) -> dict[str, Any]:
    msg = re.sub(r"^\[[^\]]+\] ", "", str(exc).strip())  # gloo prefixes its source file and line
    first = msg.split(". ")[0] if msg.startswith("Expected to have finished") else msg.splitlines()[0]
    return {"type": type(exc).__name__, "message": first[:400], "after_s": round(time.perf_counter() - t0, 2)}


def _exact_mean_grads(model: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    """Every rank's local gradient (plain model, no DDP), averaged over ranks in float64."""
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    out = {}
    for n, p in model.named_parameters():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).double()
        dist.all_reduce(g)
        out[n] = g / dist.get_world_size()
    model.zero_grad(set_to_none=True)
    return out


class Branchy(nn.Module):
    """trunk -> (optionally) + branch -> head. The branch's parameters get no gradient when skipped."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.trunk = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _branchy(seed: int) -> Branchy:
    torch.manual_seed(seed)
    return Branchy()


def _rank_batch(seed: int, rank: int, step: int, rows: int = 8, width: int = 16) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed + 1000 * rank + step))


# --------------------------------------------------------------------------------------------------
# parts

def part_buckets(opts, info: DistInfo, data) -> dict[str, Any]:
    """Bucket layout per cap (initial and rebuilt) and all-reduces per step, counted by a comm hook."""
    x, y = data["batch"]
    out = {"caps": []}
    for cap in number_list(opts["bucket_caps"], "bucket_caps"):
        model = _gpt(opts, data["vocab"])
        ddp = DDP(model, **ddp_strategy.ddp_kwargs(_cfg(bucket_cap_mb=cap)))
        events: list[dict[str, Any]] = []
        rec = BucketRecorder(ddp, _names(model), events=events)
        handles = record_grad_ready(model, events)
        step_events = []
        for step in range(3):
            rec.step = step
            events.clear()
            t0 = time.perf_counter()
            _, loss = ddp(x, y)
            events.append({"t": time.perf_counter(), "kind": "backward starts", "what": ""})
            loss.backward()
            step_events.append([{**e, "t": round((e["t"] - t0) * 1e3, 3)} for e in events])
            model.zero_grad(set_to_none=True)
        for h in handles:
            h.remove()
        layout = None
        if hasattr(ddp.reducer, "_get_zeros_like_grad_buckets"):  # DDP's own view of its buckets
            layout = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
        out["caps"].append({
            "bucket_cap_mb": cap,
            "allreduces_per_step": [len(rec.calls_in(s)) for s in range(3)],
            "buckets_step0": rec.calls_in(0), "buckets_rebuilt": rec.calls_in(2),
            "reducer_bucket_numel": layout,
            "events_rebuilt": step_events[2],
        })
        log(f"[buckets] bucket_cap_mb={cap:g}: all-reduces per step {out['caps'][-1]['allreduces_per_step']}")
        del ddp
    model = _gpt(opts, data["vocab"])
    out["param_order"] = [n for n, _ in model.named_parameters()]
    out["param_numel"] = {n: p.numel() for n, p in model.named_parameters()}
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def part_gradhook(opts, info: DistInfo, data) -> dict[str, Any]:
    """A tensor hook on rank 0 doubles head.weight's gradient before DDP reduces it."""
    model = _branchy(opts["seed"])
    x = _rank_batch(opts["seed"], info.rank, 0)

    def loss_fn(m):
        return m(x, use_branch=True).pow(2).mean()

    local = {}
    model.zero_grad()
    loss_fn(model).backward()
    local = model.head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    per_rank_local = _gather(local)

    ddp = DDP(model)
    if info.rank == 0:
        # Tensor.register_hook: runs on the gradient before it is accumulated into p.grad, so
        # before DDP's reducer sees it. Here: only on rank 0, the gradient doubled.
        handle = model.head.weight.register_hook(lambda g: 2 * g)
    loss_fn(ddp).backward()
    got = model.head.weight.grad.clone()
    if info.rank == 0:
        handle.remove()
    expected = (2 * per_rank_local[0] + sum(per_rank_local[1:])) / info.world_size
    plain = sum(per_rank_local) / info.world_size
    per_rank = _gather({"rank": info.rank, "max_err_vs_expected": float((got - expected).abs().max()),
                        "max_diff_vs_plain_mean": float((got - plain).abs().max()), "grad_head": got.flatten()[:4].tolist()})
    return {"per_rank": per_rank, "rank0_local": per_rank_local[0].flatten()[:4].tolist(),
            "rank1_local": per_rank_local[1].flatten()[:4].tolist()}


class BNNet(nn.Module):
    """Linear -> BatchNorm1d -> Linear. BatchNorm's running_mean and running_var are buffers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def part_buffers(opts, info: DistInfo, data) -> dict[str, Any]:
    """Rank r's data is shifted by 3r, so each rank's BatchNorm statistics differ."""
    out = {}
    for broadcast in (True, False):
        torch.manual_seed(opts["seed"])
        model = BNNet()
        ddp = DDP(model, **ddp_strategy.ddp_kwargs(_cfg(broadcast_buffers=broadcast)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        seen = []  # running_mean[:4] as each forward starts (after DDP's broadcast, if any)
        handle = model.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(m.bn.running_mean[:4].tolist()))
        for step in range(4):
            x = _rank_batch(opts["seed"], info.rank, step, width=4) + 3.0 * info.rank
            loss = ddp(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        handle.remove()
        final = model.bn.running_mean[:4].tolist()
        ranks = _gather({"seen": seen, "final": final})
        gap = [max(abs(a - b) for a, b in zip(ranks[0]["seen"][s], ranks[1]["seen"][s])) for s in range(len(seen))]
        out["on" if broadcast else "off"] = {"per_rank": ranks, "gap_at_forward_start": gap,
                                              "gap_final": max(abs(a - b) for a, b in zip(ranks[0]["final"], ranks[1]["final"]))}
        log(f"[buffers] broadcast_buffers={broadcast}: running_mean gap between ranks at forward start {gap}")
    return out


def _branchy_steps(opts, info: DistInfo, steps: int, use_branch: Callable[[int], bool]) -> dict[str, Any]:
    """``steps`` DDP steps of the branchy model, without find_unused_parameters, the branch used
    where ``use_branch(step)``: how many finished, and the error that ended them (None if none did)."""
    ddp = DDP(_branchy(opts["seed"]), process_group=_fragile_group(opts))
    t0 = time.perf_counter()
    steps_done = 0
    try:
        for step in range(steps):
            ddp(_rank_batch(opts["seed"], info.rank, step), use_branch=use_branch(step)).pow(2).mean().backward()
            steps_done += 1
        return {"error": None, "steps_done": steps_done}
    except RuntimeError as exc:
        return {"error": _error(exc, t0), "steps_done": steps_done}
    finally:
        del ddp


def part_unused(opts, info: DistInfo, data) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seed = opts["seed"]

    # 1. the branch is skipped on odd steps, on every rank, without find_unused_parameters
    out["skipped_everywhere"] = _branchy_steps(opts, info, 3, lambda step: step % 2 == 0)
    dist.barrier()

    # 2. the branch is used on rank 0 only: rank 0 all-reduces a bucket that rank 1 never offers
    out["skipped_on_rank1"] = _gather(_branchy_steps(opts, info, 2, lambda step: info.rank == 0))
    dist.barrier()

    # 3. the fix: find_unused_parameters=True, both patterns; gradients against the exact mean
    fixed = {}
    for pattern in ("skipped_everywhere", "skipped_on_rank1"):
        model = _branchy(seed)
        ref_model = _branchy(seed)
        ddp = DDP(model, find_unused_parameters=True)
        errs = []
        for step in range(3):
            use = step % 2 == 0 if pattern == "skipped_everywhere" else info.rank == 0
            x = _rank_batch(seed, info.rank, step)
            want = _exact_mean_grads(ref_model, lambda m, x=x, use=use: m(x, use_branch=use).pow(2).mean())
            model.zero_grad(set_to_none=True)
            ddp(x, use_branch=use).pow(2).mean().backward()
            errs.append(max(float(((p.grad if p.grad is not None else torch.zeros_like(p)).double() - want[n]).abs().max())
                            for n, p in model.named_parameters()))
        fixed[pattern] = {"steps_done": 3, "max_grad_err": max(errs),
                          "branch_grad_none": model.branch.weight.grad is None}
    out["fixed"] = fixed
    return out


def _cost(opts, info: DistInfo, data) -> dict[str, Any]:
    """Forward+backward time of MiniGPT (every parameter used) with each DDP option."""
    x, y = data["batch"]
    variants = {"default": {}, "find_unused_parameters": {"find_unused_parameters": True},
                "static_graph": {"static_graph": True}}
    models = {}
    for name, kw in variants.items():
        ddp = DDP(_gpt(opts, data["vocab"]), **kw)
        for _ in range(2):  # warm up (and let DDP rebuild its buckets)
            ddp(x, y)[1].backward()
        models[name] = ddp
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(opts["cost_rounds"]):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            ddp = models[name]

            def step(ddp=ddp):
                ddp(x, y)[1].backward()
                ddp.module.zero_grad(set_to_none=True)
            times[name].append(time_steps(step, opts["cost_steps"]) * 1e3)
    return {"step_ms": times, "median_ms": {k: sorted(v)[len(v) // 2] for k, v in times.items()}}


def part_static(opts, info: DistInfo, data) -> dict[str, Any]:
    """The branch is never used: static_graph=True records that once and needs no graph walk."""
    seed = opts["seed"]
    model, ref_model = _branchy(seed), _branchy(seed)
    ddp = DDP(model, static_graph=True)
    errs = []
    for step in range(3):
        x = _rank_batch(seed, info.rank, step)
        want = _exact_mean_grads(ref_model, lambda m, x=x: m(x, use_branch=False).pow(2).mean())
        model.zero_grad(set_to_none=True)
        ddp(x, use_branch=False).pow(2).mean().backward()
        errs.append(max(float(((p.grad if p.grad is not None else torch.zeros_like(p)).double() - want[n]).abs().max())
                        for n, p in model.named_parameters()))
    logging = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
    out = {"steps_done": 3, "max_grad_err": max(errs), "branch_grad_none": model.branch.weight.grad is None,
           "static_graph_logged": logging.get("static_graph")}
    out["cost"] = _cost(opts, info, data)
    log("[static] forward+backward ms, median (min-max) over rounds: " + ", ".join(
        f"{k} {v:.2f} ({min(out['cost']['step_ms'][k]):.2f}-{max(out['cost']['step_ms'][k]):.2f})"
        for k, v in out["cost"]["median_ms"].items()))
    return out


HOOK_NAMES = ("none", "fp16", "bf16", "int8")


def _hooked_ddp(model: nn.Module, info: DistInfo, name: str, cap: float) -> DDP:
    """DDP through the course's wrap (none / fp16 / bf16 are --comm_hook values); int8 registered here."""
    cfg = SimpleNamespace(**vars(_cfg(bucket_cap_mb=cap)), comm_hook="none" if name == "int8" else name)
    ddp = parallel.Strategy("ddp").wrap(model, info, cfg)
    if name == "int8":
        ddp.register_comm_hook(None, ddp_strategy.int8_hook)
    return ddp


def part_hooks(opts, info: DistInfo, data) -> dict[str, Any]:
    from ddp_course.train import build_optimizer, train_step

    x, y = data["batch"]
    cap = min(number_list(opts["bucket_caps"], "bucket_caps"))
    out: dict[str, Any] = {"bucket_cap_mb": cap, "hooks": {}}

    # PyTorch's own bf16 hook on this backend
    probe = DDP(_branchy(opts["seed"]))
    try:
        probe.register_comm_hook(None, default_hooks.bf16_compress_hook)
        out["builtin_bf16"] = {"error": None}
    except (TypeError, RuntimeError) as exc:
        out["builtin_bf16"] = {"error": f"{type(exc).__name__}: {exc}"}
    del probe

    ref_model = _gpt(opts, data["vocab"])
    want = _exact_mean_grads(ref_model, lambda m: m(x, y)[1])
    for name in HOOK_NAMES:
        model = _gpt(opts, data["vocab"])
        ddp = _hooked_ddp(model, info, name, cap)
        for _ in range(2):  # DDP rebuilds its buckets after the first backward: measure after that
            ddp(x, y)[1].backward()
            model.zero_grad(set_to_none=True)
        with CollectiveCounter() as counter:
            ddp(x, y)[1].backward()
        traffic = counter.summary(info.world_size)
        got = torch.cat([p.grad.double().flatten() for _, p in model.named_parameters()])
        exact = torch.cat([want[n].flatten() for n, _ in model.named_parameters()])
        err = float((got - exact).abs().max())
        rel_l2 = float((got - exact).norm() / exact.norm())  # the usual yardstick of gradient compression
        # Each grad must be the same on every rank (the all-reduce's point)
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        same = bool(torch.equal(hi, lo))  # element-wise max over ranks == min over ranks
        del ddp

        # the effect on training: the course's train_step, the same data and init for every hook
        model = _gpt(opts, data["vocab"])
        ddp = _hooked_ddp(model, info, name, cap)
        opt = build_optimizer(ddp, SimpleNamespace(weight_decay=0.1, lr=opts["hook_lr"]), info.device)
        losses = []
        for step in range(opts["hook_steps"]):
            loss, _ = train_step(ddp, opt, None, [data["train"][step]], device=info.device, precision="fp32",
                                 grad_clip=1.0)
            losses.append(loss)
        loss_t = torch.stack(losses).double()
        dist.all_reduce(loss_t)  # mean over ranks: the loss of the global batch
        out["hooks"][name] = {"traffic": traffic, "max_abs_err": err, "rel_l2_err": rel_l2,
                              "max_abs_grad": float(exact.abs().max()), "same_on_all_ranks": same,
                              "losses": (loss_t / info.world_size).tolist()}
        log(f"[hooks] {name:>5}: {traffic['payload_bytes']:>8,} bytes handed to {traffic['ops']} per step; "
            f"gradient error |g - exact| / |exact| = {rel_l2:.1e}; loss after {opts['hook_steps']} steps "
            f"{out['hooks'][name]['losses'][-1]:.4f}")
        del ddp
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in ref_model.parameters())
    return out


def part_join(opts, info: DistInfo, data) -> dict[str, Any]:
    seed = opts["seed"]
    n_mine = opts["join_batches"] + 2 * info.rank
    lr = 0.1

    progress = [0]  # steps completed, readable after an exception

    def run(ddp, opt, use_join: bool) -> int:
        progress[0] = 0
        with ddp.join() if use_join else contextlib.nullcontext():
            for step in range(n_mine):
                ddp(_rank_batch(seed, info.rank, step), use_branch=True).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                progress[0] += 1
        return progress[0]

    out: dict[str, Any] = {"batches_per_rank": _gather(n_mine), "pg_timeout_s": opts["pg_timeout_s"]}

    # without join: the rank with more batches all-reduces alone
    group = _fragile_group(opts)
    model = _branchy(seed)
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    try:
        done = run(ddp, opt, use_join=False)
        res = {"error": None, "steps_done": done, "after_s": round(time.perf_counter() - t0, 2)}
    except RuntimeError as exc:
        res = {"error": _error(exc, t0), "steps_done": progress[0]}
    del ddp
    out["without_join"] = _gather(res)
    dist.barrier()

    # with join, in a healthy group of normal timeout
    model = _branchy(seed)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    done = run(ddp, opt, use_join=True)
    elapsed = time.perf_counter() - t0
    final = torch.cat([p.detach().flatten() for p in model.parameters()])

    # reference: one process replays every rank's batches. While a rank still has data it
    # contributes its gradient; joined ranks contribute zeros; the sum is divided by the initial
    # world size (join's default, divide_by_initial_world_size=True).
    ref = _branchy(seed)
    counts = out["batches_per_rank"]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(max(counts)):
        total = [torch.zeros_like(p) for p in ref.parameters()]
        for r, n in enumerate(counts):
            if step < n:
                ref.zero_grad(set_to_none=True)
                ref(_rank_batch(seed, r, step), use_branch=True).pow(2).mean().backward()
                for t, p in zip(total, ref.parameters()):
                    t += p.grad
        for t, p in zip(total, ref.parameters()):
            p.grad = t / len(counts)
        ref_opt.step()
    ref_flat = torch.cat([p.detach().flatten() for p in ref.parameters()])
    per_rank = _gather({"steps_done": done, "after_s": round(elapsed, 2), "params": final[:6].tolist(),
                        "max_diff_vs_reference": float((final - ref_flat).abs().max())})
    finals = _gather(final)
    out["with_join"] = {"per_rank": per_rank, "max_diff_between_ranks": float(max((f - finals[0]).abs().max() for f in finals))}
    log(f"[join] without: {[r['error']['message'][:60] if r['error'] else 'finished' for r in out['without_join']]}; "
        f"with join(): steps {[r['steps_done'] for r in per_rank]}")
    return out


PART_FUNCS = {"buckets": part_buckets, "gradhook": part_gradhook, "buffers": part_buffers, "unused": part_unused,
              "static": part_static, "hooks": part_hooks, "join": part_join}


@record  # on failure, torchrun's error file carries this rank's traceback
@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    parts = [p.strip() for p in opts["parts"].split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise FlagError(f"{PROG}: --parts={opts['parts']!r}: choose from {', '.join(PARTS)} (comma-separated).")
    number_list(opts["bucket_caps"], "bucket_caps")
    if opts["pg_timeout_s"] <= 0 or opts["join_batches"] < 1 or opts["hook_steps"] < 1:
        raise FlagError(f"{PROG}: --pg_timeout_s must be positive, --join_batches and --hook_steps at least 1.")
    with setup(device="cpu", timeout_s=60.0, because=CPU_BY_DESIGN) as info:  # by design: see CPU_BY_DESIGN
        if info.world_size < 2:
            raise FlagError(f"{PROG} shows what happens between ranks: launch it with torchrun "
                            "--nproc_per_node=2 (or more).")
        log(f"[ddp_internals] {info.world_size} ranks, {info.device_reason}; parts: {', '.join(parts)}")
        d = prepare(opts["corpus"], opts["block_size"], 0.1, announce=log)
        it = train_batches(d.train, opts["micro_batch_size"], info.rank, info.world_size, opts["seed"])
        batches = [next(it) for _ in range(opts["hook_steps"] + 1)]
        data = {"vocab": d.tokenizer.vocab_size, "batch": batches[0], "train": batches[1:]}
        result: dict[str, Any] = {"world_size": info.world_size, "backend": info.backend, "torch": torch.__version__,
                                  "options": opts, "timings_s": {}}
        for part in parts:
            t0 = time.perf_counter()
            result[part] = PART_FUNCS[part](opts, info, data)
            dist.barrier()
            result["timings_s"][part] = round(time.perf_counter() - t0, 2)
        if info.is_main:
            write_json(Path(opts["out_dir"]) / "internals.json", result)
            log(f"[ddp_internals] wrote {show(Path(opts['out_dir']) / 'internals.json')} (seconds per part: {result['timings_s']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
