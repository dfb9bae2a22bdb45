"""Ring attention by hand: causal attention over a sequence split across the ranks of a ring.

Each rank holds the queries, keys and values of its part of the sequence, as chunks: the sequence is
cut into ``n_chunks`` equal chunks and :func:`layout` says which chunks each rank holds --

- ``plain``: p chunks, rank r holds chunk r (the natural split);
- ``zigzag``: 2p chunks, rank r holds chunks r and 2p-1-r (one early, one late: under a causal mask the
  early one sees little of the sequence and the late one much, so every rank gets the same work).

**Forward.** The keys and values travel round the ring: at step s, rank r holds those of rank r-s, and
before computing with them it already sends them on to rank r+1 and posts the receive of the next ones
(``isend`` / ``irecv`` return at once; it waits for them after computing). For every pair (a query chunk of its own,
a key chunk it holds now) it computes one block of scores -- skipped when the key chunk lies wholly after
the query chunk (causal: nothing to see), masked by *global* position on the diagonal -- and merges the
block's softmax-weighted values into the running output with the log-sum-exp of the scores:

    lse = logaddexp(lse_old, lse_blk);  out = out_old * exp(lse_old - lse) + out_blk * exp(lse_blk - lse)

which is exactly softmax over all the key blocks seen so far (the online softmax of flash attention,
over ranks). A rank holds the scores of one block at a time (with their by-products: the probabilities,
and in backward their gradient), never the whole score matrix.

**Backward**, by hand (:class:`RingAttention`): with the final ``lse`` saved, every block's softmax
probabilities can be recomputed exactly (``P = exp(S - lse)``); the query gradient stays home, and the
key and value gradients travel round the ring *with* their keys and values, each rank adding its
block's share, then one last hop brings them back to their owner. Why by hand: ``irecv`` fills a buffer
made by ``torch.empty_like`` (:meth:`Ring.pass_on`), which has no autograd history, so nothing would carry
a gradient back to the rank that sent the keys; and recomputing P from the saved lse keeps one block of
probabilities alive at a time instead of p.

:class:`Ring` also counts what the lesson measures: score elements and blocks computed per rank, the
CPU seconds spent computing them, the bytes sent. :func:`predicted_work` and :func:`predicted_bytes`
give the formulas.
"""

from __future__ import annotations

import math
import time
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

    def pass_on(self, t: torch.Tensor, phase: str) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer, without
        waiting: returns the buffer and the two requests (wait on them before reading the buffer)."""
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size) if self.group else (self.rank + 1) % self.size
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.size) if self.group else (self.rank - 1) % self.size
        t = t.contiguous()
        buf = torch.empty_like(t)
        reqs = [dist.isend(t, nxt, group=self.group), dist.irecv(buf, prv, group=self.group)]
        self.bytes_sent[phase] += t.numel() * t.element_size()
        return buf, reqs


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


def _block(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores of one block, masked by global position: (B, H, cq, ck); -inf where key after query."""
    s = (q @ k.transpose(-2, -1)) * scale
    if int(kpos.max()) > int(qpos.min()):  # only the diagonal blocks need the mask
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _pairs(ring: Ring, step: int, seq_len: int):
    """(index of my query chunk, index of the held key chunk, their positions) for every block the
    causal mask does not wholly hide, at ``step``."""
    c = seq_len // n_chunks(ring.kind, ring.size)
    mine, held = ring.chunks(), ring.chunks(ring.owner(step))
    for i, qc in enumerate(mine):
        for j, kc in enumerate(held):
            if kc <= qc:
                yield i, j, torch.arange(qc * c, qc * c + c), torch.arange(kc * c, kc * c + c)


