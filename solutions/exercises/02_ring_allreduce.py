"""Exercise 02 -- a ring all-reduce, built from point-to-point messages.

``dist.all_reduce`` hides an algorithm. Here you write the one NCCL and gloo use for large
messages: the ranks form a ring (rank r sends to rank r+1 and receives from rank r-1) and the
tensor is cut into ``n`` chunks, one per rank.

1. **Reduce-scatter** (n - 1 steps): at every step each rank sends one chunk to its right-hand
   neighbour and adds the chunk arriving from its left into its own copy of that chunk. After
   n - 1 steps every rank holds one chunk that is summed over all ranks.
2. **All-gather** (n - 1 steps): the finished chunks travel once more around the ring; each rank
   copies what arrives into place, until every rank has every summed chunk.

Each rank sends 2 (n - 1) chunks of about N / n elements: 2 (n - 1) / n times the message, however
many ranks there are. Complete ``ring_all_reduce`` using only ``ring.exchange``. Sizes that do not
divide by the number of ranks (and sizes smaller than it) must work too: ``tensor_split`` cuts
chunks whose lengths differ by at most one.

Run it (from the repository root); it checks itself against ``dist.all_reduce`` and prints
PASS or FAIL on every rank:

    torchrun --standalone --nproc_per_node=4 lessons/exercises/02_ring_allreduce.py

The course's grader runs it with 2 and with 4 processes:

    python -m ddp_course check 02 lessons/exercises/02_ring_allreduce.py
"""

import json
import sys

import torch
import torch.distributed as dist

from ddp_course.dist import log, setup

# Sizes smaller than the world size (empty chunks), not divisible by 2 or 4, and one large one.
SIZES = (1, 3, 4, 10, 1000, 4099)


class Ring:
    """This rank's place in the ring, and the one way to talk to the neighbours."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.right = (rank + 1) % world_size  # where this rank sends
        self.left = (rank - 1) % world_size  # where it receives from
        self.messages = 0  # exchange() calls so far
        self.sent = 0  # elements sent so far

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send ``send`` to the right-hand neighbour while receiving ``recv`` from the left (in place).

        Both transfers are posted before waiting for either: if every rank first made a blocking
        send, every rank could wait for its neighbour to receive -- a deadlock once messages are too
        large for the transport's buffers. ``recv`` must have the size of the chunk the left-hand
        neighbour sends at the same step.
        """
        requests = [dist.isend(send.contiguous(), self.right), dist.irecv(recv, self.left)]
        for req in requests:
            req.wait()
        self.messages += 1
        self.sent += send.numel()


def ring_all_reduce(x: torch.Tensor, ring: Ring) -> None:
    """Sum the 1-D tensor ``x`` over all ranks, in place, with a reduce-scatter then an all-gather.

    Uses only ``ring.exchange`` (no torch.distributed collective). Every rank must call it.
    """
    # BEGIN SOLUTION hint: cut x into one chunk per rank (views), then n - 1 reduce-scatter steps and n - 1 all-gather steps, one ring.exchange each. Draw the chunks for n = 3 first.
    n, r = ring.world_size, ring.rank
    chunks = x.tensor_split(n)  # views: writing into a chunk writes into x
    # reduce-scatter: at step s rank r sends chunk (r - s) % n and adds into chunk (r - s - 1) % n,
    # which its left neighbour has just summed over s + 1 ranks. After n - 1 steps chunk (r + 1) % n
    # holds the sum over all n ranks.
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        ring.exchange(chunks[(r - s) % n], incoming)
        chunks[(r - s - 1) % n].add_(incoming)
    # all-gather: at step s rank r passes on the finished chunk (r + 1 - s) % n and receives the
    # finished chunk (r - s) % n straight into place.
    for s in range(n - 1):
        ring.exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n])
    # END SOLUTION


def make_input(size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor of ``size`` elements: standard normal, seeded by (size, rank)."""
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * size + rank))


def main() -> None:
    # A short process-group timeout: if ranks disagree on the messages, they fail in 20 s, not hang.
    with setup(device="cpu", timeout_s=20) as info:
        n, r = info.world_size, info.rank
        ring = Ring(r, n)
        results, ok = [], True
        for size in SIZES:
            x = make_input(size, r)
            want = x.clone()
            dist.all_reduce(want, op=dist.ReduceOp.SUM)  # the reference
            got = x.clone()
            messages, sent = ring.messages, ring.sent
            ring_all_reduce(got, ring)
            messages, sent = ring.messages - messages, ring.sent - sent
            # The ring adds the n contributions in a different order than gloo does, so float32
            # results differ by rounding: each element is a sum of n <= 4 terms of size ~1, a few
            # ulps of ~4 (~1e-6). 1e-5 is above that and far below a real mistake (a missing or
            # doubled contribution changes an element by ~1).
            err = (got - want).abs().max().item() if size else 0.0
            chunks_ok = [bool(torch.allclose(g, w, atol=1e-5, rtol=0))
                         for g, w in zip(got.tensor_split(n), want.tensor_split(n))]
            lo, hi = 2 * (n - 1) * (size // n), 2 * (n - 1) * -(-size // n)  # 2(n-1) chunks of floor..ceil(N/n)
            values_ok = all(chunks_ok)
            traffic_ok = messages == 2 * (n - 1) and lo <= sent <= hi
            ok = ok and values_ok and traffic_ok
            results.append({"size": size, "max_err": err, "chunks_ok": chunks_ok, "values_ok": values_ok,
                            "in_sum": x.double().sum().item(), "in_abs": x.double().abs().sum().item(),
                            "out_sum": got.double().sum().item(), "messages": messages, "sent": sent,
                            "sent_bounds": [lo, hi], "traffic_ok": traffic_ok})
        big = results[-1]
        log(f"sizes {', '.join(map(str, SIZES))}: max |ring - all_reduce| = "
            f"{max(x['max_err'] for x in results):.1e}; sent {big['sent']} elements for {big['size']} "
            f"({big['sent'] / big['size']:.2f}x, 2(n-1)/n = {2 * (n - 1) / n:.2f}) -> {'PASS' if ok else 'FAIL'}",
            all_ranks=True)
        # One write() of the whole line: print() writes the text and the newline separately, and another
        # rank's output could land in between (all ranks share one pipe); a single write under 4 KiB is atomic.
        line = "RESULT " + json.dumps({"rank": r, "world_size": n, "ok": ok, "results": results},
                                      separators=(",", ":")) + "\n"
        sys.stdout.write(line)
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
