"""THE training loop of the course. Every strategy runs through it.

One process (no process group)::

    python -m ddp_course.train --max_steps=200

Two processes with DistributedDataParallel (gloo on CPU, NCCL when each rank has a GPU)::

    torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=ddp

``python -m ddp_course.train --help`` lists every option. Rank 0 writes ``config.json``,
``metrics.jsonl`` and ``summary.json`` into ``--out_dir``. Bad input (an option, a strategy this
launch cannot run, a batch that does not split over the ranks, an ``--out_dir`` that cannot be
written) is refused before the process group is joined: one ``error:`` paragraph and exit code 2.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course import checkpoint, parallel
from ddp_course.cli import HELP_FLAGS
from ddp_course.config import ConfigError, TrainConfig, check_out_dir, help_text, parse_cli
from ddp_course.data import Batch, CorpusError, Data, DataPosition, prepare, stream_batches, train_batches, val_batches
from ddp_course.dist import DeviceError, DistInfo, all_reduce_mean, launched_by_torchrun, log, seed_everything, setup
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


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of the strategy that wrapped ``model`` (``ddp_course.parallel``): AdamW with weight
    decay on matrices only (not on biases, LayerNorm gains or position tables), its state sharded where
    the strategy shards it. (The training job, which holds its plan, asks the plan itself.)"""
    return parallel.strategy_of(model).build_optimizer(model, cfg, device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to bf16/fp16 on this device type, or nothing for fp32.

    fp32 stays IEEE fp32 on a GPU too: the course leaves PyTorch's default float32 matmul precision
    ("highest", not TF32), because lessons compare fp32 runs across strategies and ``bench amp`` times
    TF32 as a variant of its own. Under bf16/fp16 autocast every matmul of MiniGPT runs in 16 bits, so
    that setting does not touch them (``tests/lessons/test_bench_gpu.py`` checks it).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def make_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling (its range is narrow); bf16 and fp32 do not."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
               micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *, device: torch.device, precision: str,
               grad_clip: float, no_sync: bool = True, plan: parallel.Strategy | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over K micro-batches; returns (mean loss, gradient norm) as tensors.

    Each micro-batch's loss is divided by K, so the accumulated gradient is the gradient of the mean
    loss over all K micro-batches. With ``no_sync`` (DDP), the non-final micro-steps run forward and
    backward inside ``model.no_sync()`` and only the last one all-reduces. A strategy with a step of its
    own (``forward_backward``: a pipeline's schedule) runs the forwards and backwards instead; the clip
    and the optimizer step are the loop's either way. ``plan``: the strategy that wrapped the model (the
    training job hands its own; by default the one that recorded ``model``).
    """
    plan = plan if plan is not None else parallel.strategy_of(model)
    micro_batches = list(micro_batches)
    k_total = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    own_step = plan.forward_backward
    if own_step is not None:  # a pipeline's schedule: the strategy runs the forwards and backwards itself
        loss_sum = own_step(model, micro_batches, lambda: autocast(device, precision))
        micro_batches = []
    for k, (x, y) in enumerate(micro_batches):
        last = k == k_total - 1
        with plan.sync_context(model, sync=last or not no_sync):
            with autocast(device, precision):
                _, loss = model(x, y)
            loss = loss / k_total
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    grad_norm = plan.clip_grad_norm_(model, grad_clip) if grad_clip > 0 else None  # over every rank's shard (FSDP)
    if scaler is not None:
        scaler.step(optimizer)  # skipped if the gradients hold inf/nan
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], info: DistInfo,
             precision: str) -> float:
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
    """Refuse bf16 on a GPU without bfloat16 support, before anything is built."""
    if cfg.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("--precision=bf16 needs a GPU with bfloat16 support (Ampere or newer); "
                          "use --precision=fp16 (with its GradScaler) or fp32 on this GPU.")


@dataclass
class _Job:
    """What one training run is made of: built once by :func:`_build`, read by the loop's helpers."""

    cfg: TrainConfig
    info: DistInfo
    plan: parallel.Strategy  # the strategy, built once for this job: everything it decides is asked of it
    data: Data
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    n_params: int
    flops_per_token: float
    n_devices: int  # devices doing the arithmetic, for MFU: one per rank, or all of DataParallel's replicas
    dp_rank: int  # which batches this rank reads: the ranks of one tensor-parallel group read the same ones
    dp_size: int  # how many different batches one step takes (the world size, unless a strategy splits the model)
    position: DataPosition  # this rank's micro-batches drawn: the loop advances it, a checkpoint saves it

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch(self.dp_size) * self.cfg.block_size

    @property
    def shape(self) -> dict[str, int]:
        return GPTConfig.from_train(self.cfg, self.data.tokenizer.vocab_size).shape()

    def state(self, step: int = 0) -> checkpoint.TrainState:
        """What a checkpoint saves of this job after ``step`` steps, and what a resume puts back."""
        parts = {"position": self.position, **({"scaler": self.scaler} if self.scaler is not None else {})}
        return checkpoint.TrainState(self.model, self.optimizer, self.plan, self.shape, step, parts)

    def mfu(self, tokens_per_s: float) -> float | None:
        """Model FLOPs utilisation at this throughput (None where the device's peak is unknown)."""
        return mfu(self.flops_per_token, tokens_per_s, self.n_devices, self.device, self.cfg.precision)


def _announce(cfg: TrainConfig, info: DistInfo, dp_size: int) -> None:
    """One line: processes, device, strategy, precision and how the global batch is made up."""
    global_batch = cfg.global_batch(dp_size)
    ranks = f"{dp_size} rank(s)" if dp_size == info.world_size else (
        f"{dp_size} data-parallel group(s) of {info.world_size // dp_size} rank(s)")
    log(f"[ddp_course] {info.world_size} process(es) on {info.device_reason}; strategy={cfg.strategy}, "
        f"precision={cfg.precision}, global batch {cfg.micro_batch_size} x {cfg.grad_accum_steps} accum x "
        f"{ranks} = {global_batch} sequences ({global_batch * cfg.block_size} tokens) per step")


def available_memory(device: torch.device) -> int | None:
    """Bytes this machine can still give: the GPU's free memory, or the system's available memory
    (``MemAvailable`` in /proc/meminfo, else free pages); None where neither can be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(gpt: GPTConfig, info: DistInfo) -> None:
    """Refuse a model whose weights alone do not fit, before allocating them (a ConfigError, exit 2).

    Every strategy builds the whole model in every process before wrapping it, so the weights (4 bytes
    per parameter) of each process sharing this machine's memory (or this rank's GPU) are a lower
    bound of what the job needs: a job refused here could not have run. Training adds the gradients
    and AdamW's two moments, 16 bytes per parameter in all unless a strategy shards them."""
    free = available_memory(info.device)
    n = gpt.num_params()
    sharing = 1 if info.device.type == "cuda" else info.local_world_size
    need = 4 * n * sharing
    if free is None or need <= free:
        return
    where = f"this GPU has {free / 1e9:,.1f} GB free" if info.device.type == "cuda" else (
        f"this machine has {free / 1e9:,.1f} GB available")
    raise ConfigError(f"this MiniGPT (--n_layer={gpt.n_layer}, --n_embd={gpt.n_embd}, --block_size={gpt.block_size}) "
                      f"has {n:,} parameters: {4 * n / 1e9:,.1f} GB of weights in each of the {sharing} process(es) "
                      f"on this {'GPU' if info.device.type == 'cuda' else 'machine'}, {16 * n / 1e9:,.1f} GB each with "
                      f"their gradients and AdamW's state, and {where}. Use a smaller --n_embd or --n_layer.")


