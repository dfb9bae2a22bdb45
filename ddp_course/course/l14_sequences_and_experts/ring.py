"""Ring attention by hand: causal attention over a sequence split across the ranks of a ring.

The sequence split, the ring's counters and the loop of the forward pass are ``ring_loop``'s (this module
gives them under the same names); here are the lesson's own pieces for that loop, and the backward.

**Forward** (:func:`ring_forward`): before computing with the keys and values it holds, a rank already
sends them on to rank r+1 and posts the receive of the next ones (:meth:`Ring.pass_on`: ``isend`` /
``irecv`` return at once; it waits for them after computing). For every block it computes (:func:`_block`:
skipped when the key chunk lies wholly after the query chunk, masked by *global* position on the
diagonal) it merges the block's softmax-weighted values into the running output with the log-sum-exp
of the scores (:func:`merge`):

    lse = logaddexp(lse_old, lse_blk);  out = out_old * exp(lse_old - lse) + out_blk * exp(lse_blk - lse)

which is exactly softmax over all the key blocks seen so far (the online softmax of flash attention,
over ranks), and never exponentiates a log-sum-exp itself: each weight is the exponential of a difference,
at most 0, so it holds for scores of any size. A rank computes the scores of one block at a time (with
their by-products: the probabilities, and in backward their gradient), never the whole score matrix.

**Backward**, by hand (:class:`RingAttention`): with the final ``lse`` saved, every block's softmax
probabilities can be recomputed exactly (``P = exp(S - lse)``); the query gradient stays home, and the
key and value gradients travel round the ring *with* their keys and values, each rank adding its
block's share, then one last hop brings them back to their owner. Why by hand: ``irecv`` fills a buffer
made by ``torch.empty_like`` (:meth:`Ring.pass_on`), which has no autograd history, so nothing would carry
a gradient back to the rank that sent the keys; and recomputing P from the saved lse keeps one block of
probabilities alive at a time instead of p.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ddp_course.course.l14_sequences_and_experts import ring_loop
from ddp_course.course.l14_sequences_and_experts.ring_loop import (  # noqa: F401  (the lesson's names for them)
    LAYOUTS,
    layout,
    n_chunks,
    pairs,
    positions,
    predicted_bytes,
    predicted_work,
    relative_error,
    shard,
    unshard,
)


class Ring(ring_loop.Ring):
    """``ring_loop.Ring`` with the lesson's exchange between neighbours."""

    def pass_on(self, t: torch.Tensor, phase: str) -> tuple[torch.Tensor, list[dist.Work]]:
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer, without
        waiting: returns the buffer and the two requests (wait on them before reading the buffer)."""
        nxt, prv = self.neighbours()
        t = t.contiguous()
        buf = torch.empty_like(t)
        reqs = [dist.isend(t, nxt, group=self.group), dist.irecv(buf, prv, group=self.group)]
        self.bytes_sent[phase] += t.numel() * t.element_size()
        return buf, reqs


def _block(q: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores of one block, masked by global position: (B, H, cq, ck); -inf where key after query."""
    s = (q @ k.transpose(-2, -1)) * scale
    if int(kpos.max()) > int(qpos.min()):  # only the diagonal blocks need the mask
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def merge(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running output and log-sum-exp with one more block's: both outputs rescaled to the new total."""
    new = torch.logaddexp(lse, lse_blk)
    return out * torch.exp(lse - new)[..., None] + out_blk * torch.exp(lse_blk - new)[..., None], new


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass with the lesson's pieces: (out, lse) for this rank's queries, out (B, H, S_local, D),
    lse (B, H, S_local). The keys and values are in flight while each step computes."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    return ring_loop.ring_forward(q, k, v, ring, scores=lambda q, k, qpos, kpos: _block(q, k, qpos, kpos, scale),
                                  combine=merge, exchange=lambda t: ring.pass_on(t, "forward"))


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
        for i, j, qpos, kpos in pairs(ring, step, seq_len):
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
