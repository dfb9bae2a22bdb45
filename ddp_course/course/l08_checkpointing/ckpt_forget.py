"""Resume the course's training loop while forgetting one part of the state, to see why each part matters.

    python -m ddp_course.course.l08_checkpointing.ckpt_forget --out_dir=runs/08_forget --max_steps=60 --resume_at=30

One process runs ``ddp_course.train`` (one device, dropout 0.1, a tiny MiniGPT) without interruption
to ``--max_steps``, saving a checkpoint at step ``--resume_at``. Then, for each variant, it copies
that checkpoint into a fresh run folder and resumes the same training from it with
``ddp_course.train --resume``, after ``ddp_course.checkpoint.resume`` has restored everything --
except, on purpose, one part:

- ``nothing``: the course's resume, unchanged;
- ``rng``: the generator states are left as a fresh start leaves them, so every dropout mask after
  the resume differs from the uninterrupted run's;
- ``data``: the position in the data is dropped, so the sampler starts the epoch over and the run
  sees its first batches again (the classic resume bug);
- ``optimizer``: AdamW's moments and step counts are dropped -- the weights alone, which is what
  saving ``model.state_dict()`` only gives you.

Each run is the real training loop; the lab only wraps ``checkpoint.resume`` to undo one part.
Writes ``forget.json``: for the uninterrupted run and each variant, the per-step losses after the
resume point, the largest difference from the uninterrupted run's losses, and whether the final
parameters are identical to the last bit.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from ddp_course import checkpoint
from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.config import TrainConfig
from ddp_course.metrics import read_jsonl, write_json
from ddp_course.train import main as train_main

PROG = "python -m ddp_course.course.l08_checkpointing.ckpt_forget"
DEFAULTS: dict[str, Any] = {"out_dir": "runs/ckpt_forget", "max_steps": 60, "resume_at": 30, "dropout": 0.1}
VARIANTS = ("nothing", "rng", "data", "optimizer")
MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "micro_batch_size": 8, "lr": 3e-3,
         "warmup_steps": 5, "log_interval": 1, "eval_interval": 0, "eval_batches": 1, "keep_last": 0, "threads": 1}


@contextlib.contextmanager
def forgetting(part: str):
    """While active, ``checkpoint.resume`` restores everything except ``part``."""
    real = checkpoint.resume

    def resume(path, state, info):
        fresh_rng = checkpoint.rng_state(info.device)  # as a run that starts from scratch has them
        meta = real(path, state, info)
        if part == "rng":
            checkpoint.set_rng_state(fresh_rng, info.device)
            meta = {**meta, "rng": None}
        elif part == "data":
            state.parts["position"].load_state_dict({"samples": 0})  # the data stream starts over
        elif part == "optimizer":
            state.optimizer.state.clear()  # AdamW starts its moments and bias correction from zero again
        return meta

    checkpoint.resume = resume
    try:
        yield
    finally:
        checkpoint.resume = real


def _losses(out_dir: Path, after: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r and r["step"] > after}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    if not 0 < opts["resume_at"] < opts["max_steps"]:
        raise FlagError(f"{PROG}: --resume_at must be between 0 and --max_steps={opts['max_steps']} "
                        f"(got {opts['resume_at']}).")
    root, k = Path(opts["out_dir"]), opts["resume_at"]
    for name in ("uninterrupted", *(f"forget_{part}" for part in VARIANTS)):  # this lab's folders, nothing else
        shutil.rmtree(root / name, ignore_errors=True)
    base = TrainConfig(**MODEL, dropout=opts["dropout"], max_steps=opts["max_steps"], ckpt_interval=k)

    ref_dir = root / "uninterrupted"
    train_main(base.replace(out_dir=str(ref_dir)))
    saved = checkpoint.checkpoint_path(ref_dir, k, "full")
    ref_losses = _losses(ref_dir, k)
    ref_final = torch.load(ref_dir / checkpoint.FINAL, weights_only=True)["model"]
    report: dict[str, Any] = {"resume_at": k, "max_steps": opts["max_steps"], "dropout": opts["dropout"],
                              "checkpoint": str(saved), "uninterrupted": {"losses": ref_losses}, "variants": {}}
    for part in VARIANTS:
        d = root / f"forget_{part}"
        ckpts = checkpoint.ckpt_dir(d)
        ckpts.mkdir(parents=True)
        shutil.copy(saved, ckpts / saved.name)  # the state of a run interrupted right after step k
        (ckpts / checkpoint.POINTER).write_text(saved.name + "\n", encoding="utf-8")
        with forgetting(part):
            train_main(base.replace(out_dir=str(d), resume=True, ckpt_interval=opts["max_steps"]))
        losses = _losses(d, k)
        final = torch.load(d / checkpoint.FINAL, weights_only=True)["model"]
        report["variants"][part] = {
            "losses": losses,
            "max_loss_diff": max(abs(losses[s] - ref_losses[s]) for s in ref_losses),
            "max_param_diff": max((final[n] - ref_final[n]).abs().max().item() for n in ref_final),
            "identical": all(torch.equal(final[n], ref_final[n]) for n in ref_final) and losses == ref_losses}
    write_json(root / "forget.json", report)
    print(f"{'forgotten':<12}{'max |loss diff|':>18}{'max |param diff|':>18}  bit-identical")
    for part, v in report["variants"].items():
        print(f"{part:<12}{v['max_loss_diff']:>18.3e}{v['max_param_diff']:>18.3e}  {v['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
