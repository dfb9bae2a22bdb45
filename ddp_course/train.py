"""THE training loop of the course. Every strategy runs through it.

One process (no process group)::

    python -m ddp_course.train --max_steps=200

Two processes with DistributedDataParallel (gloo on CPU, NCCL when each rank has a GPU)::

    torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=ddp

``python -m ddp_course.train --help`` lists every option. Rank 0 writes ``config.json``,
``metrics.jsonl`` and ``summary.json`` into ``--out_dir``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course import checkpoint, parallel
from ddp_course.config import ConfigError, TrainConfig, parse_cli
from ddp_course.data import CorpusError, prepare, stream_batches, train_batches, val_batches
from ddp_course.dist import DeviceError, DistInfo, all_reduce_mean, log, seed_everything, setup
from ddp_course.metrics import MetricsWriter, environment, mfu, peak_memory, reset_peak_memory, write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.paths import show

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm gains or position tables)."""
    ndims = parallel.param_ndims(model)  # as the model defined them (FSDP1 shows flat 1-D shards)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if ndims[name] >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused on CUDA: one kernel for the whole update. On CPU, PyTorch's default path (one tensor at a
    # time) is kept, so CPU results stay comparable across the torch versions the course supports.
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def autocast(device: torch.device, precision: str):
    """Autocast to bf16/fp16 on this device type, or nothing for fp32.

    fp32 stays IEEE fp32 on a GPU too: the course leaves PyTorch's default float32 matmul precision
    ("highest", not TF32), because lessons compare fp32 runs across strategies and ``bench amp`` times
    TF32 as a variant of its own. Under bf16/fp16 autocast every matmul of MiniGPT runs in 16 bits, so
    that setting does not touch them (``tests/test_bench_gpu.py`` checks it).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def make_scaler(device: torch.device, precision: str):
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def train_step(model, optimizer, scaler, micro_batches: Iterable, *, device: torch.device, precision: str,
               grad_clip: float, no_sync: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over K micro-batches; returns (mean loss, gradient norm) as tensors.

    Each micro-batch's loss is divided by K, so the accumulated gradient is the gradient of the mean
    loss over all K micro-batches. With ``no_sync`` (DDP), the non-final micro-steps run forward and
    backward inside ``model.no_sync()`` and only the last one all-reduces.
    """
    micro_batches = list(micro_batches)
    k_total = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    for k, (x, y) in enumerate(micro_batches):
        last = k == k_total - 1
        with parallel.sync_context(model, sync=last or not no_sync):
            with autocast(device, precision):
                _, loss = model(x, y)
            loss = loss / k_total
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = parallel.clip_grad_norm_(model, grad_clip) if grad_clip > 0 else None  # over every rank's shard (FSDP)
    if scaler is not None:
        scaler.step(optimizer)  # skipped if the gradients hold inf/nan
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, batches, info: DistInfo, precision: str) -> float:
    """Mean validation loss over this rank's batches, averaged over ranks (one all_reduce)."""
    model.eval()
    total = torch.zeros((), device=info.device, dtype=torch.float64 if info.device.type == "cpu" else torch.float32)
    for x, y in batches:
        with autocast(info.device, precision):
            _, loss = model(x.to(info.device), y.to(info.device))
        total += loss.float()
    model.train()
    return all_reduce_mean(total / max(1, len(batches)), info)


