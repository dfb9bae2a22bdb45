"""What exercise 14 (ring attention) measures of a learner's three functions, on every rank.

:func:`measure` runs the ring's forward loop (``ring_loop.ring_forward``) with the learner's ``pass_on``
(send to the next rank, receive from the previous), ``block_scores`` (one block of scores, causal by
global position) and ``merge`` (the running output and log-sum-exp with one more block's), on rings of
2 ranks (the world in pairs) and of all the ranks, in both layouts, in float64, and compares each output
with one process's ``scaled_dot_product_attention``. Then once more on the ring of all the ranks in
float32, with scores in the hundreds (:data:`LARGE`): the size at which ``exp`` of a log-sum-exp leaves
float32's range (its largest value is about e^88.7), which small float64 scores never reach.

Beside each float64 output, what each classic mistake computes on the same ring (:func:`mistaken`), so
that the grader can name the mistake nearest to the learner's. Those are worked out in one process from
what the mistake changes -- the mask, or how the blocks are added -- with no ring and none of the
exercise's three functions. :func:`report` prints one line per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_course.course.l14_sequences_and_experts import ring_loop as L
from ddp_course.dist import log

# float64: the ring and PyTorch's kernel differ by rounding only, ~1e-15 relative (the lab measures it);
# every classic mistake is off by 1e-2 or more. 1e-10 lies between them, far from both.
RTOL = 1e-10
# The float32 run with large scores: q and k drawn with standard deviation LARGE, so that the scores
# (q.k / sqrt(D), standard deviation LARGE**2) reach the hundreds (403 with the harness's seed). A right
# answer stays within float32's rounding of those scores (a score of 400 is rounded by ~2e-5, which moves
# its weight by as much, relatively): 2e-8 to 2e-6 relative on the output, measured over the ranks and over
# several spellings of the answer (tests/exercises/test_exercise_14.py); a merge that overflows gives inf
# or NaN, and every other mistake an error of order 1. 1e-3 lies between them, far from both.
LARGE, LARGE_RTOL = 10.0, 1e-3
MISTAKES = ("mask by local position", "no causal mask", "merge without rescaling (sum)",
            "merge without rescaling (mean)")


def mistaken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: L.Ring) -> dict[str, torch.Tensor]:
    """This rank's output on ``ring`` with each classic mistake (q, k, v: the whole sequence), in one process.

    The ring computes a block only when its key chunk does not come after its query chunk. A mistake in
    the mask changes which keys a query sees, and the blocks are then merged into the softmax over those:
    attention with that mask. A merge without rescaling adds the blocks' outputs, each normalised by its
    own block's softmax: summed, or averaged pairwise in the order the ring computes them (the first
    block taken as it is, then ``(out + out_blk) / 2`` for each next one)."""
    seq = q.shape[-2]
    c = seq // L.n_chunks(ring.kind, ring.size)
    pos = torch.arange(seq)
    chunk, local = pos // c, pos % c
    computed = chunk[None, :] <= chunk[:, None]  # [query, key]: the key's block is computed
    causal = pos[None, :] <= pos[:, None]
    mine = lambda t: L.shard(t, ring.kind, ring.size, ring.rank)  # noqa: E731
    out = {"mask by local position": mine(F.scaled_dot_product_attention(
               q, k, v, attn_mask=computed & (local[None, :] <= local[:, None]))),
           "no causal mask": mine(F.scaled_dot_product_attention(q, k, v, attn_mask=computed))}

    def block(qc: int, kc: int) -> torch.Tensor:  # one block's output, normalised by its own softmax
        rows, cols = slice(qc * c, qc * c + c), slice(kc * c, kc * c + c)
        return F.scaled_dot_product_attention(q[..., rows, :], k[..., cols, :], v[..., cols, :],
                                              attn_mask=causal[rows, cols])

    summed, averaged = [], []
    for i, qc in enumerate(ring.chunks()):
        summed.append(sum(block(qc, kc) for kc in range(qc + 1)))
        order = [ring.chunks(ring.owner(step))[j] for step in range(ring.size)
                 for i2, j, _, _ in L.pairs(ring, step, seq) if i2 == i]  # the key chunks, as the ring meets them
        acc = block(qc, order[0])
        for kc in order[1:]:
            acc = (acc + block(qc, kc)) / 2
        averaged.append(acc)
    out["merge without rescaling (sum)"] = torch.cat(summed, dim=-2)
    out["merge without rescaling (mean)"] = torch.cat(averaged, dim=-2)
    return out


def _run(pass_on: Callable, block_scores: Callable, merge: Callable, mine: list[torch.Tensor], ring: L.Ring
         ) -> torch.Tensor:
    """The ring's forward with the learner's three functions: this rank's output."""
    nxt, prv = ring.neighbours()
    out, _ = L.ring_forward(*mine, ring, scores=block_scores, combine=merge,
                            exchange=lambda t: (pass_on(t, nxt, prv), []))
    return out


