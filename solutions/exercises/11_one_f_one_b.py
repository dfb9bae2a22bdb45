"""Exercise 11, second part -- 1F1B by hand: the pipeline schedule whose memory does not grow with m.

The model is cut into p stages, one per rank (``Stage``: rank 0 holds the embeddings and the first
blocks, the last rank the last blocks, the head and the loss). GPipe (the lesson's ``gpipe_step``)
runs every forward, then every backward, so at the end of its forwards a stage holds the activations
of all m micro-batches. 1F1B runs the same forwards and backwards in another order, on each rank:

- a **warm-up** of forwards only: as many as this stage can run before the gradient of its first
  micro-batch can come back to it (how many that is depends on where the stage sits: work it out);
- a **steady phase**: one forward, then one backward, in turn, while forwards are left;
- a **cool-down**: the backwards still owed.

Complete ``one_f_one_b_step``. It receives this rank's stage and the batch already cut into micro-
batches (``xs``, ``ys``: lists of m tensors, the same on every rank). The i-th forward takes its
input from the stage before (the first stage: ``xs[i]``) and sends its output to the stage after
(the last stage: the loss on ``ys[i]`` instead); the i-th backward takes the gradient of its output
from the stage after (the last stage: from its loss) and sends the gradient of its input to the
stage before. Sends and receives are ``torch.distributed``'s point-to-point calls between
neighbouring ranks. The gradients of the m micro-batches accumulate in the parameters' ``.grad``, and
must add up to the gradient of the whole batch's mean loss. Return the batch's mean loss on the last
stage, None elsewhere. m may be smaller than p.

Run it (from the repository root), on 2 ranks and on 4:

    torchrun --standalone --nproc_per_node=2 lessons/exercises/11_one_f_one_b.py
    torchrun --standalone --nproc_per_node=4 lessons/exercises/11_one_f_one_b.py

The harness below runs your step with several m, counts the forwards and backwards each rank ran
and in what order, and the bytes of activations autograd held for backward at most (in micro-
batches), compares every stage's gradients with one process computing the whole batch, and prints
PASS or FAIL. The course's grader runs it on 2 and 4 ranks and names the mistake:

    python -m ddp_course check 11_one_f_one_b lessons/exercises/11_one_f_one_b.py
"""

import json
import sys

import torch
import torch.distributed as dist

from ddp_course.course.l11_beyond_data_parallel.held import SavedBytes
from ddp_course.course.l11_beyond_data_parallel.pp_lab import TIED, Stage, sync_tied, tied_group
from ddp_course.course.tiny import micro_batch, tiny_model
from ddp_course.dist import log, setup

SHAPE = {"block_size": 16, "n_layer": 4, "n_head": 2, "n_embd": 32}
BATCH, SEED = 8, 0
MICRO_BATCHES = (8, 2)  # m at least p, and (on 4 ranks) fewer micro-batches than stages
# The pipeline adds the same float32 terms as one process in another order (the gradient accumulated
# over m backwards, the tied matrix's two parts added by an all-reduce): measured, up to 2e-7 of a
# stage's gradient. A loss not divided by m, or divided twice, is off by a factor m (at least 1 here).
TOLERANCE = 1e-5


def one_f_one_b_step(stage: Stage, xs: list[torch.Tensor], ys: list[torch.Tensor],
                     act_shape: tuple[int, ...]) -> float | None:
    """One forward-and-backward of the micro-batches ``xs``/``ys`` through this rank's ``stage`` in 1F1B's
    order; the gradients accumulate in the stage's parameters. ``act_shape``: the shape of one
    micro-batch's activations between two stages. Returns the batch's mean loss on the last stage."""
    # BEGIN SOLUTION hint: how many forwards before this stage's first backward; then one of each in turn; then the rest. Receive before you compute, send after
    rank, p, m = dist.get_rank(), dist.get_world_size(), len(xs)
    warmup = min(p - 1 - rank, m)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    sends = []
    total = 0.0

    def forward(i: int) -> None:
        nonlocal total
        if stage.first:
            inp = xs[i]
        else:
            inp = torch.empty(act_shape)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_(True)
        if stage.last:
            out = stage(inp, ys[i]) / m
            total += out.item()
        else:
            out = stage(inp)
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        inputs[i], outputs[i] = inp, out

    def backward(i: int) -> None:
        inp, out = inputs.pop(i), outputs.pop(i)
        if stage.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if not stage.first:
            sends.append(dist.isend(inp.grad, dst=rank - 1))

    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    for work in sends:
        work.wait()
    return total if stage.last else None
    # END SOLUTION


