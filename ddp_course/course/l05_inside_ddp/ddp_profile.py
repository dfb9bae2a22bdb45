"""Overlap of all-reduce with backward: a profiler trace, and the step time with overlap defeated.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l05_inside_ddp.ddp_profile --out_dir=runs/ddp_profile
    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l05_inside_ddp.ddp_profile --mode=sweep --bucket_caps=0.05,0.25,1,25

``--device=auto`` (default) runs on the GPUs with NCCL when every rank has one of its own, else on
the CPU with gloo (one thread per rank by default, ``--threads``); the first line says which. The
point is the order of events on the timeline, which a CPU shows too; on GPUs the trace also records
the kernels (``ProfilerActivity.CUDA``), and the overlap is read from the GPU's timeline (see
``ddp_common.read_trace``). ``--mode=profile`` (default) trains MiniGPT (forward, backward, SGD
step) three ways:

- ``overlap``: DDP with ``--bucket_cap_mb`` buckets -- each bucket is all-reduced as soon as its
  gradients are ready, while backward goes on computing the rest;
- ``one_bucket``: DDP with one bucket bigger than the model -- it is ready only when the last
  gradient is, so the all-reduce starts after backward: overlap defeated;
- ``by_hand``: no DDP; after backward, one ``all_reduce`` per parameter tensor, then divide.

For each, ``--trace_steps`` steps run under ``torch.profiler`` and rank 0 exports a Chrome trace
(``trace_<variant>.json``: open it in chrome://tracing or https://ui.perfetto.dev), then the
step time is measured, ``--rounds`` rounds of ``--steps`` steps in alternating order (a step counts
when the slowest rank has finished it). Rank 0 writes ``profile.json``.

``--mode=sweep`` times the ``overlap`` step for every bucket size in ``--bucket_caps`` (MB), counting
the all-reduces of one step for each, and writes ``sweep.json`` (``python -m ddp_course.bench
buckets`` runs this and prints the table).

The tokens are random ids: step time does not depend on their values.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from ddp_course.cli import FlagError, command, number_list, parse_flags
from ddp_course.course.l05_inside_ddp.ddp_common import (
    CollectiveCounter,
    overlap_stats,
    read_trace,
    time_steps,
)
from ddp_course.course.options import require_device
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.paths import show

VARIANTS = ("overlap", "one_bucket", "by_hand")
ONE_BUCKET_MB = 1e4  # 10 GB: more than any model of the course, so every gradient lands in one bucket
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/ddp_profile",
    "mode": "profile",
    "bucket_cap_mb": 0.5,  # the overlap variant's bucket size (MB)
    "bucket_caps": "0.05,0.1,0.25,0.5,1,2,25",  # sweep mode (MB)
    "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "micro_batch_size": 8,
    "vocab_size": 65,
    "trace_steps": 2, "warmup": 3, "steps": 8, "rounds": 3,
    "threads": 1,  # CPU threads per rank (on the CPU only)
    "device": "auto",  # auto | cpu | cuda (cuda needs one GPU per rank)
    "seed": 1337,
}
PROG = "python -m ddp_course.course.l05_inside_ddp.ddp_profile"


def _model(opts: dict[str, Any]) -> MiniGPT:
    torch.manual_seed(opts["seed"])
    return MiniGPT(GPTConfig(vocab_size=opts["vocab_size"], block_size=opts["block_size"], n_layer=opts["n_layer"],
                             n_head=opts["n_head"], n_embd=opts["n_embd"]))


class Trainer:
    """One variant: a model, its SGD optimizer, and ``step()`` = forward, backward, sync, update."""

    def __init__(self, variant: str, opts: dict[str, Any], batch, device: torch.device,
                 bucket_cap_mb: float | None = None):
        self.variant = variant
        self.model = _model(opts).to(device)
        self.world = dist.get_world_size()
        if variant == "by_hand":
            self.net = self.model
        else:
            cap = ONE_BUCKET_MB if variant == "one_bucket" else (bucket_cap_mb or opts["bucket_cap_mb"])
            self.net = DDP(self.model, bucket_cap_mb=cap,
                           device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = batch
        self.n = 0

    def step(self) -> None:
        with record_function(f"step {self.n}"):
            with record_function("forward"):
                _, loss = self.net(self.x, self.y)
            with record_function("backward"):
                loss.backward()  # DDP: bucket all-reduces launched from inside, waited for at the end
            if self.variant == "by_hand":
                with record_function("allreduce by hand"):
                    for p in self.model.parameters():  # one tensor at a time, after backward
                        dist.all_reduce(p.grad)
                        p.grad /= self.world
            with record_function("optimizer"):
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
        self.n += 1


def _batch(opts: dict[str, Any], rank: int, device: torch.device):
    g = torch.Generator().manual_seed(opts["seed"] + rank)  # each rank its own data (the same on any device)
    tokens = torch.randint(opts["vocab_size"], (opts["micro_batch_size"], opts["block_size"] + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _allreduces_per_step(trainer: Trainer) -> dict[str, Any]:
    with CollectiveCounter() as counter:
        trainer.step()
    return counter.summary(trainer.world)


def profile_mode(opts: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    out_dir = Path(opts["out_dir"])
    batch = _batch(opts, rank, device)
    trainers = {v: Trainer(v, opts, batch, device) for v in VARIANTS}
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    result: dict[str, Any] = {"variants": {}, "model_bytes": sum(p.numel() * 4 for p in trainers["overlap"].model.parameters())}
    for v, tr in trainers.items():
        for _ in range(opts["warmup"]):  # allocations, first kernels, DDP's bucket rebuild
            tr.step()
        traffic = _allreduces_per_step(tr)
        dist.barrier()
        with profile(activities=activities) as prof:
            for _ in range(opts["trace_steps"]):
                tr.step()
            if cuda:
                torch.cuda.synchronize(device)  # every kernel of the traced steps finished inside the trace
        info: dict[str, Any] = {"traffic": traffic}
        if rank == 0:
            path = out_dir / f"trace_{v}.json"
            out_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
            info["trace"] = str(path)
            trace = read_trace(path)
            info["timeline"] = trace["timeline"]  # cpu: autograd functions and gloo spans; gpu: kernels
            info["trace_stats"] = overlap_stats(trace)
        result["variants"][v] = info
        dist.barrier()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(opts["rounds"]):
        order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            times[v].append(time_steps(trainers[v].step, opts["steps"], device=device) * 1e3)
    for v in VARIANTS:
        ts = sorted(times[v])
        result["variants"][v].update({"step_ms": times[v], "median_ms": ts[len(ts) // 2]})
        log(f"[profile] {v:<11} {result['variants'][v]['traffic']['ops']} per step; "
            f"step {result['variants'][v]['median_ms']:.1f} ms (median of {opts['rounds']} rounds)")
    return result


def sweep_mode(opts: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    caps = number_list(opts["bucket_caps"], "bucket_caps")
    batch = _batch(opts, rank, device)
    trainers = {cap: Trainer("overlap", opts, batch, device, bucket_cap_mb=cap) for cap in caps}
    counts = {}
    for cap, tr in trainers.items():
        for _ in range(opts["warmup"]):
            tr.step()
        counts[cap] = _allreduces_per_step(tr)["ops"].get("allreduce", 0)
    times: dict[float, list[float]] = {cap: [] for cap in caps}
    for r in range(opts["rounds"]):
        order = caps if r % 2 == 0 else list(reversed(caps))
        for cap in order:
            times[cap].append(time_steps(trainers[cap].step, opts["steps"], device=device) * 1e3)
    rows = []
    for cap in caps:
        ts = sorted(times[cap])
        rows.append({"bucket_cap_mb": cap, "allreduces_per_step": counts[cap], "step_ms": times[cap],
                     "median_ms": ts[len(ts) // 2], "min_ms": ts[0], "max_ms": ts[-1]})
        log(f"[sweep] bucket_cap_mb={cap:<6g} {counts[cap]:>3} all-reduce(s) per step  "
            f"{rows[-1]['median_ms']:7.1f} ms per step (median of {opts['rounds']})")
    return {"rows": rows, "model_bytes": sum(p.numel() * 4 for p in trainers[caps[0]].model.parameters())}


@record  # on failure, torchrun's error file carries this rank's traceback
@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    if opts["mode"] not in ("profile", "sweep"):
        raise FlagError(f"{PROG}: --mode={opts['mode']!r} must be profile or sweep.")
    if opts["device"] not in ("auto", "cpu", "cuda"):
        raise FlagError(f"{PROG}: --device={opts['device']!r} must be auto, cpu or cuda.")
    for key in ("trace_steps", "steps", "rounds", "threads", "micro_batch_size", "block_size"):
        if opts[key] < 1:
            raise FlagError(f"{PROG}: --{key} must be at least 1 (got {opts[key]}).")
    if opts["warmup"] < 2:
        raise FlagError(f"{PROG}: --warmup must be at least 2: DDP rebuilds its buckets after the first step.")
    if opts["bucket_cap_mb"] <= 0:
        raise FlagError(f"{PROG}: --bucket_cap_mb must be positive (got {opts['bucket_cap_mb']}).")
    number_list(opts["bucket_caps"], "bucket_caps")
    require_device(opts["device"])
    with setup(device=opts["device"], timeout_s=120.0, threads=opts["threads"]) as info:
        if info.world_size < 2:
            raise FlagError(f"{PROG} measures communication between ranks: launch it with torchrun --nproc_per_node=2.")
        log(f"[ddp_profile] {info.world_size} ranks, {info.device_reason}; mode {opts['mode']}")
        t0 = time.perf_counter()
        body = (profile_mode if opts["mode"] == "profile" else sweep_mode)(opts, info.rank, info.device)
        result = {"mode": opts["mode"], "world_size": info.world_size, "backend": info.backend,
                  "device": info.device.type, "device_reason": info.device_reason,
                  "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__, "options": opts,
                  **body, "elapsed_s": round(time.perf_counter() - t0, 2)}
        if info.is_main:
            path = Path(opts["out_dir"]) / f"{opts['mode']}.json"
            write_json(path, result)
            log(f"[ddp_profile] wrote {show(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
