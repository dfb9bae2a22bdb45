"""FSDP measured: shards, memory, one step's collectives, and equivalence with DDP -- one launch.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l09_fsdp.fsdp_lab --out_dir=runs/fsdp_lab
    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l09_fsdp.fsdp_lab --variants=ddp,fsdp,fsdp_hybrid

Every rank trains MiniGPT with each variant in ``--variants`` in turn, from the same initial weights
on the same batches (the course's data, ``train_batches``), through the course's own pieces:
``parallel.wrap`` (the strategy), ``train.build_optimizer`` (AdamW), ``train.train_step``. Variants:

- ``ddp``: the reference; ``fsdp``: FSDP2 full shard (ZeRO-3); ``fsdp_noreshard``: FSDP2 keeping the
  gathered parameters from forward to backward (ZeRO-2-like); ``fsdp_bf16``: FSDP2 with
  ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduce); ``fsdp_hybrid``: FSDP2 on a 2-D mesh
  (replicas x half the ranks); ``fsdp_ac``: FSDP2 with activation checkpointing;
  ``fsdp1``, ``fsdp1_noreshard`` (``SHARD_GRAD_OP``), ``fsdp1_hybrid``: FSDP1 for comparison.

For each variant, the first step is measured: the bytes autograd saves in forward
(``memory.saved_activations``), then, after the optimizer step, the bytes of parameters, gradients
and AdamW states on this rank (``memory.measure_states``), next to the calculator's prediction
(``memory.predict``); on a GPU the allocator's peak as well. Then the losses of every step, the
median step time (and every timed step's, for the spread), and the final parameters gathered in
full (``get_model_state_dict(..., full_state_dict=True)``) compared with DDP's.

Also, with ``--trace=true``: the shapes of every parameter's local shard on each rank under FSDP2,
and a profiler trace of one FSDP2 step (``trace_fsdp.json``, for chrome://tracing or Perfetto)
reduced to its FSDP ranges and collectives. With ``--checkpoints=true``: save with FSDP2, load into
DDP, and the reverse, through ``ddp_course.checkpoint`` (sharded and full formats), compared to the
last bit. With ``--fsdp1_hybrid_bug=true``: FSDP1 ``HYBRID_SHARD`` with one rank per shard group
built by hand (the course refuses it), showing that its ranks' gradients are never averaged.

Rank 0 writes ``fsdp_lab.json`` into ``--out_dir``.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ddp_course import checkpoint, parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import ConfigError, TrainConfig
from ddp_course.course.l09_fsdp import memory
from ddp_course.data import prepare, train_batches
from ddp_course.dist import all_reduce_mean, log, seed_everything, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import build_optimizer, lr_at, train_step

PROG = "python -m ddp_course.course.l09_fsdp.fsdp_lab"
# name -> (strategy, TrainConfig overrides); hybrid variants use half the ranks per shard group
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "fsdp": ("fsdp", {}),
    "fsdp_noreshard": ("fsdp", {"reshard_after_forward": False}),
    "fsdp_bf16": ("fsdp", {"fsdp_mixed_precision": True}),
    "fsdp_hybrid": ("fsdp", {"fsdp_shard_size": -1}),
    "fsdp_ac": ("fsdp", {"activation_checkpointing": True}),
    "fsdp1": ("fsdp1", {}),
    "fsdp1_noreshard": ("fsdp1", {"reshard_after_forward": False}),
    "fsdp1_hybrid": ("fsdp1", {"fsdp_shard_size": -1}),
}
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/fsdp_lab",
    "variants": "ddp,fsdp,fsdp_noreshard,fsdp_bf16,fsdp1",
    "steps": 6,  # optimizer steps per variant
    "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 32, "micro_batch_size": 4,
    "lr": 1e-3, "warmup_steps": 2, "seed": 1337, "corpus": "tinyshakespeare",
    "trace": False,  # shard shapes per rank and a profiler trace of one FSDP2 step
    "checkpoints": False,  # save with FSDP2 / load into DDP and the reverse
    "fsdp1_hybrid_bug": False,  # the FSDP1 HYBRID_SHARD trap, built by hand
    "device": "auto", "timeout_s": 120.0,
}
COLLECTIVES = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::allreduce_")


def variant_config(name: str, opts: dict[str, Any], world_size: int) -> TrainConfig:
    if name not in VARIANTS:
        raise FlagError(f"{PROG}: unknown variant {name!r}; choose from {', '.join(VARIANTS)}.")
    strategy, extra = VARIANTS[name]
    extra = dict(extra)
    if extra.get("fsdp_shard_size") == -1:
        if world_size < 4 or world_size % 2:
            raise FlagError(f"{PROG}: variant {name} shards over half the ranks and needs 4 or more (an even number); "
                            f"this job has {world_size}.")
        extra["fsdp_shard_size"] = world_size // 2
    keys = ("n_layer", "n_head", "n_embd", "block_size", "micro_batch_size", "lr", "warmup_steps", "seed", "corpus")
    return TrainConfig(strategy=strategy, max_steps=opts["steps"], min_lr=opts["lr"] / 10,
                       **{k: opts[k] for k in keys}, **extra)


def shape_of(cfg: TrainConfig, vocab_size: int) -> dict[str, int]:
    return {"vocab_size": vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_embd": cfg.n_embd}


def build(cfg: TrainConfig, info, vocab_size: int):
    """Model (same seed on every rank), wrapped by the strategy, and the course's AdamW."""
    seed_everything(cfg.seed)
    model = MiniGPT(GPTConfig.from_train(cfg, vocab_size)).to(info.device)
    model = parallel.wrap(model, info, cfg)
    return model, build_optimizer(model, cfg, info.device)