def _build(cfg: TrainConfig, info: DistInfo, plan: parallel.Strategy, dp_rank: int, dp_size: int) -> _Job:
    """Data, the model (same seed on every rank: identical initial models), the strategy, AdamW, scaler."""
    data = prepare(cfg.corpus, cfg.block_size, cfg.val_fraction, announce=log)
    gpt = GPTConfig.from_train(cfg, data.tokenizer.vocab_size)
    check_fits(gpt, info)  # before a byte of it is allocated
    seed_everything(cfg.seed)
    model = MiniGPT(gpt).to(info.device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token()
    if cfg.compile:
        model = torch.compile(model)
    model = plan.wrap(model, info, cfg)
    n_devices = info.world_size * plan.devices_per_rank(model)
    per_epoch = len(data.train) // dp_size // cfg.micro_batch_size if cfg.data_order == "sampler" else None
    return _Job(cfg, info, plan, data, model, plan.build_optimizer(model, cfg, info.device),
                make_scaler(info.device, cfg.precision), n_params, flops_per_token, n_devices, dp_rank, dp_size,
                DataPosition(cfg.micro_batch_size, dp_size, per_epoch))


def _resume(job: _Job) -> tuple[int, int, dict[str, Any] | None]:
    """With ``--resume``: load the latest checkpoint; returns (start step, start micro-batch, its metadata).

    Every rank loads (a collective): model, optimizer, scaler, this rank's RNG, the data position.
    (The metrics writer drops the rows logged after the checkpoint's step; the loop says both.)
    """
    cfg, info = job.cfg, job.info
    path = checkpoint.latest(job.out_dir) if cfg.resume else None
    if path is None:
        if cfg.resume:
            log(f"[ddp_course] --resume: no checkpoint in {show(checkpoint.ckpt_dir(job.out_dir))}; starting from step 0")
        return 0, 0, None
    state = job.state()
    meta = checkpoint.resume(path, state, info)
    start_step = state.step
    if not meta.get("position"):  # a checkpoint without a recorded position: the position follows from the step
        job.position.micro_batches = start_step * cfg.grad_accum_steps
    return start_step, job.position.micro_batches, meta


def _write_config(job: _Job) -> None:
    """Rank 0: ``config.json`` (every option, the world, the corpus, the model's size, versions)."""
    cfg, info, data = job.cfg, job.info, job.data
    job.out_dir.mkdir(parents=True, exist_ok=True)
    write_json(job.out_dir / "config.json", {
        **cfg.to_dict(), "world_size": info.world_size, "backend": info.backend, "device": str(job.device),
        "device_reason": info.device_reason, "corpus_source": data.corpus.source,
        "vocab_size": data.tokenizer.vocab_size, "n_params": job.n_params, "flops_per_token": job.flops_per_token,
        "global_batch_size_resolved": cfg.global_batch(job.dp_size), "tokens_per_step": job.tokens_per_step,
        "data_parallel_size": job.dp_size,
        "versions": environment()})
    log(f"[ddp_course] corpus {data.corpus.name} from {show(data.corpus.source)}: {len(data.corpus.text):,} characters,"
        f" vocabulary {data.tokenizer.vocab_size}; model {job.n_params:,} parameters")


def _train_data(job: _Job, start_step: int, start_batch: int, meta: dict[str, Any] | None) -> Iterator[Batch]:
    """This rank's training batches from ``start_batch`` on."""
    cfg, info, data = job.cfg, job.info, job.data
    pin = job.device.type == "cuda"
    if cfg.data_order == "stream":  # random windows, rank-offset slices of one draw (no sampler, no epochs)
        batches = stream_batches(data.train.tokens, cfg.block_size, cfg.micro_batch_size, job.dp_rank,
                                 job.dp_size, cfg.seed, start_batch=start_batch, pin_memory=pin)
    else:
        batches = train_batches(data.train, cfg.micro_batch_size, job.dp_rank, job.dp_size, cfg.seed,
                                start_batch=start_batch, num_workers=cfg.num_workers, pin_memory=pin)
    per_epoch = job.position.batches_per_epoch  # None: the stream has no epochs
    if start_step and per_epoch and start_batch % per_epoch:  # resumed mid-epoch: see the helper's docstring
        batches = checkpoint.restore_rng_after_first(batches, meta, info)
    return batches


def _micro_batches(batches: Iterator[Batch], job: _Job
                   ) -> list[Batch]:
    """The next ``grad_accum_steps`` micro-batches, on the device (asynchronous copies from pinned memory)."""
    pin = job.device.type == "cuda"
    job.position.advance(job.cfg.grad_accum_steps)
    return [(x.to(job.device, non_blocking=pin), y.to(job.device, non_blocking=pin))
            for x, y in (next(batches) for _ in range(job.cfg.grad_accum_steps))]


def _inject_failure(cfg: TrainConfig, info: DistInfo, step: int) -> None:
    """``--fail_at_step``: raise on ``fail_rank``, on torchrun's first attempt only (a restarted job can finish)."""
    if (step == cfg.fail_at_step and info.rank == cfg.fail_rank
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        raise RuntimeError(f"injected failure on rank {info.rank} at step {step} (--fail_at_step)")


class _Clock:
    """Training time and throughput, interval by interval; evaluation and checkpoints are left out."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.start = self.mark = time.perf_counter()
        self.train_time = self.steady_time = 0.0
        self.steady_tokens = self.intervals = 0

    def interval(self, n_steps: int, device: torch.device) -> float:
        """Close a logging interval of ``n_steps`` steps; returns its tokens/s (waits for the GPU first)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - self.mark
        self.train_time += dt
        if self.intervals:  # the first interval holds warm-up (allocations, first kernels)
            self.steady_time += dt
            self.steady_tokens += self.tokens_per_step * n_steps
        self.intervals += 1
        return self.tokens_per_step * n_steps / dt

    def restart(self) -> None:
        """The next interval starts now."""
        self.mark = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not training time (evaluation, checkpoints)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.mark += time.perf_counter() - t0

    def tokens_per_s(self, steps_run: int) -> float:
        """Steady-state throughput (after the first interval), else over all of training."""
        if self.steady_time > 0:
            return self.steady_tokens / self.steady_time
        return self.tokens_per_step * steps_run / self.train_time if self.train_time > 0 else 0.0


def _train_row(job: _Job, step: int, loss: float, lr: float, tokens_per_s: float,
               grad_norm: torch.Tensor | None) -> dict[str, Any]:
    """One ``metrics.jsonl`` row: step, loss, lr, tokens/s, and the gradient norm and MFU where known."""
    row: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s}
    if grad_norm is not None:
        row["grad_norm"] = float(grad_norm)
    u = job.mfu(tokens_per_s)
    if u is not None:
        row["mfu"] = u
    return row


def _save_checkpoint(job: _Job, step: int) -> None:
    """Every rank calls it (collectives): the training state after ``step`` steps, with the data position."""
    path = checkpoint.save(job.out_dir, job.state(step), job.info, fmt=job.cfg.ckpt_format, keep_last=job.cfg.keep_last)
    if path is not None:
        log(f"[ddp_course] checkpoint {show(path)}")


def _max_over_ranks(value: int, info: DistInfo) -> int:
    """The largest ``value`` of any rank (one all_reduce MAX; every rank must call it)."""
    t = torch.tensor([value], dtype=torch.float64 if info.device.type == "cpu" else torch.float32, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _sample(job: _Job) -> str | None:
    """``--sample_tokens`` characters from the trained model, on rank 0. Every rank calls it: FSDP gathers."""
    if job.cfg.sample_tokens <= 0:
        return None
    sampler = job.plan.gathered(job.model)
    if not job.info.is_main:
        return None
    gen = torch.Generator(device=job.device).manual_seed(job.cfg.seed)
    start = torch.tensor([job.data.tokenizer.encode("\n")], device=job.device)
    out = sampler.generate(start, job.cfg.sample_tokens, temperature=0.8, top_k=20, generator=gen)
    return job.data.tokenizer.decode(out[0, 1:])


def _summary(job: _Job, clock: _Clock, steps_run: int, loss: float, val_loss: float | None) -> dict[str, Any]:
    """``summary.json``: final losses, tokens, time, throughput, MFU, peak memory (and a sample)."""
    cfg, info, device = job.cfg, job.info, job.device
    wall = time.perf_counter() - clock.start
    mem = peak_memory(device)
    tokens_per_s = clock.tokens_per_s(steps_run)
    summary = {
        "final_loss": loss, "final_val_loss": val_loss, "steps": cfg.max_steps, "steps_run": steps_run,
        "total_tokens": job.tokens_per_step * steps_run, "wall_time_s": wall, "tokens_per_s": tokens_per_s,
        "mfu": job.mfu(tokens_per_s),
        "world_size": info.world_size, "backend": info.backend, "device": str(device), **mem,
    }
    if info.is_distributed:  # the largest peak over ranks is the one that decides what fits
        summary["peak_memory_bytes_max_rank"] = _max_over_ranks(mem["peak_memory_bytes"], info)
    sample = _sample(job)
    if sample is not None:
        summary["sample"] = sample
    return summary


def _write_summary(job: _Job, summary: dict[str, Any]) -> None:
    """Rank 0: ``summary.json`` and the closing line."""
    path = job.out_dir / "summary.json"
    write_json(path, summary)
    val_loss = summary["final_val_loss"]
    log(f"[ddp_course] done: {summary['steps_run']} steps in {summary['wall_time_s']:.1f}s, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, final loss {summary['final_loss']:.4f}, "
        f"val_loss {val_loss if val_loss is None else round(val_loss, 4)}; wrote {show(path)}")


def run_training(cfg: TrainConfig, info: DistInfo) -> dict[str, Any]:
    """The loop itself, inside an initialised process group (or a single process). Returns the summary."""
    cfg = cfg.replace()  # never mutate the caller's config
    plan = parallel.plan_for(cfg)  # built once; the job holds it (and the state its strategy keeps)
    dp_rank, dp_size = plan.data_parallel(info.rank, info.world_size, cfg)
    cfg.resolve_batch(dp_size)
    device = info.device
    _check_precision(cfg, device)
    _announce(cfg, info, dp_size)
    job = _build(cfg, info, plan, dp_rank, dp_size)
    model, optimizer, scaler = job.model, job.optimizer, job.scaler
    start_step, start_batch, meta = _resume(job)
    if info.is_main:
        _write_config(job)
    metrics = MetricsWriter(job.out_dir, enabled=info.is_main, resume_at=start_step)  # (rank 0) keeps rows up to it
    if meta is not None:
        dropped = f"; {metrics.dropped} metrics rows after it dropped" if metrics.dropped else ""
        log(f"[ddp_course] resumed from {show(meta['path'])} at step {start_step} (saved by {meta['world_size']} "
            f"rank(s); data from micro-batch {start_batch}{dropped})")
    batches = _train_data(job, start_step, start_batch, meta)
    val = val_batches(job.data.val, cfg.micro_batch_size, cfg.eval_batches, job.dp_rank, job.dp_size)

    reset_peak_memory(device)
    model.train()
    clock = _Clock(job.tokens_per_step)
    loss_avg, val_loss, last_logged = float("nan"), None, start_step
    interval_loss = torch.zeros((), device=device)
    for step in range(start_step, cfg.max_steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, grad_norm = train_step(model, optimizer, scaler, _micro_batches(batches, job), device=device,
                                     precision=cfg.precision, grad_clip=cfg.grad_clip, no_sync=cfg.no_sync, plan=plan)
        interval_loss += loss  # summed on the device: no sync until the next log row
        _inject_failure(cfg, info, step)
        done = step + 1

        if done % cfg.log_interval == 0 or done == cfg.max_steps:
            # mean over the interval's steps and over ranks: a sync point, every rank takes part
            loss_avg = all_reduce_mean(interval_loss / (done - last_logged), info)
            interval_loss = torch.zeros((), device=device)
            tps = clock.interval(done - last_logged, device)
            metrics.write(_train_row(job, done, loss_avg, lr, tps, grad_norm))
            log(f"step {done:>5}/{cfg.max_steps}  loss {loss_avg:.4f}  lr {lr:.2e}  {tps:,.0f} tok/s")
            last_logged = done
            clock.restart()

        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == cfg.max_steps:
            with clock.paused():  # evaluation time is not training throughput
                val_loss = evaluate(model, val, info, cfg.precision)
                metrics.write({"step": done, "val_loss": val_loss})
                log(f"step {done:>5}/{cfg.max_steps}  val_loss {val_loss:.4f}")

        if cfg.ckpt_interval and done % cfg.ckpt_interval == 0:
            with clock.paused():
                _save_checkpoint(job, done)

    if cfg.ckpt_interval:  # final.pt: the final parameters, for comparing runs (every rank calls it)
        checkpoint.save_final(job.out_dir, cfg.max_steps, model, info, plan=plan)
    summary = _summary(job, clock, cfg.max_steps - start_step, loss_avg, val_loss)
    if info.is_main:
        _write_summary(job, summary)
    metrics.close()
    return summary


def check_launch(cfg: TrainConfig) -> None:
    """Refuse what this process cannot run, before it joins a process group or builds anything: a
    strategy against how the process was started, the global batch against the world size, and
    ``--out_dir`` (created here; every rank may write into it). Raises :class:`ConfigError`."""
    distributed = launched_by_torchrun()
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    plan = parallel.plan_for(cfg)
    why = plan.refusal(distributed, world_size)
    if why:
        raise ConfigError(why)
    rank = int(os.environ.get("RANK", 0)) if distributed else 0
    _, dp_size = plan.data_parallel(rank, world_size, cfg)  # a strategy refuses a layout it cannot make
    cfg.replace().resolve_batch(dp_size)  # on a copy: run_training resolves the caller's config again
    check_out_dir(cfg.out_dir)


def main(cfg: TrainConfig) -> dict[str, Any]:
    """Check the launch, join the process group (if launched by torchrun), train, always tear down.
    Returns the summary."""
    check_launch(cfg)
    with setup(cfg.device, cfg.timeout_s, cfg.threads) as info:
        return run_training(cfg, info)


REFUSAL_WAIT_S = 30.0  # how long a rank other than 0 waits, after refusing, for rank 0 to print the refusal


@record  # on failure, torchrun's error file carries this rank's traceback
def cli(argv: list[str] | None = None) -> None:
    """``python -m ddp_course.train``: parse the flags, train; bad input is one ``error:`` paragraph and exit 2.

    Under torchrun the refusal is printed once (rank 0) and every rank exits 2 before joining the process
    group (the other ranks only once rank 0 has: see ``REFUSAL_WAIT_S``). torchrun itself then reports the failed workers (a log line, its own ChildFailedError traceback
    and a summary, exit code 1): its process does so for any non-zero exit of a worker, and nothing a
    worker does changes that short of exiting 0. (Writing the refusal into the worker's error file only
    swaps the summary's "To enable traceback see: <link>" for the refusal, twice, and adds a log line.)
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP_FLAGS for a in argv):
        print(help_text(), flush=True)
        return
    try:
        cfg = parse_cli(argv)
        main(cfg)
    except (ConfigError, DeviceError, CorpusError, checkpoint.CheckpointError) as exc:
        # a clear one-paragraph message instead of a traceback: the fix is in the message
        if int(os.environ.get("RANK", 0)) != 0 and launched_by_torchrun():
            # Rank 0 prints it. A rank that exited first would have torchrun stop rank 0 before rank 0
            # got there (measured: rank 0 starting 3 s after rank 1, as on a loaded machine, and no
            # line at all): wait until torchrun stops this rank, rank 0 having exited; a refusal of
            # this rank alone, which rank 0 never prints, is printed here after the wait.
            time.sleep(REFUSAL_WAIT_S)
            print(f"error (rank {os.environ['RANK']}): {exc}", file=sys.stderr, flush=True)
        else:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
