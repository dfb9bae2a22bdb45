"""What exercise 14 (ring attention) measures of a learner's three functions, on every rank.

:func:`measure` runs the ring's forward (``ring.ring_forward``) with the learner's ``pass_on`` (send to
the next rank, receive from the previous), ``block_scores`` (one block of scores, causal by global
position) and ``merge`` (the running output and log-sum-exp with one more block's) in place of the
course's, on rings of 2 ranks (the world in pairs) and of all the ranks, in both layouts, in float64,
and compares each output with one process's ``scaled_dot_product_attention``. Beside it, the same ring
with each classic mistake in place of the right function (:data:`MISTAKES`), so that the grader can
name the mistake nearest to what the learner's code computed. :func:`report` prints one line per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_course.course.l14_sequences_and_experts import ring as R
from ddp_course.dist import log

# float64: the ring and PyTorch's kernel differ by rounding only, ~1e-15 relative (the lab measures it);
# every classic mistake is off by 1e-2 or more. 1e-10 lies between them, far from both.
RTOL = 1e-10


def _local_mask_scores(q, k, qpos, kpos):
    """A classic mistake: the causal mask by position inside the block (every block masked as if it
    were on the diagonal), not by position in the sequence."""
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


def _unmasked_scores(q, k, qpos, kpos):
    """A classic mistake: no mask at all (a query also attends to later keys in its own chunk)."""
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


def _summed(out, lse, out_blk, lse_blk):
    """A classic mistake: block outputs added, each normalised by its own block's softmax only."""
    return out + out_blk, torch.logaddexp(lse, lse_blk)


def _averaged(out, lse, out_blk, lse_blk):
    """A classic mistake: the running output and the block's averaged, whatever their weights."""
    first = torch.isinf(lse)
    return torch.where(first[..., None], out_blk, (out + out_blk) / 2), torch.logaddexp(lse, lse_blk)


MISTAKES: dict[str, dict[str, Callable]] = {
    "mask by local position": {"scores": _local_mask_scores},
    "no causal mask": {"scores": _unmasked_scores},
    "merge without rescaling (sum)": {"combine": _summed},
    "merge without rescaling (mean)": {"combine": _averaged},
}


def measure(pass_on: Callable, block_scores: Callable, merge: Callable, *, seq: int = 32, heads: int = 2,
            head_dim: int = 8, seed: int = 0) -> dict[str, Any]:
    """This rank's errors against one process for every ring and layout, the learner's functions and each
    classic mistake's. Collective: every rank must call it."""
    world, me = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)] if world > 2 else [None]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, seq, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors: dict[str, float] = {}
    mistakes: dict[str, dict[str, float]] = {}
    for size, group in ((2, pairs[me // 2]), (world, None)):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        at = ranks.index(me)
        nxt, prv = ranks[(at + 1) % size], ranks[(at - 1) % size]
        for kind in R.LAYOUTS:
            ring = R.Ring(kind, group)
            mine = [R.shard(t, kind, size, at) for t in (q, k, v)]
            want = R.shard(ref, kind, size, at)
            out, _ = R.ring_forward(*mine, ring, scores=block_scores, combine=merge,
                                    send=lambda t, nxt=nxt, prv=prv: pass_on(t, nxt, prv))
            key = f"{size} ranks, {kind}"
            errors[key] = R.relative_error(out, want)
            mistakes[key] = {name: R.relative_error(out, R.ring_forward(*mine, R.Ring(kind, group), **swap)[0])
                             for name, swap in MISTAKES.items()}
            mistakes[key]["(as one process)"] = errors[key]
    return {"rank": me, "world_size": world, "errors": errors, "mistakes": mistakes,
            "ok": max(errors.values()) <= RTOL}


def report(result: dict[str, Any]) -> bool:
    """One line per rank: its worst error, PASS or FAIL."""
    worst = max(result["errors"], key=result["errors"].get)
    log(f"rank {result['rank']}: largest difference from one process {result['errors'][worst]:.1e} ({worst}) -> "
        f"{'PASS' if result['ok'] else 'FAIL'}", all_ranks=True)
    return result["ok"]
