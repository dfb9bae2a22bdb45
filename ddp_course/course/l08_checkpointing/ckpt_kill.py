"""Kill a process in the middle of writing a checkpoint, and check that the previous one survives.

    python -m ddp_course.course.l08_checkpointing.ckpt_kill --format=full --out_dir=runs/08_kill
    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l08_checkpointing.ckpt_kill --format=sharded --out_dir=runs/08_kill

A tiny MiniGPT trains one step and saves checkpoint 1 with ``ddp_course.checkpoint.save``; rank 0
writes its fingerprint to ``ckpt_kill.json``. The model trains one more step and starts saving
checkpoint 2, and rank 0 sends itself SIGKILL in the middle of that save:

- ``full``: after half of the file's bytes are on disk in ``step_0000002.pt.tmp``;
- ``sharded``: after every rank's part is written into ``step_0000002.tmp/`` but before the index
  (``.metadata``) that makes it a checkpoint.

SIGKILL cannot be caught -- no ``finally``, no ``atexit`` runs -- exactly like the kernel's
out-of-memory killer or a machine losing power. The process dies with status -9 (under torchrun,
torchrun then stops the other ranks): the job is *meant* to fail. Afterwards, ``latest`` still
names checkpoint 1, which loads and has the fingerprint in ``ckpt_kill.json``; the half-written
``.tmp`` is removed by the next save. ``--device=auto`` (default) runs on the GPU(s) when every
process has one, else on the CPU; the first line says which.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from ddp_course import checkpoint, parallel
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import TrainConfig
from ddp_course.course.options import require_device
from ddp_course.dist import log, seed_everything, setup
from ddp_course.metrics import write_json
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import build_optimizer, train_step

PROG = "python -m ddp_course.course.l08_checkpointing.ckpt_kill"
DEFAULTS: dict[str, Any] = {"out_dir": "runs/ckpt_kill", "format": "full", "timeout_s": 60.0, "device": "auto"}
SHAPE = {"vocab_size": 65, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}


def arm_kill(fmt: str) -> str:
    """Make rank 0 SIGKILL itself in the middle of the next save; returns where."""
    if fmt == "full":
        real_save = torch.save

        def half_then_die(obj, f, *args, **kwargs):
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = half_then_die
        return "half of the file's bytes written to its .tmp name"
    from torch.distributed.checkpoint import FileSystemWriter

    def die_before_index(self, metadata, results):  # only the coordinator (rank 0) writes the index
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.finish = die_before_index
    return "every rank's part written into the .tmp folder, the index (.metadata) not yet"


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    if opts["format"] not in checkpoint.FORMATS:
        raise FlagError(f"{PROG}: --format must be one of {', '.join(checkpoint.FORMATS)} "
                        f"(got {opts['format']!r}).")
    require_device(opts["device"])  # a device this machine has
    out_dir, fmt = Path(opts["out_dir"]), opts["format"]
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        log(f"[ckpt_kill] {info.world_size} process(es), {info.device_reason}")
        cfg = TrainConfig(strategy="ddp" if info.is_distributed else "single", n_layer=SHAPE["n_layer"],
                          n_head=SHAPE["n_head"], n_embd=SHAPE["n_embd"], block_size=SHAPE["block_size"])
        seed_everything(0)
        plan = parallel.plan_for(cfg)
        model = plan.wrap(MiniGPT(GPTConfig(**SHAPE)).to(info.device), info, cfg)
        optimizer = build_optimizer(model, cfg, info.device)
        g = torch.Generator().manual_seed(100 + info.rank)

        def step() -> None:
            x = torch.randint(0, SHAPE["vocab_size"], (4, SHAPE["block_size"] + 1), generator=g).to(info.device)
            train_step(model, optimizer, None, [(x[:, :-1], x[:, 1:])], device=info.device, precision="fp32",
                       grad_clip=1.0)

        step()
        path1 = checkpoint.save(out_dir, checkpoint.TrainState(model, optimizer, plan, SHAPE, step=1), info, fmt=fmt)
        fp1 = checkpoint.fingerprint(model, optimizer, plan=plan)
        step()
        where = arm_kill(fmt) if info.is_main else ""
        if info.is_main:
            report = {"format": fmt, "world_size": info.world_size, "saved": str(path1), "saved_step": 1,
                      "fingerprint": fp1, "killing": str(checkpoint.checkpoint_path(out_dir, 2, fmt)) + ".tmp",
                      "killed_when": where}
            write_json(out_dir / "ckpt_kill.json", report)
            log(f"saved checkpoint 1 ({path1.name}, fingerprint {fp1}); saving checkpoint 2 and killing rank 0 "
                f"with SIGKILL when {where}")
        checkpoint.save(out_dir, checkpoint.TrainState(model, optimizer, plan, SHAPE, step=2), info, fmt=fmt)
    log("error: the save completed, so the kill did not happen; nothing was shown")
    return 1


if __name__ == "__main__":
    sys.exit(main())
