"""The ring's frame: the sequence split over the ranks, and the loop of the ring's forward pass.

Each rank holds the queries, keys and values of its part of the sequence, as chunks: the sequence is
cut into ``n_chunks`` equal chunks and :func:`layout` says which chunks each rank holds --

- ``plain``: p chunks, rank r holds chunk r (the natural split);
- ``zigzag``: 2p chunks, rank r holds chunks r and 2p-1-r (one early, one late: under a causal mask the
  early one sees little of the sequence and the late one much, so every rank gets the same work).

:func:`ring_forward` is the loop: the keys and values travel round the ring, at step s rank r holds
those of rank r-s, and for every pair (a query chunk of its own, a key chunk it holds now) that the
causal mask does not wholly hide (:func:`pairs`) it computes one block of scores, the block's
softmax-weighted values and log-sum-exp, and folds them into the running output. The three pieces the
loop calls -- the exchange with the neighbours, one block's scores, the fold -- are its caller's:
``ring.py`` passes the lesson's, exercise 14 passes the learner's.

:class:`Ring` also counts what the lesson measures: score elements and blocks computed per rank, the
CPU seconds spent computing them, the bytes sent. :func:`predicted_work` and :func:`predicted_bytes`
give the formulas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

LAYOUTS = ("plain", "zigzag")


def layout(kind: str, world_size: int) -> list[list[int]]:
    """The chunks each rank holds: ``plain`` -> [[0], [1], ...]; ``zigzag`` -> [[0, 2p-1], [1, 2p-2], ...]."""
    if kind == "plain":
        return [[r] for r in range(world_size)]
    if kind == "zigzag":
        return [[r, 2 * world_size - 1 - r] for r in range(world_size)]
    raise ValueError(f"unknown layout {kind!r}; choose from {', '.join(LAYOUTS)}")


def n_chunks(kind: str, world_size: int) -> int:
    return sum(len(c) for c in layout(kind, world_size))


def shard(x: torch.Tensor, kind: str, world_size: int, rank: int, dim: int = -2) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor (its chunks, in the order ``layout`` lists them)."""
    parts = x.chunk(n_chunks(kind, world_size), dim=dim)
    return torch.cat([parts[c] for c in layout(kind, world_size)[rank]], dim=dim)


def unshard(parts: list[torch.Tensor], kind: str, dim: int = -2) -> torch.Tensor:
    """The whole-sequence tensor from every rank's part (the inverse of :func:`shard`)."""
    world = len(parts)
    chunks: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        ids = layout(kind, world)[rank]
        for c, piece in zip(ids, part.chunk(len(ids), dim=dim)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=dim)


def positions(kind: str, world_size: int, rank: int, seq_len: int) -> torch.Tensor:
    """The global positions of this rank's tokens, in its order (for the position embedding)."""
    return shard(torch.arange(seq_len), kind, world_size, rank, dim=0)


