"""Mixed precision under DDP: what dtype the gradients are all-reduced in, and why every rank needs
its own GradScaler.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l07_mixed_precision.amp_ddp --out_dir=runs/amp_ddp

For each precision (``--precisions``, default bf16 then fp16) every rank builds the same MiniGPT,
wraps it in DDP (``ddp_course.parallel``) and trains ``--steps`` steps with the course's own
``ddp_course.train.train_step`` (autocast; for fp16 a GradScaler made by ``train.make_scaler`` on
every rank). A DDP communication hook sees each gradient bucket just before its all-reduce and
records its dtype and whether this rank's own gradients were finite. At step ``--spike_step`` the
gradient of rank ``--spike_rank`` alone is multiplied by ``--spike`` at the output head
(``ddp_course.course.l07_mixed_precision.amp.gradient_spike``): in fp16 that overflows on that rank only.

What it shows, per rank and step: the bucket dtype (fp32 in both precisions: DDP reduces the
gradients in the dtype of the parameters, and autocast leaves parameters and their gradients fp32),
whether the rank's local gradients were finite, whether the optimizer step was skipped, and the
scale before and after ``update``. Because the all-reduce carries one rank's inf to every rank,
every rank's scaler finds it and skips the same step: the replicas and their scales stay identical
(checked at the end against rank 0).

Every rank writes ``amp_ddp_rank<R>.json`` into ``--out_dir``. Options are ``--key=value``
(``--help`` lists them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_course import parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import TrainConfig
from ddp_course.course.l07_mixed_precision.amp import gradient_spike
from ddp_course.course.options import require_device
from ddp_course.data import prepare, train_batches
from ddp_course.dist import log, seed_everything, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.paths import show
from ddp_course.train import build_optimizer, make_scaler, train_step

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l07_mixed_precision.amp_ddp"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/amp_ddp",
    "precisions": "bf16,fp16",  # comma-separated, each of bf16, fp16, fp32
    "steps": 6,  # optimizer steps per precision
    "spike_step": 2,  # the step whose gradient is blown up on one rank (-1: none)
    "spike_rank": 1,  # the rank whose gradient is blown up
    "spike": 4096.0,  # the factor; with the default scale 2**16 it overflows fp16
    "micro_batch_size": 8,  # sequences per rank per step
    "block_size": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "lr": 1e-3,
    "seed": 1337,
    "corpus": "tinyshakespeare",
    "device": "auto",  # auto | cpu | cuda (cuda needs one GPU per process)
    "threads": 0,  # CPU threads per process (0: cores / processes)
    "timeout_s": 60.0,  # process-group timeout
}


def log_bucket(state: list, bucket):
    """A communication hook: note the bucket's dtype and whether this rank's gradients in it are
    finite, then all-reduce it as DDP itself would (``default_hooks.allreduce_hook``: divide by the
    world size, sum). ``state`` is the list the notes go to. (Left unannotated: DDP checks the
    annotations of a hook against the real classes.)"""
    buf = bucket.buffer()
    state.append({"dtype": str(buf.dtype).replace("torch.", ""), "numel": buf.numel(),
                  "finite": bool(torch.isfinite(buf).all())})
    return default_hooks.allreduce_hook(None, bucket)


def run_precision(precision: str, opts: dict[str, Any], info, data) -> dict[str, Any]:
    device = info.device
    cfg = TrainConfig(strategy="ddp", precision=precision, lr=opts["lr"], seed=opts["seed"], device=opts["device"],
                      block_size=opts["block_size"], n_layer=opts["n_layer"], n_head=opts["n_head"],
                      n_embd=opts["n_embd"])
    seed_everything(opts["seed"])  # the same initial weights on every rank
    model = MiniGPT(GPTConfig.from_train(cfg, data.tokenizer.vocab_size)).to(device)
    ddp = parallel.wrap(model, info, cfg)
    buckets: list[dict[str, Any]] = []
    ddp.register_comm_hook(state=buckets, hook=log_bucket)
    optimizer = build_optimizer(ddp, cfg, device)
    scaler = make_scaler(device, precision)  # one per rank, configured identically
    batches = train_batches(data.train, opts["micro_batch_size"], info.rank, info.world_size, opts["seed"])
    params = [p for p in ddp.parameters() if p.requires_grad]
    now = {"step": -1}
    spiking = info.rank == opts["spike_rank"]
    handle = gradient_spike(parallel.unwrap(ddp).head, opts["spike"],
                            lambda: spiking and now["step"] == opts["spike_step"])
    rows = []
    try:
        for step in range(opts["steps"]):
            now["step"] = step
            x, y = (t.to(device) for t in next(batches))
            buckets.clear()
            scale = scaler.get_scale() if scaler is not None else None
            before = [p.detach().clone() for p in params]
            loss, grad_norm = train_step(ddp, optimizer, scaler, [(x, y)], device=device, precision=precision,
                                         grad_clip=1.0)
            skipped = all(torch.equal(a, p.detach()) for a, p in zip(before, params))
            rows.append({
                "step": step, "loss": loss.item(), "spiked_here": spiking and step == opts["spike_step"],
                "local_grads_finite": all(b["finite"] for b in buckets),
                "bucket_dtypes": sorted({b["dtype"] for b in buckets}), "n_buckets": len(buckets),
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "skipped": skipped, "scale": scale,
                "scale_after": scaler.get_scale() if scaler is not None else None})
    finally:
        handle.remove()
    # Are the replicas still identical? Every rank compares its weights with rank 0's.
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    return {"precision": precision, "param_dtype": str(params[0].dtype).replace("torch.", ""),
            "rows": rows, "max_param_diff_vs_rank0": float((flat - ref).abs().max()),
            "scaler": None if scaler is None else {"init_scale": rows[0]["scale"],
                                                   "growth_interval": scaler.get_growth_interval(),
                                                   "backoff_factor": scaler.get_backoff_factor()}}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__)
    precisions = [p.strip() for p in opts["precisions"].split(",") if p.strip()]
    bad = [p for p in precisions if p not in ("fp32", "bf16", "fp16")]
    if bad or not precisions:
        raise FlagError(f"--precisions={opts['precisions']!r}: each must be fp32, bf16 or fp16 "
                        "(comma-separated, e.g. --precisions=bf16,fp16).")
    require_device(opts["device"])
    with setup(opts["device"], opts["timeout_s"], opts["threads"]) as info:
        if not info.is_distributed:
            raise FlagError(f"this lab compares ranks; launch it with `{PROG}`.")
        if "bf16" in precisions and info.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            log("[amp_ddp] this GPU has no bfloat16 support: bf16 left out (it needs compute capability 8.0+)")
            precisions = [p for p in precisions if p != "bf16"]
        data = prepare(opts["corpus"], opts["block_size"], 0.1, announce=log)
        log(f"[amp_ddp] {info.world_size} ranks on {info.device_reason}; precisions {', '.join(precisions)}; "
            f"gradient x{opts['spike']:g} on rank {opts['spike_rank']} at step {opts['spike_step']}")
        result: dict[str, Any] = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                                  "device": str(info.device), "options": opts, "precisions": {}}
        for precision in precisions:
            res = run_precision(precision, opts, info, data)
            result["precisions"][precision] = res
            skipped = [r["step"] for r in res["rows"] if r["skipped"]]
            local_inf = [r["step"] for r in res["rows"] if not r["local_grads_finite"]]
            log(f"[amp_ddp] {precision}: buckets reduced in {res['rows'][0]['bucket_dtypes']}; own gradients "
                f"non-finite at steps {local_inf or 'none'}; steps skipped {skipped or 'none'}; final scale "
                f"{res['rows'][-1]['scale_after']}; max |w - w_rank0| {res['max_param_diff_vs_rank0']:.1e}",
                all_ranks=True)
        out = Path(opts["out_dir"])
        write_json(out / f"amp_ddp_rank{info.rank}.json", result)
        dist.barrier()  # every file is written before rank 0 reports done
        log(f"[amp_ddp] wrote {show(out)}/amp_ddp_rank*.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