def _check_precision(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("--precision=bf16 needs a GPU with bfloat16 support (Ampere or newer); "
                          "use --precision=fp16 (with its GradScaler) or fp32 on this GPU.")


def _shape(cfg: TrainConfig, vocab_size: int) -> dict[str, int]:
    return {"block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_embd": cfg.n_embd, "vocab_size": vocab_size}


def run_training(cfg: TrainConfig, info: DistInfo) -> dict:
    """The loop itself, inside an initialised process group (or a single process)."""
    cfg = cfg.replace()  # never mutate the caller's config
    cfg.resolve_batch(info.world_size)
    device = info.device
    _check_precision(cfg, device)
    out_dir = Path(cfg.out_dir)
    global_batch = cfg.global_batch(info.world_size)
    tokens_per_step = global_batch * cfg.block_size
    log(f"[ddp_course] {info.world_size} process(es) on {info.device_reason}; strategy={cfg.strategy}, "
        f"precision={cfg.precision}, global batch {cfg.micro_batch_size} x {cfg.grad_accum_steps} accum x "
        f"{info.world_size} rank(s) = {global_batch} sequences ({tokens_per_step} tokens) per step")

    data = prepare(cfg.corpus, cfg.block_size, cfg.val_fraction, announce=log)
    seed_everything(cfg.seed)  # same seed on every rank: identical initial models
    model = MiniGPT(GPTConfig.from_train(cfg, data.tokenizer.vocab_size)).to(device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if cfg.compile:
        model = torch.compile(model)
    model = parallel.wrap(model, info, cfg)
    # devices doing the arithmetic, for MFU: one per rank, or all of DataParallel's replicas
    n_devices = info.world_size * len(getattr(model, "device_ids", None) or [0])
    optimizer = build_optimizer(model, cfg, device)
    scaler = make_scaler(device, cfg.precision)
    shape = _shape(cfg, data.tokenizer.vocab_size)

    start_step = start_batch = 0
    if cfg.resume:
        path = checkpoint.latest(out_dir)
        if path is None:
            log(f"[ddp_course] --resume: no checkpoint in {show(checkpoint.ckpt_dir(out_dir))}; starting from step 0")
        else:  # every rank loads (a collective); model, optimizer, scaler, this rank's RNG, data position
            meta = checkpoint.resume(path, model, optimizer, scaler, info, shape)
            start_step = meta["step"]
            start_batch = checkpoint.start_batch(meta, micro_batch_size=cfg.micro_batch_size,
                                                 world_size=info.world_size, grad_accum_steps=cfg.grad_accum_steps)
            dropped = checkpoint.drop_metrics_after(out_dir, start_step) if info.is_main else 0
            log(f"[ddp_course] resumed from {show(path)} at step {start_step} (saved by {meta['world_size']} rank(s); "
                f"data from micro-batch {start_batch}{f'; {dropped} metrics rows after it dropped' if dropped else ''})")

    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "config.json", {
            **cfg.to_dict(), "world_size": info.world_size, "backend": info.backend, "device": str(device),
            "device_reason": info.device_reason, "corpus_source": data.corpus.source,
            "vocab_size": data.tokenizer.vocab_size, "n_params": n_params, "flops_per_token": flops_per_token,
            "global_batch_size_resolved": global_batch, "tokens_per_step": tokens_per_step,
            "versions": environment()})
        log(f"[ddp_course] corpus {data.corpus.name} from {show(data.corpus.source)}: {len(data.corpus.text):,} characters,"
            f" vocabulary {data.tokenizer.vocab_size}; model {n_params:,} parameters")
    metrics = MetricsWriter(out_dir, enabled=info.is_main, append=start_step > 0)

    pin = device.type == "cuda"
    if cfg.data_order == "stream":  # random windows, rank-offset slices of one draw (no sampler, no epochs)
        train_iter = stream_batches(data.train.tokens, cfg.block_size, cfg.micro_batch_size, info.rank,
                                    info.world_size, cfg.seed, start_batch=start_batch, pin_memory=pin)
    else:
        train_iter = train_batches(data.train, cfg.micro_batch_size, info.rank, info.world_size, cfg.seed,
                                   start_batch=start_batch, num_workers=cfg.num_workers,
                                   pin_memory=pin)
    per_epoch = len(data.train) // info.world_size // cfg.micro_batch_size if cfg.data_order == "sampler" else None
    if start_step and per_epoch and start_batch % per_epoch:  # resumed mid-epoch: see the helper's docstring
        train_iter = checkpoint.restore_rng_after_first(train_iter, meta, info)
    val = val_batches(data.val, cfg.micro_batch_size, cfg.eval_batches, info.rank, info.world_size)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    reset_peak_memory(device)
    model.train()
    t_start = time.perf_counter()
    t_interval, train_time, steady_time, steady_tokens = t_start, 0.0, 0.0, 0
    loss_avg, val_loss, first_interval, last_logged = float("nan"), None, True, start_step
    interval_loss = torch.zeros((), device=device)
    for step in range(start_step, cfg.max_steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [(x.to(device, non_blocking=pin), y.to(device, non_blocking=pin))
                 for x, y in (next(train_iter) for _ in range(cfg.grad_accum_steps))]
        loss, grad_norm = train_step(model, optimizer, scaler, micro, device=device, precision=cfg.precision,
                                     grad_clip=cfg.grad_clip, no_sync=cfg.no_sync)
        interval_loss += loss  # summed on the device: no sync until the next log row
        done = step + 1
        # fault injection; only on torchrun's first attempt, so that a restarted job (--max-restarts) can finish
        if (done - 1 == cfg.fail_at_step and info.rank == cfg.fail_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            raise RuntimeError(f"injected failure on rank {info.rank} at step {done - 1} (--fail_at_step)")

        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            n_steps, last_logged = done - last_logged, done
            # mean over the interval's steps and over ranks: a sync point, every rank takes part
            loss_avg = all_reduce_mean(interval_loss / n_steps, info)
            interval_loss = torch.zeros((), device=device)
            sync()
            dt = time.perf_counter() - t_interval
            tps = tokens_per_step * n_steps / dt
            train_time += dt
            if not first_interval:  # the first interval holds warm-up (allocations, first kernels)
                steady_time += dt
                steady_tokens += tokens_per_step * n_steps
            first_interval = False
            row = {"step": done, "loss": loss_avg, "lr": lr, "tokens_per_s": tps}
            if grad_norm is not None:
                row["grad_norm"] = float(grad_norm)
            u = mfu(flops_per_token, tps, n_devices, device, cfg.precision)
            if u is not None:
                row["mfu"] = u
            metrics.write(row)
            log(f"step {done:>5}/{cfg.max_steps}  loss {loss_avg:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s")
            t_interval = time.perf_counter()

        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == cfg.max_steps:
            t0 = time.perf_counter()
            val_loss = evaluate(model, val, info, cfg.precision)
            metrics.write({"step": done, "val_loss": val_loss})
            log(f"step {done:>5}/{cfg.max_steps}  val_loss {val_loss:.4f}")
            t_interval += time.perf_counter() - t0  # evaluation time is not training throughput

        if cfg.ckpt_interval and done % cfg.ckpt_interval == 0:
            t0 = time.perf_counter()
            position = checkpoint.data_position(done, micro_batch_size=cfg.micro_batch_size, world_size=info.world_size,
                                                grad_accum_steps=cfg.grad_accum_steps, batches_per_epoch=per_epoch)
            path = checkpoint.save(out_dir, done, model, optimizer, scaler, info, shape, keep_last=cfg.keep_last,
                                   fmt=cfg.ckpt_format, position=position)  # every rank calls it (collectives)
            if path is not None:
                log(f"[ddp_course] checkpoint {show(path)}")
            t_interval += time.perf_counter() - t0

    if cfg.ckpt_interval:  # final.pt: the final parameters, for comparing runs (every rank calls it)
        checkpoint.save_final(out_dir, cfg.max_steps, model, info)
    wall = time.perf_counter() - t_start
    mem = peak_memory(device)
    steps_run = cfg.max_steps - start_step
    tokens_per_s = steady_tokens / steady_time if steady_time > 0 else (
        tokens_per_step * steps_run / train_time if train_time > 0 else 0.0)
    summary = {
        "final_loss": loss_avg, "final_val_loss": val_loss, "steps": cfg.max_steps, "steps_run": steps_run,
        "total_tokens": tokens_per_step * steps_run, "wall_time_s": wall, "tokens_per_s": tokens_per_s,
        "mfu": mfu(flops_per_token, tokens_per_s, n_devices, device, cfg.precision),
        "world_size": info.world_size, "backend": info.backend, "device": str(device), **mem,
    }
    if info.is_distributed:  # the largest peak over ranks is the one that decides what fits
        peak = torch.tensor([mem["peak_memory_bytes"]], dtype=torch.float64 if device.type == "cpu" else torch.float32,
                            device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        summary["peak_memory_bytes_max_rank"] = int(peak.item())
    sampler = parallel.gathered(model) if cfg.sample_tokens > 0 else None  # every rank: FSDP gathers the full model
    if sampler is not None and info.is_main:
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        start = torch.tensor([data.tokenizer.encode("\n")], device=device)
        out = sampler.generate(start, cfg.sample_tokens, temperature=0.8, top_k=20, generator=gen)
        summary["sample"] = data.tokenizer.decode(out[0, 1:])
    if info.is_main:
        write_json(out_dir / "summary.json", summary)
        log(f"[ddp_course] done: {steps_run} steps in {wall:.1f}s, {tokens_per_s:,.0f} tokens/s, "
            f"final loss {loss_avg:.4f}, val_loss {val_loss if val_loss is None else round(val_loss, 4)}; "
            f"wrote {show(out_dir / 'summary.json')}")
    metrics.close()
    return summary


def main(cfg: TrainConfig) -> dict:
    """Join the process group (if launched by torchrun), train, always tear down. Returns the summary."""
    with setup(cfg.device, cfg.timeout_s, cfg.threads) as info:
        return run_training(cfg, info)


@record  # on failure, torchrun's error file carries this rank's traceback
def cli(argv: list[str] | None = None) -> None:
    try:
        cfg = parse_cli(sys.argv[1:] if argv is None else argv)
        main(cfg)
    except (ConfigError, DeviceError, CorpusError, checkpoint.CheckpointError) as exc:
        # a clear one-paragraph message instead of a traceback: the fix is in the message
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
