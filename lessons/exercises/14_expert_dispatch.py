"""Exercise 14, second part -- expert dispatch: send every token to its expert's rank, and bring it home.

The mixture-of-experts MiniGPT of the lesson (``experts_base.moe_gpt``: 8 experts per block, top-2 routing, a
capacity below the load so that slots drop) is spread over 4 ranks: rank q keeps experts ``2q`` and
``2q + 1`` of every block, and every rank routes its own quarter of the global batch. The routing, the
capacity and the experts are given; the exchanges are yours. Complete the three functions below:

- ``dispatch``: send this rank's token-slots (already sorted by expert) to the ranks of their experts.
  The row counts are uneven and only the senders know them, so first exchange the per-expert counts
  (``dist.all_to_all_single`` of the (E,) counts) to learn how many rows arrive from each rank; then send
  the rows with uneven splits, in an exchange that carries gradients (``AllToAll.apply`` of the lesson,
  or ``torch.distributed.nn.functional.all_to_all_single``); then regroup the arrivals by local expert;
- ``combine``: the reverse -- undo the regroup, send every row back to the rank it came from, put each
  row back at its token-slot's position (the slots were sorted by expert), weight it by its gate and add
  each token's two slots;
- ``sync_gradients``: after backward, make every gradient this rank holds the one a single process
  would have for the whole global batch's loss (the mean of the ranks' losses): the replicated
  parameters' (every rank holds a copy) and the experts' (each lives on one rank).

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=4 lessons/exercises/14_expert_dispatch.py

The harness below runs one step of your expert-parallel model on every rank's rows beside one process
on the whole batch, in float64, and compares the loss, the first gradient of every parameter each rank
holds, the rows each expert received (how many, which, in which order) and the slots dropped; it prints
PASS or FAIL on every rank. The course's grader runs it the same way and names what went wrong:

    python -m ddp_course check 14 lessons/exercises/14_expert_dispatch.py
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.course.l14_sequences_and_experts.experts_base import AllToAll, Exchange, expert_parameters
from ddp_course.course.l14_sequences_and_experts.experts_harness import report, run_side_by_side
from ddp_course.dist import setup

SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
N_EXPERTS, TOP_K, CAPACITY_FACTOR, AUX_COEF = 8, 2, 0.75, 0.01
BATCH_SIZE, SEED = 8, 0


def dispatch(slots: torch.Tensor, counts: torch.Tensor, group=None) -> tuple[torch.Tensor, Exchange]:
    """Send this rank's token-slots to the ranks of their experts.

    In: ``slots`` (S, C) this rank's token-slots sorted by expert (within an expert in slot order) and
    ``counts`` (E,) how many of them go to each expert; rank q holds experts ``q E/p .. (q+1) E/p - 1``.
    Out: ``grouped``, the rows this rank's experts must process, grouped by local expert and, inside a
    group, by source rank (rank 0's rows first) -- the priority order the capacity follows -- and an
    ``Exchange(send_splits, recv_splits, from_rank, regroup)``: ``from_rank`` a (p, E/p) tensor, the rows received
    from each rank for each local expert (the harness reads it), the rest whatever ``combine`` needs.
    """
    # TODO: the rows this rank's experts must process, grouped by local expert, and the Exchange combine needs
    raise NotImplementedError("exercise: complete this part")


def combine(outputs: torch.Tensor, ex: Exchange, order: torch.Tensor, gate: torch.Tensor,
            group=None) -> torch.Tensor:
    """Bring the experts' outputs home and mix them: the reverse of ``dispatch``.

    In: ``outputs`` the experts' outputs in ``dispatch``'s grouped order (zeros for dropped slots), ``ex``
    its Exchange, ``order`` (S,) the sort that put this rank's slots in expert order (``slots =
    token_slots[order]``) and ``gate`` (N, k) this rank's gates, N tokens of k slots each (S = N k).
    Out: (N, C), each token's gate-weighted sum of its k slots' outputs.
    """
    # TODO: each of this rank's tokens: the gate-weighted sum of its slots' expert outputs
    raise NotImplementedError("exercise: complete this part")


def sync_gradients(model: nn.Module, group=None) -> None:
    """After backward of this rank's loss (the mean over its tokens): every gradient equal to one process's
    gradient of the global batch's loss. ``expert_parameters(model)`` gives the ``id`` of each parameter
    that lives on this rank only."""
    # TODO: every gradient one process's gradient of the global batch's loss
    raise NotImplementedError("exercise: complete this part")


def main() -> None:
    with setup(device="cpu", threads=1, because="expert parallelism by hand with gloo's all_to_all_single") as info:
        result = run_side_by_side(dispatch, combine, sync_gradients, info, shape=SHAPE, n_experts=N_EXPERTS,
                                  top_k=TOP_K, capacity_factor=CAPACITY_FACTOR, aux_coef=AUX_COEF,
                                  batch_size=BATCH_SIZE, seed=SEED)
        ok = report(result, info)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
