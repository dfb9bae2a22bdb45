"""Exercise 06 -- gradient accumulation under DDP, with no_sync().

Each rank holds a list of micro-batches for one optimizer step. Complete ``accumulate`` so that,
after it returns, every parameter's ``.grad`` holds the gradient of the *mean* loss over all the
micro-batches of all ranks -- exactly what one big batch would give -- and, with
``use_no_sync=True``, DDP all-reduces only once (during the last micro-step), not once per
micro-step. With ``use_no_sync=False`` every micro-step all-reduces (the baseline to compare with).

Where ``no_sync()`` must go follows from lesson 06, section 2: which of DDP's methods reads the flag
it sets?

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/06_no_sync.py

It checks itself against one big batch on a plain model, counts DDP's all-reduces with a
communication hook, and prints PASS or FAIL on every rank. The course's grader runs it the same way
and explains what is wrong:

    python -m ddp_course check 06 lessons/exercises/06_no_sync.py
"""

import contextlib
import json
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.course.l06_grad_accumulation import grad_check as lab
from ddp_course.dist import log, setup

MICRO_BATCH_SIZE, BLOCK_SIZE, SEED = 4, 32, 0
# (name, micro-batch indices of this optimizer step, use_no_sync): K = 4 twice, then a leftover of 3
CASES = [("K=4 with no_sync", [0, 1, 2, 3], True),
         ("K=4 without no_sync", [0, 1, 2, 3], False),
         ("leftover of 3 with no_sync", [4, 5, 6], True)]


def accumulate(model: DDP, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], use_no_sync: bool = True) -> None:
    """Forward and backward over every micro-batch (x, y); ``model(x, y)`` returns (logits, mean loss).

    Leave in .grad the gradient of the mean loss over all micro-batches (they are all the same
    size). Do not step or zero anything: the caller does.
    """
    # TODO: forward and backward of each micro-batch's loss / K; with use_no_sync, no micro-step but the last may all-reduce (section 2: when does DDP read the flag no_sync sets?)
    raise NotImplementedError("exercise: complete this part")


def main() -> None:
    with setup(device="cpu") as info:
        model = lab.tiny_model(SEED, block_size=BLOCK_SIZE)
        reference = lab.tiny_model(SEED, block_size=BLOCK_SIZE)  # same weights, one process, one big batch
        ddp = DDP(model)
        counter = lab.AllReduceCounter(ddp)  # counts DDP's all-reduces and the micro-step each ran in
        data = {"micro_batch_size": MICRO_BATCH_SIZE, "block_size": BLOCK_SIZE, "seed": SEED}

        for _ in range(2):  # a plain synced backward (twice: DDP re-buckets after the first) counts the buckets
            counter.reset()
            _, loss = ddp(*lab.micro_batch(0, info.rank, **data))
            loss.backward()
            ddp.zero_grad(set_to_none=True)
        n_buckets = counter.calls

        cases, ok = [], True
        for name, indices, use_no_sync in CASES:
            ddp.require_backward_grad_sync = True  # a clean start, whatever the last case left behind
            counter.reset()
            accumulate(ddp, [lab.micro_batch(i, info.rank, **data) for i in indices], use_no_sync=use_no_sync)
            got = lab.compare(model, lab.reference_gradient(reference, indices, info.world_size, **data))
            spread = lab.replica_spread(model)
            norms = {n: (p.grad.norm().item() if p.grad is not None else 0.0) for n, p in model.named_parameters()}
            ddp.zero_grad(set_to_none=True)
            want = [len(indices) - 1] if use_no_sync else list(range(len(indices)))
            # 1e-5: the same mean summed in another order differs by ~1e-7 (see ddp_course.course.l06_grad_accumulation.no_sync_lab)
            case_ok = got["rel_err"] <= 1e-5 and counter.synced_micro_steps == want
            ok = ok and case_ok
            log(f"{name}: all-reducing micro-steps {counter.synced_micro_steps} (expected {want}), gradient vs one "
                f"big batch: rel. error {got['rel_err']:.1e} -> {'PASS' if case_ok else 'FAIL'}", all_ranks=True)
            cases.append({"name": name, "indices": indices, "micro_batches": len(indices),
                          "use_no_sync": use_no_sync,
                          "synced_micro_steps": counter.synced_micro_steps, "bucket_all_reduces": counter.calls,
                          "forwards": counter.forwards, "replica_max_diff": spread, "param_grad_norms": norms,
                          **got})
        sys.stdout.write("RESULT " + json.dumps({"rank": info.rank, "world_size": info.world_size, "data": data,
                                      "n_buckets": n_buckets, "cases": cases, "ok": ok}) + "\n")  # one write: the lines of two ranks cannot interleave
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