def rel_err(got: list[torch.Tensor | None], want: list[torch.Tensor]) -> float:
    """|got - want| / |want| over a list of tensors (a missing gradient counts as zero), in float64."""
    num = sum(((0 if g is None else g.double()) - w.double()).pow(2).sum() for g, w in zip(got, want))
    return float((num / sum(w.double().pow(2).sum() for w in want)).sqrt())


def norm(ts: list[torch.Tensor | None]) -> float:
    return float(sum(t.double().pow(2).sum() for t in ts if t is not None) ** 0.5)


def record_order(stage: Stage, order: list[str]):
    """Note every forward of ``stage`` ("F") and the start of every backward through it ("B"); returns
    the hook's handle."""
    def after_forward(module, args, out):
        order.append("F")
        if out.requires_grad:
            out.register_hook(lambda grad: order.append("B"))
    return stage.register_forward_hook(after_forward)


def run(stage: Stage, params: dict, reference: dict, m: int, rank: int, group) -> dict:
    """One step of the learner's 1F1B with m micro-batches: what it computed and what it held."""
    x, y = micro_batch(0, 0, micro_batch_size=BATCH, block_size=SHAPE["block_size"], seed=SEED)
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    act_shape = (BATCH // m, SHAPE["block_size"], SHAPE["n_embd"])
    counter = SavedBytes({q.untyped_storage().data_ptr() for q in stage.parameters()})
    counter.stage = rank
    with counter.hooks():  # one micro-batch's activations on this stage, for the unit of what is held
        probe = xs[0] if stage.first else torch.zeros(act_shape, requires_grad=True)
        out = stage(probe, ys[0]) if stage.last else stage(probe)
        one = counter.live.get(rank, 0)
        del out, probe
    for q in params.values():
        q.grad = None
    order: list[str] = []
    handle = record_order(stage, order)
    counter.reset_peak()
    start = counter.live.get(rank, 0)
    with counter.hooks():
        loss = one_f_one_b_step(stage, xs, ys, act_shape)
    held = (counter.peak.get(rank, 0) - start) / one
    handle.remove()
    sync_tied(params, stage, group)
    names = list(params)
    got, want = [params[n].grad for n in names], [reference["grads"][n] for n in names]
    shapes = all(g is None or g.shape == w.shape for g, w in zip(got, want))
    return {"m": m, "loss": loss if stage.last else None, "order": "".join(order), "held": held,
            "grad_rel_err": rel_err(got, want) if shapes else None, "grad_norm": norm(got),
            "missing_grads": [n for n, g in zip(names, got) if g is None]}


def main() -> None:
    with setup(device="cpu") as info:
        rank, p = info.rank, info.world_size
        if p < 2:
            raise SystemExit("a pipeline needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 ...")
        group = tied_group(p)
        whole = tiny_model(SEED, **SHAPE)  # one process: the whole model, the whole batch
        x, y = micro_batch(0, 0, micro_batch_size=BATCH, block_size=SHAPE["block_size"], seed=SEED)
        _, loss = whole(x, y)
        loss.backward()
        reference = {"loss": loss.item(), "grads": {n: q.grad.clone() for n, q in whole.named_parameters()}}
        model = tiny_model(SEED, **SHAPE)
        names = {id(q): n for n, q in model.named_parameters()}
        stage = Stage(model, rank, p)
        params = {names[id(q)]: q for q in stage.parameters()}
        runs = [run(stage, params, reference, m, rank, group) for m in MICRO_BATCHES]
        ok = all(r["grad_rel_err"] is not None and r["grad_rel_err"] <= TOLERANCE and r["held"] <= p - rank + 0.5
                 for r in runs) and all(abs(r["loss"] - reference["loss"]) <= TOLERANCE * reference["loss"]
                                        for r in runs if stage.last)
        sys.stdout.write("RESULT " + json.dumps({"rank": rank, "world_size": p, "tied": TIED in params,
                                                 "reference_loss": reference["loss"], "runs": runs, "ok": ok}) + "\n")
        sys.stdout.flush()
        for r in runs:
            log(f"rank {rank}, m = {r['m']}: order {r['order']}, held at most {r['held']:.2f} micro-batches, "
                f"gradients {r['grad_rel_err'] if r['grad_rel_err'] is None else format(r['grad_rel_err'], '.1e')} "
                f"from one process", all_ranks=True)
        log(f"{'PASS' if ok else 'FAIL'} on rank {rank}", all_ranks=True)


if __name__ == "__main__":
    main()