def large_scores(pass_on: Callable, block_scores: Callable, merge: Callable, *, seq: int, heads: int, head_dim: int,
                 seed: int) -> dict[str, Any]:
    """The learner's ring of all the ranks (zigzag) in float32 with scores in the hundreds, against one
    process's attention in float64 on the same numbers."""
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(1, heads, seq, head_dim, generator=g) * s for s in (LARGE, LARGE, 1.0))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    scores = (q.double() @ k.double().transpose(-2, -1) / head_dim ** 0.5).tril()
    ring = L.Ring("zigzag")
    out = _run(pass_on, block_scores, merge, [L.shard(t, "zigzag", ring.size, ring.rank) for t in (q, k, v)], ring)
    finite = bool(torch.isfinite(out).all())
    return {"dtype": str(out.dtype)[6:], "largest_score": float(scores.abs().max()), "finite": finite,
            "error": L.relative_error(out.double(), L.shard(ref, "zigzag", ring.size, ring.rank)) if finite else None}


def measure(pass_on: Callable, block_scores: Callable, merge: Callable, *, seq: int = 32, heads: int = 2,
            head_dim: int = 8, seed: int = 0) -> dict[str, Any]:
    """This rank's errors against one process for every ring and layout, and each classic mistake's; then
    the float32 run with large scores. Collective: every rank must call it."""
    world, me = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)] if world > 2 else [None]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, heads, seq, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors: dict[str, float] = {}
    mistakes: dict[str, dict[str, float]] = {}
    for size, group in ((2, pairs[me // 2]), (world, None)):
        for kind in L.LAYOUTS:
            ring = L.Ring(kind, group)
            out = _run(pass_on, block_scores, merge, [L.shard(t, kind, size, ring.rank) for t in (q, k, v)], ring)
            key = f"{size} ranks, {kind}"
            errors[key] = L.relative_error(out, L.shard(ref, kind, size, ring.rank))
            mistakes[key] = {name: L.relative_error(out, m) for name, m in mistaken(q, k, v, ring).items()}
            mistakes[key]["(as one process)"] = errors[key]
    large = large_scores(pass_on, block_scores, merge, seq=seq, heads=heads, head_dim=head_dim, seed=seed)
    ok = max(errors.values()) <= RTOL and large["finite"] and large["error"] <= LARGE_RTOL
    return {"rank": me, "world_size": world, "errors": errors, "mistakes": mistakes, "large": large, "ok": ok}


def report(result: dict[str, Any]) -> bool:
    """One line per rank: its worst error, the float32 run with large scores, PASS or FAIL."""
    worst = max(result["errors"], key=result["errors"].get)
    large = result["large"]
    big = f"{large['error']:.1e}" if large["finite"] else "not finite"
    log(f"rank {result['rank']}: largest difference from one process {result['errors'][worst]:.1e} ({worst}); "
        f"{large['dtype']}, scores up to {large['largest_score']:.0f}: {big} -> {'PASS' if result['ok'] else 'FAIL'}",
        all_ranks=True)
    return result["ok"]
