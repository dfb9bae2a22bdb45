"""Exercise 14 -- ring attention by hand: the three pieces of the ring's forward pass, on 4 ranks.

Each rank holds its chunks of the sequence (queries, keys and values); the keys and values travel
round the ring, and every rank turns each block of keys it holds into attention for its own queries.
The loop is given (``ring_loop.ring_forward``: for every block it computes, it takes the block's
log-sum-exp of the scores and its softmax-weighted values, then calls your ``merge``); complete the
three functions it calls:

- ``pass_on(t, send_to, recv_from)``: send ``t`` to rank ``send_to`` and return the tensor of the same
  shape that rank ``recv_from`` sends to this one -- every rank of the ring does this at once;
- ``block_scores(q, k, qpos, kpos)``: one block of attention scores, q (B, H, cq, D) against k
  (B, H, ck, D), scaled by 1/sqrt(D), causal: a query sees only the keys at or before its position;
  ``qpos`` (cq,) and ``kpos`` (ck,) are the tokens' positions in the whole sequence;
- ``merge(out, lse, out_blk, lse_blk)``: the running output and log-sum-exp of the scores so far, and
  one more block's (its own softmax-weighted values and log-sum-exp) -> the output and log-sum-exp
  over all of them. Before the first block, ``lse`` is -inf and ``out`` zero.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=4 lessons/exercises/14_ring_attention.py

The harness below runs your functions on rings of 2 and of 4 ranks, with both layouts of the lesson
(plain and zigzag), in float64, and compares each rank's output with one process's
``scaled_dot_product_attention(is_causal=True)``; then once more in float32, with scores in the
hundreds. It prints PASS or FAIL on every rank. The course's grader runs it the same way and names
what went wrong:

    python -m ddp_course check 14 lessons/exercises/14_ring_attention.py
"""

import json
import math
import sys

import torch
import torch.distributed as dist

from ddp_course.course.l14_sequences_and_experts.ring_harness import measure, report
from ddp_course.dist import setup


def pass_on(t: torch.Tensor, send_to: int, recv_from: int) -> torch.Tensor:
    """Send ``t`` to ``send_to``; return what ``recv_from`` sent (the same shape and dtype)."""
    # BEGIN SOLUTION hint: send t to send_to and return what recv_from sends, with every rank of the ring doing the same at once
    received = torch.empty_like(t)
    requests = [dist.isend(t.contiguous(), send_to), dist.irecv(received, recv_from)]
    for request in requests:
        request.wait()
    return received
    # END SOLUTION


def block_scores(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Scores (B, H, cq, ck) of queries at positions ``qpos`` against keys at ``kpos``, causal."""
    # BEGIN SOLUTION hint: this block's scaled scores, causal by the tokens' positions in the whole sequence
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return scores.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    # END SOLUTION


def merge(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) over the blocks so far and one more -> (out, lse) over all of them."""
    # BEGIN SOLUTION hint: the softmax over all the blocks so far: its weighted values and its log-sum-exp, for scores of any size
    new = torch.logaddexp(lse, lse_blk)
    return out * torch.exp(lse - new)[..., None] + out_blk * torch.exp(lse_blk - new)[..., None], new
    # END SOLUTION


def main() -> None:
    with setup(device="cpu"):
        result = measure(pass_on, block_scores, merge)
        ok = report(result)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