def gather_objects(obj: Any, info) -> list[Any]:
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter in full, on every rank (a collective for FSDP)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], init: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far parameters ``a`` are from the reference ``b`` (both trained from ``init``).

    ``max_abs_diff``: the largest elementwise difference. ``update_rel_diff``: the difference of the
    two training updates relative to the reference's update, ||(a - init) - (b - init)|| / ||b - init||
    over all parameters -- 0 for identical training, about 1 or more when the updates are unrelated.
    """
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in b)
    num = sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in b) ** 0.5
    den = sum(((b[k].float() - init[k].float()) ** 2).sum().item() for k in b) ** 0.5
    return {"max_abs_diff": diff, "update_rel_diff": num / den,
            "bitwise_equal": all(torch.equal(a[k], b[k]) for k in b)}


def run_variant(name: str, opts: dict[str, Any], info, data) -> tuple[dict[str, Any], Any, Any, TrainConfig]:
    cfg = variant_config(name, opts, info.world_size)
    vocab = data.tokenizer.vocab_size
    model, optimizer = build(cfg, info, vocab)
    batches = train_batches(data.train, cfg.micro_batch_size, info.rank, info.world_size, cfg.seed)
    device = info.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    # step 0, measured: what autograd saves in forward, and the states after the optimizer step
    x, y = (t.to(device) for t in next(batches))
    for group in optimizer.param_groups:
        group["lr"] = lr_at(0, cfg)
    t0 = time.perf_counter()
    with memory.saved_activations() as acts:
        _, loss = model(x, y)
    loss.backward()
    parallel.clip_grad_norm_(model, cfg.grad_clip)
    optimizer.step()
    measured = {**memory.measure_states(model, optimizer), "activations": acts.bytes}
    optimizer.zero_grad(set_to_none=True)
    cuda = memory.cuda_memory(device)
    losses = [all_reduce_mean(loss.detach(), info)]
    times = [time.perf_counter() - t0]

    for step in range(1, cfg.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        micro = [tuple(t.to(device) for t in next(batches))]
        dist.barrier()  # a step starts together on every rank, so its time is the slowest rank's
        t0 = time.perf_counter()
        loss, _ = train_step(model, optimizer, None, micro, device=device, precision=cfg.precision,
                             grad_clip=cfg.grad_clip)
        loss_value = all_reduce_mean(loss, info)  # waits for every rank: the step is done everywhere
        times.append(time.perf_counter() - t0)
        losses.append(loss_value)

    predicted = memory.predict_cfg(cfg, info.world_size, vocab, device_type=device.type)[info.rank]
    row = {"variant": name, "strategy": cfg.strategy, "reshard_after_forward": cfg.reshard_after_forward,
           "fsdp_shard_size": cfg.fsdp_shard_size, "mixed_precision": cfg.fsdp_mixed_precision,
           "activation_checkpointing": cfg.activation_checkpointing, "losses": losses,
           "step_time_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
           "step_times_s": times[1:] if len(times) > 1 else times,  # the timed steps, for their spread
           "measured": measured, "predicted": predicted, "cuda": cuda}
    return row, model, optimizer, cfg


def local_shards(model, info) -> dict[str, Any]:
    """Per parameter: full shape, and each rank's local shape and storage size (gathered to every rank)."""
    mine = memory.local_shapes(model)
    return {"per_rank": gather_objects(mine, info)}