@dataclass
class Ring:
    """A ring of ranks over a process group, the sequence layout, and what the ranks measured."""

    kind: str = "zigzag"
    group: dist.ProcessGroup | None = None
    blocks: int = 0  # score blocks computed (forward), the diagonal ones included
    score_elements: int = 0  # score entries computed (forward; a diagonal block counts whole)
    compute_s: float = 0.0  # CPU seconds this rank spent computing, forward and backward (its steps, not its waits)
    block_s: dict[str, float] = field(default_factory=lambda: {"diagonal": 0.0, "below": 0.0})  # of which in blocks
    block_count: dict[str, int] = field(default_factory=lambda: {"diagonal": 0, "below": 0})  # forward + backward
    bytes_sent: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    max_block_elements: int = 0  # the largest score block this rank held

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def chunks(self, rank: int | None = None) -> list[int]:
        return layout(self.kind, self.size)[self.rank if rank is None else rank]

    def owner(self, step: int) -> int:
        """The rank (in the group) whose keys and values this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def neighbours(self) -> tuple[int, int]:
        """(the next rank, the previous rank) round the ring, as global ranks (what send and recv take)."""
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        if self.group is None:
            return nxt, prv
        return dist.get_global_rank(self.group, nxt), dist.get_global_rank(self.group, prv)

    def reset(self) -> None:
        self.blocks = self.score_elements = self.max_block_elements = 0
        self.compute_s = 0.0
        self.block_s, self.block_count = {"diagonal": 0.0, "below": 0.0}, {"diagonal": 0, "below": 0}
        self.bytes_sent = {"forward": 0, "backward": 0}

    def timed_block(self, diagonal: bool, t0: float) -> None:
        """Count one block (forward or backward) computed since ``t0`` (``time.thread_time``)."""
        kind = "diagonal" if diagonal else "below"
        self.block_s[kind] += time.thread_time() - t0
        self.block_count[kind] += 1


def predicted_work(kind: str, world_size: int, seq_len: int) -> list[dict[str, int]]:
    """Per rank: the score blocks and score entries a causal ring computes (a block is skipped when its
    key chunk lies after its query chunk; a diagonal block is computed whole, then masked)."""
    out = []
    c = seq_len // n_chunks(kind, world_size)
    every = sorted(ch for r in range(world_size) for ch in layout(kind, world_size)[r])
    for rank in range(world_size):
        blocks = sum(1 for q in layout(kind, world_size)[rank] for k in every if k <= q)
        out.append({"blocks": blocks, "score_elements": blocks * c * c})
    return out


def predicted_bytes(world_size: int, local_kv_bytes: int) -> dict[str, int]:
    """Bytes each rank sends: forward, p-1 hops of its keys and values (``local_kv_bytes`` = k and v);
    backward, p-1 hops of keys and values again and p hops of their gradients (the last one home)."""
    p = world_size
    return {"forward": (p - 1) * local_kv_bytes, "backward": (2 * p - 1) * local_kv_bytes}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: how far this rank's result is from one process's, relative to its size."""
    return float((a - b).detach().norm() / b.detach().norm())


def pairs(ring: Ring, step: int, seq_len: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(index of my query chunk, index of the held key chunk, their positions) for every block the
    causal mask does not wholly hide, at ``step``, in the order the loop computes them."""
    c = seq_len // n_chunks(ring.kind, ring.size)
    mine, held = ring.chunks(), ring.chunks(ring.owner(step))
    for i, qc in enumerate(mine):
        for j, kc in enumerate(held):
            if kc <= qc:
                yield i, j, torch.arange(qc * c, qc * c + c), torch.arange(kc * c, kc * c + c)


Exchange = Callable[[torch.Tensor], tuple[torch.Tensor, list]]  # t -> (the previous rank's t, requests to wait on)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                 scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 combine: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 exchange: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass: (out, lse) for this rank's queries, out (B, H, S_local, D), lse (B, H, S_local).

    ``scores(q, k, qpos, kpos)`` gives one block's scores, ``combine(out, lse, out_blk, lse_blk)`` folds
    one block into the running output and log-sum-exp (before the first block: zeros and -inf), and
    ``exchange(t)`` hands ``t`` to the next rank: it returns the buffer the previous rank's ``t`` arrives
    in and the requests to wait on before reading it (none when it has already arrived). The exchange
    starts before the step's computation, so a non-blocking one overlaps it."""
    n_mine = len(ring.chunks())
    seq_len = q.shape[-2] * ring.size
    qs = q.chunk(n_mine, dim=-2)
    outs = [torch.zeros_like(x) for x in qs]
    lses = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype) for x in qs]
    kv = torch.stack([k, v])
    for step in range(ring.size):
        reqs: list = []
        if step < ring.size - 1:
            nxt, reqs = exchange(kv)  # in flight while this step computes, when the exchange does not block
        t0 = time.thread_time()
        ks, vs = kv[0].chunk(n_mine, dim=-2), kv[1].chunk(n_mine, dim=-2)
        for i, j, qpos, kpos in pairs(ring, step, seq_len):
            tb = time.thread_time()
            s = scores(qs[i], ks[j], qpos, kpos)
            ring.blocks += 1
            ring.score_elements += s.shape[-2] * s.shape[-1]
            ring.max_block_elements = max(ring.max_block_elements, s.numel())
            lse_blk = torch.logsumexp(s, dim=-1)
            outs[i], lses[i] = combine(outs[i], lses[i], torch.exp(s - lse_blk[..., None]) @ vs[j], lse_blk)
            ring.timed_block(int(qpos[0]) == int(kpos[0]), tb)
        ring.compute_s += time.thread_time() - t0
        for r in reqs:
            r.wait()
        if step < ring.size - 1:
            kv = nxt
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
