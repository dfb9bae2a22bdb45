"""Load checkpoints saved by N ranks into a job with any other number of ranks.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l08_checkpointing.ckpt_reshard \\
        --ckpts=runs/a/checkpoints/step_0000010.pt,runs/b/checkpoints/step_0000010 --out_dir=runs/08_reshard
    python -m ddp_course.course.l08_checkpointing.ckpt_reshard --ckpts=...   # one process, no process group

For every checkpoint in ``--ckpts`` (comma-separated; ``full`` files or ``sharded`` folders), every
rank builds the MiniGPT the checkpoint was made for, wraps it in DDP (when there is a process
group), builds the course's AdamW and calls ``ddp_course.checkpoint.resume`` -- the same call
``ddp_course.train --resume`` makes. Each rank then reports what it holds: the fingerprint of its
parameters and optimizer state (equal to the last bit on every rank, and to the saving job's),
the step, the rank whose RNG states it took, and the micro-batch at which it would continue with
the same global batch split over this job's ranks.

Every rank writes ``reshard_rank<R>.json`` into ``--out_dir``. ``--device=auto`` (default) loads onto
the GPUs when every rank has one, else onto the CPU; the first line says which (a checkpoint loads on
either, whichever device saved it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ddp_course import checkpoint, parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import TrainConfig
from ddp_course.course.options import require_device
from ddp_course.data import DataPosition
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import build_optimizer

PROG = "python -m ddp_course.course.l08_checkpointing.ckpt_reshard"
DEFAULTS: dict[str, Any] = {"ckpts": "", "out_dir": "runs/ckpt_reshard", "timeout_s": 60.0, "device": "auto"}


def load_into_new_job(path: str | Path, info) -> dict[str, Any]:
    """Build the model and optimizer a checkpoint was made for, at this job's size, and resume into them."""
    meta = checkpoint.load(path, "cpu")  # the shape it was made for (a sharded folder: its meta.pt)
    shape = meta["shape"]
    cfg = TrainConfig(strategy="ddp" if info.is_distributed else "single", block_size=shape["block_size"],
                      n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"])
    plan = parallel.plan_for(cfg)
    model = plan.wrap(MiniGPT(GPTConfig(**shape)).to(info.device), info, cfg)
    optimizer = build_optimizer(model, cfg, info.device)
    meta = checkpoint.resume(path, checkpoint.TrainState(model, optimizer, plan, shape), info)
    step, saved_ws = int(meta["step"]), int(meta["world_size"])
    row = {"path": str(path), "format": checkpoint.format_of(path), "saved_world_size": saved_ws, "step": step,
           "fingerprint": checkpoint.fingerprint(model, optimizer, plan=plan),
           "rng_from_rank": info.rank if info.rank < saved_ws else 0}
    pos = meta.get("position")
    if pos and step:
        global_batch = pos["samples"] // step
        if global_batch % info.world_size == 0:
            micro = global_batch // info.world_size
            here = DataPosition(micro, info.world_size)  # this job's data stream, read back from the saved one
            here.load_state_dict(pos)
            row["same_global_batch"] = {"global_batch": global_batch, "micro_batch_size": micro,
                                        "start_batch": here.micro_batches}
    return row


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    paths = [p for p in opts["ckpts"].split(",") if p]
    if not paths:
        raise FlagError(f"{PROG}: give the checkpoints to load, e.g. "
                        "--ckpts=runs/a/checkpoints/step_0000010.pt,runs/b/checkpoints/step_0000010")
    require_device(opts["device"])  # a device this machine has
    out_dir = Path(opts["out_dir"])
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        log(f"[ckpt_reshard] {info.world_size} rank(s), {info.device_reason}")
        rows = [load_into_new_job(p, info) for p in paths]  # every rank, same order: resume is a collective
        report = {"rank": info.rank, "world_size": info.world_size, "checkpoints": rows}
        write_json(out_dir / f"reshard_rank{info.rank}.json", report)
        for r in rows:
            log(f"{Path(r['path']).name} ({r['format']}, saved by {r['saved_world_size']} rank(s), step {r['step']}) "
                f"-> fingerprint {r['fingerprint']}, RNG of saving rank {r['rng_from_rank']}", all_ranks=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
