"""torch.compile with DDP: the two wrapping orders, what compiling costs, and where it breaks.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l10_scaling.compile_ddp --out_dir=runs/compile_ddp
    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l10_scaling.compile_ddp --timing=true --backend=inductor

Every rank trains the same small MiniGPT on its own fixed batches, three ways, for ``--steps`` steps:

- **eager DDP** -- the reference;
- ``torch.compile(DDP(model))`` -- *compile the wrapped model* (order A, what PyTorch's DDP notes
  show: "Distributed Data Parallel", section "TorchDynamo DDPOptimizer"): dynamo sees DDP and its
  *DDPOptimizer* splits the graph at gradient-bucket boundaries, so each bucket's all-reduce can
  start while the backward of the earlier layers still runs;
- ``DDP(torch.compile(model))`` -- *wrap the compiled model* (order B, what PyTorch's newer guide
  "Where to apply torch.compile?" recommends, and what ``--compile`` in ``ddp_course.train`` does):
  DDP marks its forward so that dynamo applies DDPOptimizer here too (in the PyTorch versions the
  course runs; lesson 10 asserts it), so it is split the same way; DDP's hooks fire when the
  compiled backward hands back the gradients.

For each it records the losses (compared with eager DDP), the graphs the backend compiled (a counting
wrapper around ``--backend``), the first step's time (tracing and compiling) and whether the replicas
still agree. Then, on the order-A model, the known breakages, each measured: evaluation
(``eval()`` + ``no_grad``) and generation (growing sequence lengths) recompile, ``dynamic=False``
runs into the recompile limit, logs a warning and falls back to eager (``_compile`` in
``torch/_dynamo/convert_frame.py``), the state dict's keys change, and a bucket cap under 1 MiB is
refused by DDPOptimizer. Last, the course's safe pattern -- evaluate, generate and save through
``parallel.unwrap(model)`` -- measured to compile nothing.

``--backend=aot_eager`` (the default) traces exactly like the real compiler but generates no code:
fast, and enough to see graphs, recompiles and breakages. ``--timing=true`` adds the cost and the
gain: with ``--backend=inductor`` (which on a CPU needs a C++ compiler) the first step's compile time
against the eager and compiled steady-state step times, and whether inductor's on-disk cache served
the compiled code. ``--device=auto`` (default) runs on the GPUs with NCCL when every rank has one
(inductor then generates Triton kernels), else on the CPU with gloo; the first line says which.
Rank 0 writes ``compile_ddp.json`` into ``--out_dir``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course import parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.options import require_device
from ddp_course.course.tiny import VOCAB
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.paths import show

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l10_scaling.compile_ddp"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/compile_ddp",
    "backend": "aot_eager",  # aot_eager (trace, no code generation) | inductor | eager
    "steps": 4,  # training steps of each variant
    "n_layer": 1, "n_head": 4, "n_embd": 192, "block_size": 32,
    "micro_batch_size": 4,
    "bucket_cap_mb": 1.0,  # DDP's bucket cap; with ~1.8 MB of gradients DDPOptimizer splits the graph in two
    "gen_tokens": 8,  # sequence lengths 1 .. gen_tokens, as generation feeds them
    "recompile_limit": 4,  # dynamo's recompile limit during the dynamic=False demonstration (lowered from its default)
    "timing": False,  # also measure compile time against steady-state step time
    "timing_steps": 10,
    "breakages": True,
    "variants": "all",  # all, or a comma-separated subset of VARIANTS (the first, eager, is always run)
    "device": "auto",  # auto | cpu | cuda
    "timeout_s": 120.0,
    "seed": 0,
}
# Loss tolerance between a compiled and the eager run: compiled code may reorder float32 sums
# (fused kernels, decomposed LayerNorm backward), ~1e-6 relative per step on losses of ~4 (the lab
# prints each variant's gap); 1e-4 leaves a wide margin above it. It is no test of the averaging: a
# gradient summed instead of averaged is every gradient scaled by the world size, and AdamW's step does
# not change when every gradient is scaled by the same factor, as long as they stay well above its eps
# (lesson 04 section 6), which is why the lab also compares the replicas.
LOSS_ATOL = 1e-4


VARIANTS = ("eager", "compile(DDP(model))", "DDP(compile(model))", "compile(DDP(model)), optimize_ddp=False")


class CountingBackend:
    """A torch.compile backend that counts the graphs it is asked to compile, then hands them on."""

    def __init__(self, backend: str):
        self.backend = backend
        self.nodes: list[int] = []  # ops in each graph compiled (dynamo may copy the backend: count by this list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.nodes.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


class Recompiles(logging.Handler):
    """Collects dynamo's recompilation messages (why a guard failed), as TORCH_LOGS=recompiles prints them."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Recompiling function" in msg or "recompile_limit" in msg:
            self.messages.append(msg)

    def reasons(self, since: int = 0) -> list[str]:
        """One line per recompile: the first guard that failed ('- 0/0: GLOBAL_STATE changed: grad_mode')."""
        out = []
        for msg in self.messages[since:]:
            if "recompile_limit" in msg:
                out.append(msg.splitlines()[0])
                continue
            fails = [ln.strip().lstrip("- ").strip() for ln in msg.splitlines() if ln.strip().startswith("- ")
                     and ":" in ln and "File" not in ln and "User stack" not in ln]
            func = msg.split("Recompiling function", 1)[1].split(" in ", 1)[0].strip()
            out.append(f"{func}: {fails[0] if fails else msg.splitlines()[0]}")
        return out


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def batches(rank: int, steps: int, micro: int, block: int, seed: int,
            device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)  # each rank its own data (the same on any device)
    out = []
    for _ in range(steps):
        t = torch.randint(0, VOCAB, (micro, block + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def fresh_model(opts: dict[str, Any]) -> MiniGPT:
    """The same initial weights on every rank and in every variant, on ``opts["_device"]`` (set by main)."""
    torch.manual_seed(opts["seed"])
    return MiniGPT(GPTConfig(vocab_size=VOCAB, block_size=opts["block_size"], n_layer=opts["n_layer"],
                             n_head=opts["n_head"], n_embd=opts["n_embd"])).to(opts.get("_device", "cpu"))


def ddp(model: torch.nn.Module, bucket_cap_mb: float) -> DDP:
    """DDP around a model on this rank's device (its one GPU, or the CPU)."""
    device = next(model.parameters()).device
    return parallel.record(DDP(model, bucket_cap_mb=bucket_cap_mb,
                               device_ids=[device.index] if device.type == "cuda" else None), "ddp")


def train(model: torch.nn.Module, data, lr: float = 1e-3) -> tuple[list[float], list[float]]:
    """AdamW steps on the batches; returns (losses, seconds per step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for x, y in data:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # on a GPU: waits for every kernel queued so far, the step's included
        times.append(time.perf_counter() - t0)
    return losses, times


def replicas_agree(model: torch.nn.Module) -> float:
    """The largest difference between this rank's parameters and rank 0's (broadcast)."""
    flat = torch.cat([p.detach().reshape(-1) for p in parallel.unwrap(model).parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def variant(name: str, opts: dict[str, Any], data, rec: Recompiles) -> tuple[dict[str, Any], torch.nn.Module]:
    """Train one wrapping of a fresh model; what it compiled, how long the first step took, its losses."""
    torch._dynamo.reset()
    counter = CountingBackend(opts["backend"])
    model = fresh_model(opts)
    if name == "eager":
        wrapped = ddp(model, opts["bucket_cap_mb"])
    elif name.startswith("compile(DDP(model))"):
        wrapped = torch.compile(ddp(model, opts["bucket_cap_mb"]), backend=counter)
    else:  # DDP(compile(model))
        wrapped = ddp(torch.compile(model, backend=counter), opts["bucket_cap_mb"])
    g0, r0 = graphs(), len(rec.messages)
    split = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "optimize_ddp=False" not in name  # the control: DDPOptimizer off
    try:
        losses, times = train(wrapped, data)
    finally:
        torch._dynamo.config.optimize_ddp = split
    return {"variant": name, "losses": losses, "first_step_s": times[0],
            "later_step_s": statistics.median(times[1:]) if len(times) > 1 else None,
            "backend_compiles": len(counter.nodes), "ops_per_compiled_graph": list(counter.nodes),
            "dynamo_graphs": graphs() - g0, "recompiles": rec.reasons(r0),
            "replica_max_diff": replicas_agree(wrapped), "state_dict_keys": list(wrapped.state_dict())[:2]}, wrapped


def count_new(rec: Recompiles, fn) -> dict[str, Any]:
    """Run ``fn`` and report the graphs dynamo compiled meanwhile, and why it had to."""
    g0, r0 = graphs(), len(rec.messages)
    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- a breakage is a result here, reported as data
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        error = f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"
    return {"new_graphs": graphs() - g0, "reasons": rec.reasons(r0), "error": error}


def breakages(opts: dict[str, Any], compiled: torch.nn.Module, data, rec: Recompiles) -> dict[str, Any]:
    x, y = data[0]
    out: dict[str, Any] = {}

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            model(x, y)
        model.train()

    def generate_lengths(model):
        with torch.no_grad():
            for t in range(1, opts["gen_tokens"] + 1):  # what generate() feeds: 1, 2, 3, ... tokens
                model(x[:1, :t])

    out["evaluate"] = count_new(rec, lambda: evaluate(compiled))
    out["evaluate_again"] = count_new(rec, lambda: evaluate(compiled))
    out["generate"] = count_new(rec, lambda: generate_lengths(compiled))

    torch._dynamo.reset()
    static = torch.compile(ddp(fresh_model(opts), opts["bucket_cap_mb"]), backend=opts["backend"], dynamic=False)
    default_limit = int(torch._dynamo.config.recompile_limit)
    # The limit is lowered for the demonstration only (fewer compiles, the same mechanism); restored after.
    torch._dynamo.config.recompile_limit = min(default_limit, opts["recompile_limit"])
    try:
        out["generate_dynamic_false"] = count_new(rec, lambda: generate_lengths(static))
    finally:
        torch._dynamo.config.recompile_limit = default_limit
    out["generate_dynamic_false"].update(recompile_limit=min(default_limit, opts["recompile_limit"]),
                                         default_recompile_limit=default_limit, lengths=opts["gen_tokens"])

    keys = list(compiled.state_dict())
    plain = fresh_model(opts)
    load = count_new(rec, lambda: plain.load_state_dict(compiled.state_dict()))
    out["state_dict"] = {"first_keys": keys[:2], "load_into_plain_model_error": load["error"]}

    torch._dynamo.reset()
    small = torch.compile(ddp(fresh_model(opts), 0.5), backend=opts["backend"])
    out["bucket_cap_below_1mib"] = count_new(rec, lambda: small(x, y))
    out["bucket_cap_below_1mib"]["bucket_cap_mb"] = 0.5
    eager_small = ddp(fresh_model(opts), 0.5)
    out["bucket_cap_below_1mib"]["eager_ddp_error"] = count_new(rec, lambda: eager_small(x, y)[1].backward())["error"]
    return out


def safe_pattern(opts: dict[str, Any], data, rec: Recompiles) -> dict[str, Any]:
    """Train the compiled DDP model; evaluate, generate and save through the plain module inside it."""
    torch._dynamo.reset()
    model = torch.compile(ddp(fresh_model(opts), opts["bucket_cap_mb"]), backend=opts["backend"])
    train(model, data)
    inner = parallel.unwrap(model)  # the MiniGPT itself: eager, no DDP forward, no guards
    x, y = data[0]

    def evaluate_and_generate():
        inner.eval()
        with torch.no_grad():
            inner(x, y)
        inner.train()
        inner.generate(x[:1, :1], opts["gen_tokens"], generator=torch.Generator(device=x.device).manual_seed(0))

    res = count_new(rec, evaluate_and_generate)
    plain = fresh_model(opts)
    plain.load_state_dict(inner.state_dict())  # plain keys: loads into an uncompiled, unwrapped model
    res["saved_keys"] = list(inner.state_dict())[:2]
    res["train_after"] = count_new(rec, lambda: train(model, data[:1]))
    return res


def timing(opts: dict[str, Any], data) -> dict[str, Any]:
    """Compile time (first step) against steady-state step time, eager and compiled (order A)."""
    from torch._dynamo.utils import counters

    steps = [data[i % len(data)] for i in range(opts["timing_steps"] + 2)]
    out: dict[str, Any] = {"backend": opts["backend"]}
    for name in ("eager", "compile(DDP(model))"):
        torch._dynamo.reset()
        model = fresh_model(opts)
        wrapped = ddp(model, opts["bucket_cap_mb"])
        if name != "eager":
            wrapped = torch.compile(wrapped, backend=opts["backend"])
        hits0 = counters["inductor"]["fxgraph_cache_hit"]
        miss0 = counters["inductor"]["fxgraph_cache_miss"]
        dist.barrier()
        _, times = train(wrapped, steps)
        t = torch.tensor([times[0], statistics.median(times[2:])], dtype=torch.float64, device=data[0][0].device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        out[name] = {"first_step_s": t[0].item(), "steady_step_s": t[1].item(),
                     "fxgraph_cache_hits": counters["inductor"]["fxgraph_cache_hit"] - hits0,
                     "fxgraph_cache_misses": counters["inductor"]["fxgraph_cache_miss"] - miss0}
    e, c = out["eager"], out["compile(DDP(model))"]
    out["compile_s"] = c["first_step_s"] - e["steady_step_s"]
    out["saved_per_step_s"] = e["steady_step_s"] - c["steady_step_s"]
    out["break_even_steps"] = (out["compile_s"] / out["saved_per_step_s"]) if out["saved_per_step_s"] > 0 else None
    return out


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    require_device(opts["device"])  # a device this machine has
    with setup(device=opts["device"], timeout_s=opts["timeout_s"], threads=1) as info:
        if not info.is_distributed:
            raise FlagError(f"run it with torchrun: {PROG}")
        log(f"[compile_ddp] {info.world_size} ranks, {info.device_reason}; backend {opts['backend']}")
        opts = {**opts, "_device": info.device}
        rec = Recompiles()
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(rec)
        data = batches(info.rank, opts["steps"], opts["micro_batch_size"], opts["block_size"], opts["seed"],
                       info.device)
        result: dict[str, Any] = {"torch": torch.__version__, "world_size": info.world_size,
                                  "options": {k: v for k, v in opts.items() if k != "_device"},
                                  "backend": info.backend, "device": info.device.type,
                                  "device_reason": info.device_reason}
        variants, section_s = {}, {}
        chosen = VARIANTS if opts["variants"] == "all" else ("eager", *(
            v.strip() for v in opts["variants"].split(",") if v.strip() and v.strip() != "eager"))
        unknown = [v for v in chosen if v not in VARIANTS]
        if unknown or (opts["breakages"] and "compile(DDP(model))" not in chosen):
            raise FlagError(f"--variants must name some of {', '.join(VARIANTS)} (and include compile(DDP(model)) "
                            f"when --breakages=true); got {opts['variants']!r}")
        for name in chosen:
            t0 = time.perf_counter()
            res, model = variant(name, opts, data, rec)
            section_s[name] = time.perf_counter() - t0
            variants[name] = res
            if name == "compile(DDP(model))":
                order_a = model
            log(f"[compile_ddp] {name}: first step {res['first_step_s']:.2f}s, {res['backend_compiles']} graph(s) "
                f"compiled, losses {', '.join(f'{v:.4f}' for v in res['losses'])}")
        ref = variants["eager"]["losses"]
        for res in variants.values():
            res["max_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(res["losses"], ref))
            res["matches_eager"] = res["max_loss_diff_vs_eager"] <= LOSS_ATOL
        result["variants"] = variants
        result["loss_atol"] = LOSS_ATOL
        if opts["breakages"]:
            t0 = time.perf_counter()
            result["breakages"] = breakages(opts, order_a, data, rec)
            section_s["breakages"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            result["safe_pattern"] = safe_pattern(opts, data, rec)
            section_s["safe_pattern"] = time.perf_counter() - t0
        if opts["timing"]:
            t0 = time.perf_counter()
            result["timing"] = timing(opts, data)
            section_s["timing"] = time.perf_counter() - t0
        result["section_s"] = section_s
        if info.is_main:
            path = Path(opts["out_dir"]) / "compile_ddp.json"
            write_json(path, result)
            log(f"[compile_ddp] wrote {show(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