def trace_one_step(model, optimizer, cfg, info, data, out_dir: Path) -> dict[str, Any]:
    """Profile one FSDP2 step; keep its FSDP ranges and collectives in ms from the step's start (rank 0's)."""
    import json

    from torch.profiler import ProfilerActivity, profile, record_function

    batches = train_batches(data.train, cfg.micro_batch_size, info.rank, info.world_size, cfg.seed + 1)
    x, y = (t.to(info.device) for t in next(batches))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step"):
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if not info.is_main:
        return {}
    path = out_dir / "trace_fsdp.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
              if e.get("ph") == "X" and "dur" in e]
    step = next(e for e in events if e["name"] == "step")
    t0 = step["ts"]

    def span(e) -> dict[str, Any]:
        return {"name": e["name"], "start_ms": (e["ts"] - t0) / 1e3, "dur_ms": e["dur"] / 1e3}

    fsdp = [span(e) for e in events if str(e["name"]).startswith("FSDP::")]
    comm = [span(e) for e in events if e["name"] in COLLECTIVES]
    backend = [span(e) for e in events if str(e["name"]).startswith(("gloo:", "nccl:", "record_param_comms"))]
    phases = {"step": span(step)}
    return {"fsdp": sorted(fsdp, key=lambda s: s["start_ms"]), "collectives": sorted(comm, key=lambda s: s["start_ms"]),
            "backend": sorted(backend, key=lambda s: s["start_ms"]), "phases": phases, "file": str(path)}


