"""Exercise 01 -- the validation loss of a distributed run, averaged correctly over ranks.

Every rank evaluates the same model (same seed, so the same weights) on its own shard of the
validation windows. The shards are deliberately uneven: with 2 ranks, rank 0 gets one window more
than rank 1. Complete ``global_mean`` so that every rank returns the mean loss over *all* windows.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/01_global_val_loss.py

It checks itself (rank 0 recomputes the answer alone) and prints PASS or FAIL on every rank.
The course's grader runs it the same way, with 2 and 3 processes:

    python -m ddp_course check 01 lessons/exercises/01_global_val_loss.py
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_course.data import prepare
from ddp_course.dist import log, setup
from ddp_course.model import GPTConfig, MiniGPT

N_WINDOWS = 47  # a prime: with 2, 3 or 4 ranks the shards are uneven on purpose


def global_mean(local_sum: torch.Tensor, local_count: int) -> float:
    """The mean over every rank's items, given this rank's sum and count. Every rank must call it."""
    # TODO: give every rank the mean over all ranks' items, as a float (every rank calls the same collective)
    raise NotImplementedError("exercise: complete this part")


def window_losses(model: MiniGPT, ds, indices: list[int]) -> torch.Tensor:
    """The mean next-character loss of each window, shape (len(indices),)."""
    x = torch.stack([ds[i][0] for i in indices])
    y = torch.stack([ds[i][1] for i in indices])
    with torch.no_grad():
        logits = model(x)  # (N, T, V)
        per_token = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (N, T)
    return per_token.mean(dim=1)


def main() -> None:
    with setup(device="cpu") as info:
        data = prepare("tinyshakespeare", block_size=32, val_fraction=0.1, announce=log)
        torch.manual_seed(0)
        model = MiniGPT(GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2,
                                  n_embd=32)).eval()
        mine = list(range(info.rank, N_WINDOWS, info.world_size))  # rank r: windows r, r+W, r+2W, ...
        losses = window_losses(model, data.val, mine)
        result = global_mean(losses.sum(), len(mine))

        # Self-check: rank 0 computes the answer alone over all windows and sends it to everyone.
        ref = torch.zeros((), dtype=torch.float64)
        if info.rank == 0:
            ref += window_losses(model, data.val, list(range(N_WINDOWS))).double().mean()
        dist.broadcast(ref, src=0)
        ok = abs(result - ref.item()) < 1e-6  # float32 losses summed in a different order: ~1e-7 apart
        log(f"{len(mine)} windows here; global mean {result:.6f}, reference {ref.item():.6f} -> "
            f"{'PASS' if ok else 'FAIL'}", all_ranks=True)
        # one write per line, so that lines of different ranks cannot interleave in the shared pipe
        sys.stdout.write("RESULT " + json.dumps({"rank": info.rank, "result": result, "reference": ref.item(),
                                                 "ok": ok}) + "\n")
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