def merge(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output and log-sum-exp with one more block's: both outputs rescaled to the new total."""
    new = torch.logaddexp(lse, lse_blk)
    return out * torch.exp(lse - new)[..., None] + out_blk * torch.exp(lse_blk - new)[..., None], new


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *, scores=None, combine=None,
                 send=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass: (out, lse) for this rank's queries, out (B, H, S_local, D), lse (B, H, S_local).

    ``scores(q, k, qpos, kpos)``, ``combine(out, lse, out_blk, lse_blk)`` and ``send(t)`` (the previous
    rank's tensor, after sending ``t`` on) replace this module's own (exercise 14 passes a learner's);
    a ``send`` given here runs before the step's computation, not beside it."""
    n_mine = len(ring.chunks())
    seq_len = q.shape[-2] * ring.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = scores or (lambda q, k, qpos, kpos: _block(q, k, qpos, kpos, scale))
    combine = combine or merge
    qs = q.chunk(n_mine, dim=-2)
    outs = [torch.zeros_like(x) for x in qs]
    lses = [torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype) for x in qs]
    kv = torch.stack([k, v])
    for step in range(ring.size):
        reqs: list[dist.Work] = []
        if step < ring.size - 1:
            if send is None:
                nxt, reqs = ring.pass_on(kv, "forward")  # in flight while this step computes
            else:
                nxt = send(kv)
        t0 = time.thread_time()
        ks, vs = kv[0].chunk(n_mine, dim=-2), kv[1].chunk(n_mine, dim=-2)
        for i, j, qpos, kpos in _pairs(ring, step, seq_len):
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


def ring_backward(q, k, v, out, lse, dout, ring: Ring) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's tensors. Every block's probabilities are recomputed from the final lse:
    P = exp(S - lse); dV += P^T dO; dS = P * (dO V^T - rowsum(dO * O)); dQ += dS K; dK += dS^T Q (scaled)."""
    n_mine = len(ring.chunks())
    seq_len = q.shape[-2] * ring.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs, outs, dos = q.chunk(n_mine, dim=-2), out.chunk(n_mine, dim=-2), dout.chunk(n_mine, dim=-2)
    lses = lse.chunk(n_mine, dim=-1)
    deltas = [(d * o).sum(-1) for d, o in zip(dos, outs)]  # rowsum(dO * O): the softmax's backward term
    dqs = [torch.zeros_like(x) for x in qs]
    kv = torch.stack([k, v])
    dkv_reqs: list[dist.Work] = []
    dkv_in = None
    for step in range(ring.size):
        kv_reqs: list[dist.Work] = []
        if step < ring.size - 1:
            kv_next, kv_reqs = ring.pass_on(kv, "backward")
        t0 = time.thread_time()
        ks, vs = kv[0].chunk(n_mine, dim=-2), kv[1].chunk(n_mine, dim=-2)
        dks, dvs = [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
        for i, j, qpos, kpos in _pairs(ring, step, seq_len):
            tb = time.thread_time()
            p = torch.exp(_block(qs[i], ks[j], qpos, kpos, scale) - lses[i][..., None])
            dvs[j] += p.transpose(-2, -1) @ dos[i]
            ds = p * (dos[i] @ vs[j].transpose(-2, -1) - deltas[i][..., None])
            dqs[i] += (ds @ ks[j]) * scale
            dks[j] += (ds.transpose(-2, -1) @ qs[i]) * scale
            ring.timed_block(int(qpos[0]) == int(kpos[0]), tb)
        mine = torch.stack([torch.cat(dks, dim=-2), torch.cat(dvs, dim=-2)])
        ring.compute_s += time.thread_time() - t0
        for r in dkv_reqs:  # the gradients of these keys and values so far, from the previous rank
            r.wait()
        travelling = mine if dkv_in is None else dkv_in + mine
        dkv_in, dkv_reqs = ring.pass_on(travelling, "backward")  # on to the next holder; the last hop: home
        for r in kv_reqs:
            r.wait()
        if kv_reqs:
            kv = kv_next
    for r in dkv_reqs:
        r.wait()
    return torch.cat(dqs, dim=-2), dkv_in[0], dkv_in[1]


class RingAttention(torch.autograd.Function):
    """Causal attention over the ring, forward and backward by hand (see the module's docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, dout.contiguous(), ctx.ring)
        return dq, dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: q, k, v (B, H, S_local, D) in
    ``ring.kind``'s layout -> (B, H, S_local, D), differentiable."""
    return RingAttention.apply(q, k, v, ring)