def optimizer_full(model, optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def same_optimizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a["state"], b["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(_full(sa[k][n]), _full(sb[k][n])) for k in sa for n in sa[k])


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def checkpoints_across(opts: dict[str, Any], info, data, out_dir: Path) -> dict[str, Any]:
    """Train a few steps with one strategy, save, load into the other; compare model and AdamW state bit for bit."""
    vocab = data.tokenizer.vocab_size
    results = {}
    for src, dst in (("fsdp", "ddp"), ("ddp", "fsdp")):
        for fmt in ("sharded", "full"):
            cfg_src = variant_config(src, {**opts, "steps": 2}, info.world_size)
            model, optimizer = build(cfg_src, info, vocab)
            batches = train_batches(data.train, cfg_src.micro_batch_size, info.rank, info.world_size, cfg_src.seed)
            for _ in range(2):
                train_step(model, optimizer, None, [next(batches)], device=info.device, precision="fp32",
                           grad_clip=cfg_src.grad_clip)
            run_dir = out_dir / f"ckpt_{src}_{fmt}"
            if info.is_main:  # a fresh folder: a re-run must not find the previous run's step 2 in the way
                shutil.rmtree(run_dir, ignore_errors=True)
            dist.barrier()
            shape = shape_of(cfg_src, vocab)
            saved = checkpoint.save(run_dir, checkpoint.TrainState(model, optimizer, parallel.strategy_of(model),
                                                                 shape, step=2), info, fmt=fmt, keep_last=1)
            path = checkpoint.checkpoint_path(run_dir, 2, fmt)
            want_model, want_optim = full_state(model), optimizer_full(model, optimizer)

            cfg_dst = variant_config(dst, opts, info.world_size)
            model2, optimizer2 = build(cfg_dst.replace(seed=cfg_dst.seed + 1), info, vocab)  # other weights first
            meta = checkpoint.resume(path, checkpoint.TrainState(model2, optimizer2, parallel.strategy_of(model2),
                                                                 shape), info)
            got_model, got_optim = full_state(model2), optimizer_full(model2, optimizer2)
            results[f"{src}->{dst} ({fmt})"] = {
                "path": str(saved) if saved else str(path), "step": int(meta["step"]),
                "model_bitwise_equal": all(torch.equal(want_model[k], got_model[k]) for k in want_model),
                "optimizer_bitwise_equal": same_optimizer(want_optim, got_optim)}
    return results


def fsdp1_hybrid_bug(opts: dict[str, Any], info, data) -> dict[str, Any]:
    """FSDP1 HYBRID_SHARD with one rank per shard group, built by hand, vs FSDP2 on the same 2-D mesh.

    Each rank back-propagates its own batch; after the backward, data parallelism must leave the
    same (averaged) gradient on every rank. Reports each rank's gradient norm for both.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ddp_course.model import Block

    cfg = variant_config("fsdp1", opts, info.world_size).replace(fsdp_shard_size=1)
    try:  # what the course says when asked for it
        parallel.wrap(MiniGPT(GPTConfig.from_train(cfg, data.tokenizer.vocab_size)), info, cfg)
        refusal = None
    except ConfigError as exc:
        refusal = str(exc)
    x, y = (t.to(info.device) for t in next(train_batches(data.train, cfg.micro_batch_size, info.rank,
                                                           info.world_size, cfg.seed)))
    norms = {}
    for name in ("own_batch_only", "ddp", "fsdp1_hybrid_shard1_by_hand", "fsdp2_shard_size_1"):
        seed_everything(cfg.seed)
        model = MiniGPT(GPTConfig.from_train(cfg, data.tokenizer.vocab_size)).to(info.device)
        if name.startswith("fsdp1"):
            mesh = init_device_mesh(info.device.type, (info.world_size, 1), mesh_dim_names=("replicate", "shard"))
            model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                         device_id=info.device, sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
        elif name != "own_batch_only":  # own_batch_only: no communication at all, this rank's gradient
            model = parallel.wrap(model, info, cfg.replace(strategy=name.split("_")[0].replace("fsdp2", "fsdp")))
        _, loss = model(x, y)
        loss.backward()
        grads = [memory._local(p.grad) for p in model.parameters() if p.grad is not None]
        norms[name] = gather_objects(torch.cat([g.flatten() for g in grads]).norm().item(), info)
    return {"refusal": refusal, "grad_norm_per_rank": norms}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__)
    names = [v for v in opts["variants"].split(",") if v]
    for n in names:
        if n not in VARIANTS:
            raise FlagError(f"{PROG}: unknown variant {n!r}; choose from {', '.join(VARIANTS)}.")
    out_dir = Path(opts["out_dir"])
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed:
            raise FlagError(f"{PROG} compares strategies across ranks: launch it with torchrun "
                            f"(torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l09_fsdp.fsdp_lab).")
        for n in names:
            variant_config(n, opts, info.world_size)  # a variant this world size cannot run: FlagError
        data = prepare(opts["corpus"], opts["block_size"], 0.1, announce=lambda m: None)
        report: dict[str, Any] = {"world_size": info.world_size, "device": str(info.device), "backend": info.backend,
                                  "options": opts, "vocab_size": data.tokenizer.vocab_size, "variants": {}}
        if info.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        reference = None
        init = full_state(build(variant_config("ddp", opts, info.world_size), info, data.tokenizer.vocab_size)[0])
        for name in names:
            row, model, optimizer, cfg = run_variant(name, opts, info, data)
            final = full_state(model)
            if reference is None and name == "ddp":
                reference = final
            row["vs_ddp"] = compare(final, reference, init) if reference is not None and name != "ddp" else None
            ranks = gather_objects({k: row[k] for k in ("measured", "predicted", "cuda", "step_time_s", "step_times_s")},
                                   info)
            row["per_rank"] = ranks
            # each timed step as the slowest rank saw it (the steps start together, after a barrier), and
            # their median: the step time the lesson reports, with the spread of the same steps beside it
            row["step_times_s"] = [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))]
            row["step_time_s"] = statistics.median(row["step_times_s"])
            for k in ("measured", "predicted", "cuda"):
                row.pop(k)
            if opts["trace"] and name == "fsdp":
                report["shards"] = local_shards(model, info)
                report["trace"] = trace_one_step(model, optimizer, cfg, info, data, out_dir)
            report["variants"][name] = row
            diff = (f", max |param - DDP| {row['vs_ddp']['max_abs_diff']:.2e}, update differs by "
                    f"{row['vs_ddp']['update_rel_diff']:.1e}" if row["vs_ddp"] else "")
            log(f"{name:<16} loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}, step {row['step_time_s'] * 1e3:.1f} ms,"
                f" states {ranks[0]['measured']['states']:,} B on rank 0 (predicted "
                f"{ranks[0]['predicted']['states']:,.0f}){diff}")
            del model, optimizer
        if opts["checkpoints"]:
            report["checkpoints"] = checkpoints_across(opts, info, data, out_dir)
            for k, v in report["checkpoints"].items():
                log(f"checkpoint {k}: model equal {v['model_bitwise_equal']}, AdamW equal {v['optimizer_bitwise_equal']}")
        if opts["fsdp1_hybrid_bug"]:
            report["fsdp1_hybrid_bug"] = fsdp1_hybrid_bug(opts, info, data)
            log(f"FSDP1 HYBRID_SHARD, 1 rank per shard group: gradient norms per rank "
                f"{report['fsdp1_hybrid_bug']['grad_norm_per_rank']}")
        if info.is_main:
            write_json(out_dir / "fsdp_lab.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
