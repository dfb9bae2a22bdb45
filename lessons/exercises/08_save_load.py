"""Exercise 08 -- save and load the training state, so that a crashed job resumes exactly.

This script trains a small MiniGPT with DDP on 2 ranks (dropout on, seeded differently on each
rank). At step ``--ckpt_step`` it calls ``save_checkpoint``; when it starts and finds a checkpoint,
it calls ``load_checkpoint`` and continues from the step that returns. The data position and the
learning rate follow from that step. Complete the two functions so that a job killed after the
checkpoint and restarted by torchrun ends with exactly the parameters of a job that never crashed.

Run it from the repository root, with a crash on purpose after step 9 and one restart:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
        lessons/exercises/08_save_load.py --out_dir=runs/ex08 --fail_at_step=9

(the variable works around a torch 2.x bug on restarts, see lesson 08; delete runs/ex08 to start over
from scratch). Attempt 0 saves at step 6
and rank 1 kills itself (SIGKILL) after step 9; torchrun restarts both ranks; attempt 1 loads the
checkpoint and finishes. The grader compares that with an uninterrupted run, bit for bit:

    python -m ddp_course check 08 lessons/exercises/08_save_load.py

At the end each rank also trains the same model from step 0 without interruption, and prints one
line ``RESULT {json}`` with both runs (what the grader reads).
"""

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.cli import FlagError, parse_flags
from ddp_course.data import prepare, stream_batches
from ddp_course.dist import DistInfo, log, setup
from ddp_course.model import GPTConfig, MiniGPT

DEFAULTS = {"out_dir": "runs/ex08", "max_steps": 12, "ckpt_step": 6, "fail_at_step": -1, "save": True}


def save_checkpoint(path: Path, step: int, model: DDP, optimizer: torch.optim.Optimizer, info: DistInfo) -> None:
    """Save everything the remaining steps depend on into ``path``. Every rank calls this.

    Rank 0 writes the file -- atomically, so that a crash in the middle of the save leaves no
    half-written ``path`` -- and every rank must be past the save before any continues.
    """
    # TODO: collect every rank's RNG state on rank 0 (a collective: all ranks call it); rank 0 writes the step, model, optimizer and RNG states atomically; then every rank waits for the file
    raise NotImplementedError("exercise: complete this part")


def load_checkpoint(path: Path, model: DDP, optimizer: torch.optim.Optimizer, info: DistInfo) -> int:
    """Restore what ``save_checkpoint`` saved, on every rank; return the step to continue from."""
    # TODO: read the file on every rank; restore the model, the optimizer and this rank's own RNG state; return the saved step
    raise NotImplementedError("exercise: complete this part")


# --- the harness: nothing to change below ------------------------------------------------------------

def digest(*objs) -> str:
    """A short hash of tensors (nested in dicts and lists), equal only if every bit is."""
    h = hashlib.sha256()

    def feed(o) -> None:
        if isinstance(o, torch.Tensor):
            h.update(o.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                feed(v)
        else:
            h.update(repr(o).encode())

    for o in objs:
        feed(o)
    return h.hexdigest()[:16]


def probe(model: DDP, optimizer: torch.optim.Optimizer) -> dict:
    """Fingerprints of the state the remaining steps depend on."""
    return {"model": digest(model.module.state_dict()), "optimizer": digest(optimizer.state_dict()["state"]),
            "rng": digest(torch.get_rng_state())}


def lr_at(step: int, max_steps: int) -> float:
    return 3e-3 * min(1.0, (step + 1) / 4) * (1.0 - 0.5 * step / max_steps)  # warm-up, then linear decay


def fresh_start(data, info: DistInfo) -> tuple[DDP, torch.optim.Optimizer]:
    """The model and optimizer of step 0, and the generators as a fresh start leaves them."""
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(MiniGPT(GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2,
                                  n_embd=32, dropout=0.1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    torch.manual_seed(1000 + info.rank)  # dropout masks differ between ranks: so do the RNG states
    return model, optimizer


def train(data, model: DDP, optimizer, info: DistInfo, start: int, opts: dict, checkpoint: Path | None,
          crash: bool) -> dict:
    """Steps ``start`` .. max_steps; saves at ckpt_step into ``checkpoint`` (if given); rank 1 may crash."""
    batches = stream_batches(data.train.tokens, 32, 4, info.rank, info.world_size, seed=0, start_batch=start)
    losses, at_ckpt = {}, None
    for step in range(start, opts["max_steps"]):
        x, y = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opts["max_steps"])
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step + 1] = loss.item()
        if step + 1 == opts["ckpt_step"]:
            at_ckpt = probe(model, optimizer)
            if checkpoint is not None:
                save_checkpoint(checkpoint, step + 1, model, optimizer, info)
        if crash and step == opts["fail_at_step"] and info.rank == 1:
            log(f"killing rank 1 after step {step} (SIGKILL)", all_ranks=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return {"losses": losses, "at_ckpt": at_ckpt, "final": digest(model.module.state_dict())}


def main(argv: list[str]) -> None:
    try:
        opts = parse_flags(argv, DEFAULTS, "08_save_load.py")
    except FlagError as exc:
        raise SystemExit(f"error: {exc}") from None
    out_dir = Path(opts["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "checkpoint.pt"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun counts its restarts
    with setup(device="cpu", timeout_s=30) as info:
        data = prepare("tinyshakespeare", block_size=32, val_fraction=0.1, announce=log)
        model, optimizer = fresh_start(data, info)
        start, loaded = 0, None
        if path.exists():
            start = load_checkpoint(path, model, optimizer, info)
            loaded = probe(model, optimizer)
            log(f"attempt {attempt}: resumed from {path} at step {start}", all_ranks=True)
        run = train(data, model, optimizer, info, start, opts, path if opts["save"] else None, crash=attempt == 0)
        # the same training from step 0, uninterrupted and without checkpoints: what the run must equal
        model, optimizer = fresh_start(data, info)
        reference = train(data, model, optimizer, info, 0, opts, None, crash=False)
        line = json.dumps({"rank": info.rank, "attempt": attempt, "start": start, "loaded": loaded, **run,
                           "reference": reference})
        sys.stdout.write(f"RESULT {line}\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
