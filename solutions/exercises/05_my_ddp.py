"""Exercise 05 -- build DistributedDataParallel yourself.

Lesson 05 opened DDP's box: hooks on the gradient accumulators, buckets in reverse order, one
asynchronous all-reduce per bucket launched while backward goes on, a wait before the optimizer
step. Here you write that machinery, in six small functions that ``MyDDP`` (below them) calls:

1. ``broadcast_parameters``: every rank starts from rank 0's weights (this script gives each rank a
   different initialisation on purpose, as an unseeded script would);
2. ``build_buckets``: the parameters grouped into buckets of at most ``cap_bytes``, starting from the
   LAST parameter (backward produces the last layers' gradients first);
3. ``install_hooks``: a ``Tensor.register_post_accumulate_grad_hook`` on every parameter that calls
   ``on_grad_ready`` with the parameter's bucket;
4. ``on_grad_ready``: when the bucket's last gradient is final, flatten the bucket's gradients into
   one tensor and launch ``dist.all_reduce(..., async_op=True)`` on it, from the hook: the
   communication then runs while backward computes the layers below;
5. ``finish_reduction``: after backward, before ``optimizer.step()``: wait for every bucket, divide
   by the world size, copy the averages back into ``p.grad``, and get the buckets ready for the
   next backward;
6. ``no_sync``: a context manager inside which backward communicates nothing; the gradients then
   accumulate locally and the next synced backward reduces their sum.

Only the bodies of these six functions are yours (you may add imports and helper functions); the
rest of the file, ``MyDDP`` included, is the harness, and the grader refuses a file whose harness
differs from the course's.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/05_my_ddp.py

The part below your functions trains your ``MyDDP`` and ``torch.nn.parallel.DistributedDataParallel``
side by side (the same initial weights, the same batches on each rank, one micro-batch under
``no_sync`` then one synced per optimizer step), logs every all-reduce your code issues, however it
calls it, and when (in backward or after it, under ``no_sync`` or not), when your code waits on it
and whether backward went on while it was in flight, counts the bytes both send, times a step of
each, and prints PASS or FAIL on every rank and one ``RESULT {json}`` line per rank. The grader runs
it the same way and says what is wrong:

    python -m ddp_course check 05 lessons/exercises/05_my_ddp.py
"""

import contextlib
import copy
import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddp_course.course.l05_inside_ddp.ddp_common import CollectiveCounter, collective_kind, time_steps
from ddp_course.course.tiny import micro_batch, tiny_model
from ddp_course.dist import log, setup

SEED = 0  # rank r initialises its model with SEED + r: only a broadcast makes the replicas equal
SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}  # a MiniGPT of 425 kB of float32
MICRO_BATCH = 4  # sequences per micro-batch per rank
BUCKET_CAP_MB = 0.1  # your buckets' cap (MB of 2**20 bytes); torch's DDP gets the same bucket_cap_mb
STEPS = 3  # optimizer steps, each of 2 micro-batches: the first under no_sync, the second synced
LR = 0.1  # SGD with momentum 0.9, the same for both models
TIMING_ROUNDS, TIMING_STEPS = 5, 5  # a plain synced step of each model, timed: rounds x steps
# Max |your parameter - torch DDP's| accepted after STEPS steps. Both models run the same kernels on
# the same data; 2 ranks' averages computed as (a + b) / 2 or a / 2 + b / 2 are equal in float32
# (dividing by 2 is exact), so the solution ends with exactly the same weights (0.0). A missing
# division moves them by more than 1e-3 after one step. (The grader keeps its own tolerance.)
PARAM_ATOL = 1e-6


@dataclass
class Bucket:
    """Some parameters whose gradients travel together, in one all-reduce."""

    params: list  # the parameters (torch.nn.Parameter), in the order build_buckets put them
    ready: int = 0  # how many of their gradients are final in the current backward
    flat: torch.Tensor | None = None  # their gradients flattened into one tensor, while it is all-reduced
    work: dist.Work | None = None  # the handle of that asynchronous all-reduce


def broadcast_parameters(module: torch.nn.Module) -> None:
    """Make every rank's parameters rank 0's (every rank calls this)."""
    # BEGIN SOLUTION hint: overwrite every parameter, in place and outside autograd, with rank 0's values
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p, src=0)
    # END SOLUTION


def build_buckets(params: list, cap_bytes: int) -> list[list]:
    """The parameters in buckets: walk them from the last to the first and fill a bucket until the
    next parameter would take it past ``cap_bytes`` (a parameter larger than the cap alone gets a
    bucket of its own). Returns the buckets in that order, bucket 0 holding the last parameters."""
    # BEGIN SOLUTION hint: last parameter first; close the current bucket when the next parameter's bytes would exceed the cap
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


def install_hooks(ddp: "MyDDP") -> None:
    """On every parameter, a hook that runs once its ``.grad`` is final in a backward and calls
    ``on_grad_ready(ddp, bucket)`` with the bucket that holds it."""
    # BEGIN SOLUTION hint: a post-accumulate-grad hook on each parameter of each bucket; the hook receives the parameter, so bind the bucket yourself
    for bucket in ddp.buckets:
        for p in bucket.params:
            p.register_post_accumulate_grad_hook(lambda param, bucket=bucket: on_grad_ready(ddp, bucket))
    # END SOLUTION


def on_grad_ready(ddp: "MyDDP", bucket: Bucket) -> None:
    """One more gradient of ``bucket`` is final. Inside no_sync (``ddp.require_sync`` False) do
    nothing; else, once it was the bucket's last, launch the bucket's all-reduce without waiting."""
    # BEGIN SOLUTION hint: count the bucket's ready gradients; at the last one, flatten the bucket's grads into bucket.flat and start an asynchronous all-reduce of it, keeping its handle in bucket.work
    if not ddp.require_sync:
        return
    bucket.ready += 1
    if bucket.ready == len(bucket.params):
        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)
    # END SOLUTION


def finish_reduction(ddp: "MyDDP") -> None:
    """After a synced backward: every bucket's all-reduce finished, each ``p.grad`` the mean over the
    ranks, and every bucket ready for the next backward."""
    # BEGIN SOLUTION hint: for each bucket, wait on its handle, turn the sum into a mean, copy each parameter's slice back into its grad, reset the bucket
    for bucket in ddp.buckets:
        bucket.work.wait()
        bucket.flat /= ddp.world_size
        offset = 0
        for p in bucket.params:
            p.grad.copy_(bucket.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket.ready, bucket.flat, bucket.work = 0, None, None
    # END SOLUTION


@contextlib.contextmanager
def no_sync(ddp: "MyDDP"):
    """Inside the ``with`` block, backward communicates nothing (``ddp.require_sync`` is False)."""
    # BEGIN SOLUTION hint: turn the flag off for the block, and back on when it ends, whatever happens inside
    ddp.require_sync = False
    try:
        yield
    finally:
        ddp.require_sync = True
    # END SOLUTION


class MyDDP(torch.nn.Module):
    """Your DDP: wraps ``module``; construction, hooks and synchronisation are the functions above."""

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False inside no_sync(): backward communicates nothing
        broadcast_parameters(module)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [Bucket(list(ps)) for ps in build_buckets(params, int(bucket_cap_mb * 2**20))]
        install_hooks(self)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return no_sync(self)

    def finish_gradient_sync(self) -> None:
        """What torch's DDP does at the end of backward; here the training loop calls it."""
        finish_reduction(self)


# --------------------------------------------------------------------------------------------------
# the harness: trains MyDDP beside torch's DDP and records what your code did (do not edit below)

class AllReduceLog(TorchDispatchMode):
    """Every all-reduce issued while ``phase`` is set: when, how big, how far backward was, when it
    was first waited on, and whether backward went on while it was in flight.

    The log is a dispatch mode, active while MyDDP trains (``with calls:``). Every collective reaches
    PyTorch's dispatcher as an operator, whatever the code called: ``c10d.allreduce_`` for
    ``dist.all_reduce`` (by any name, or the group's own ``allreduce``), ``_c10d_functional.all_reduce``
    for ``torch.distributed._functional_collectives``; the mode sees each one with its tensors, also
    from a gradient hook (on a CPU, autograd runs backward and its hooks in the thread that called
    ``backward``). ``ready`` counts the gradients already final in the current backward (a
    post-accumulate-grad hook of the log's own, registered before MyDDP's, so at a call from a hook
    it includes that hook's parameter).

    ``waited`` is the phase and ``ready`` at the first wait on the all-reduce that the log sees: a
    ``wait`` on its handle or on the future it gives (``get_future``), or ``wait_tensor`` on a
    functional all-reduce's result (an AsyncCollectiveTensor calls it at its first use); None if
    never waited on that way. A wait on a handle is noted as ``.wait`` is looked up, so that no frame
    of the log is on the stack while a rank waits.

    ``in_flight`` counts the log's checks at which the all-reduce was still running: one as each
    gradient's hooks start, one once they have all run (a second hook of the log's, registered after
    MyDDP's: ``check_after_hooks``). 0: it had completed before backward went on from where it was
    launched, whatever waited for it (``wait`` on the handle, ``torch.futures.wait_all``,
    ``wait_tensor``, a loop on ``is_completed``...). A functional all-reduce hands out no handle to
    ask: it is running until its result is waited on.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.phase: str | None = None  # "no_sync backward", "backward", "after backward" or None (not logging)
        self.step = 0
        self.ready = 0
        self.calls: list[dict] = []
        self.n_grads = len(list(model.parameters()))
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in model.parameters()]
        self._running: list[tuple] = []  # (call, its work and future; None, None for a functional all-reduce)
        self._handled: dict[int, tuple] = {}  # id(work or future) -> (it, its call); kept, so no other takes the id
        self._results: dict[int, tuple] = {}  # a functional all-reduce's result: its storage's address -> (it, its call)
        self._real = {(cls, name): cls.__dict__[name] for cls, name in (
            (dist.Work, "get_future"), (dist.Work, "wait"), (torch._C.Future, "wait"))}
        dist.Work.get_future = self._noted_future(self._real[(dist.Work, "get_future")])
        dist.Work.wait = _NotedWait(self, self._real[(dist.Work, "wait")])
        torch._C.Future.wait = _NotedWait(self, self._real[(torch._C.Future, "wait")])

    def check_after_hooks(self, model: torch.nn.Module) -> None:
        """The second hook on every parameter: call once MyDDP has registered its own."""
        self._handles += [p.register_post_accumulate_grad_hook(lambda param: self._check()) for p in model.parameters()]

    def _grad_ready(self, param) -> None:
        self.ready += 1
        self._check()

    def _check(self) -> None:
        running = []
        for call, work, future in self._running:
            done = call["waited"] is not None if work is None else work.is_completed() or future.done()
            if not done:
                call["in_flight"] += 1
                running.append((call, work, future))
        self._running = running

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name.endswith("::wait_tensor"):
            self._waited_result(args[0])
        unwaited = [t for t in tree_leaves((args, kwargs)) if isinstance(t, AsyncCollectiveTensor) and not t.completed] \
            if any(issubclass(t, AsyncCollectiveTensor) for t in types) else []
        out = func(*args, **kwargs)
        for t in unwaited:
            if t.completed:  # this use of it waited on it (a view of it does not)
                self._waited_result(t)
        if self.phase is not None and collective_kind(func) == "all_reduce":
            self._logged(func, args, kwargs, out)
        return out

    def _logged(self, func, args, kwargs, out) -> None:
        named = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        call = {"step": self.step, "phase": self.phase, "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "async": bool(named.get("async_op", True)), "ready": self.ready, "waited": None, "in_flight": 0}
        self.calls.append(call)
        boxed = [o for o in tree_leaves(out) if isinstance(o, torch.ScriptObject)]
        if boxed:  # c10d's: its work, the very object that dist.all_reduce returns
            work = dist.Work.unbox(boxed[0])
            self._handled[id(work)] = (work, call)
            self._running.append((call, work, self._real[(dist.Work, "get_future")].__get__(work)()))
        else:  # a functional all-reduce: its result, which wait_tensor waits on
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._results[t.untyped_storage().data_ptr()] = (t, call)
            self._running.append((call, None, None))

    def _noted_future(self, real):
        def get_future(work):
            future = real.__get__(work)()
            if id(work) in self._handled:  # waiting on the future is waiting on the work
                self._handled[id(future)] = (future, self._handled[id(work)][1])
            return future
        return get_future

    def _note_wait(self, call: dict | None) -> None:
        if call is not None and call["waited"] is None:
            call["waited"] = {"phase": self.phase, "ready": self.ready}

    def waited(self, handle) -> None:
        self._note_wait(self._handled.get(id(handle), (None, None))[1])

    def _waited_result(self, t) -> None:
        t = t.elem if isinstance(t, AsyncCollectiveTensor) else t  # a view of a result shares its storage
        if isinstance(t, torch.Tensor):
            self._note_wait(self._results.get(t.untyped_storage().data_ptr(), (None, None))[1])

    def start_backward(self, phase: str) -> None:
        self.phase, self.ready = phase, 0

    def close(self) -> None:
        """Stop logging: the hooks removed, torch's methods themselves again (the timed steps run without them)."""
        for handle in self._handles:
            handle.remove()
        for (cls, name), real in self._real.items():
            setattr(cls, name, real)
        self._handled.clear()
        self._results.clear()
        self._running.clear()


class _NotedWait:
    """``wait`` of a handle, as the log sees it: looking it up notes the wait, and gives torch's own
    method, bound, which the caller then calls."""

    def __init__(self, log: AllReduceLog, real):
        self.log, self.real = log, real

    def __get__(self, handle, owner=None):
        if handle is not None:
            self.log.waited(handle)
        return self.real.__get__(handle, owner)


def accumulate(model, batches, calls: AllReduceLog | None = None) -> None:
    """Forward and backward of every micro-batch, all but the last inside no_sync; then the gradient
    sync (MyDDP's finish_gradient_sync; torch's DDP did it at the end of backward). ``calls``, the
    log, is active throughout."""
    with calls if calls is not None else contextlib.nullcontext():
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                _, loss = model(x, y)
                if calls is not None:
                    calls.start_backward("backward" if last else "no_sync backward")
                (loss / len(batches)).backward()
                if calls is not None:
                    calls.phase = "after backward"
        if isinstance(model, MyDDP):
            model.finish_gradient_sync()
    if calls is not None:
        calls.phase = None


def flatten_all(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def main() -> None:
    with setup(device="cpu", timeout_s=60.0) as info:  # a collective one rank never joins fails in a minute
        torch.set_num_threads(1)  # a tiny model: one thread per process
        model = tiny_model(SEED + info.rank, **SHAPE)  # a different initialisation on every rank
        reference = copy.deepcopy(model)
        names = {id(p): n for n, p in model.named_parameters()}
        calls = AllReduceLog(model)
        mine = MyDDP(model, BUCKET_CAP_MB)
        calls.check_after_hooks(model)
        theirs = DDP(reference, bucket_cap_mb=BUCKET_CAP_MB)  # broadcasts rank 0's weights to every rank
        init_diff = (flatten_all(model.parameters()) - flatten_all(reference.parameters())).abs().max().item()
        opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in (model, reference)]

        steps = []
        for step in range(STEPS):
            batches = [micro_batch(2 * step + i, info.rank, micro_batch_size=MICRO_BATCH,
                                   block_size=SHAPE["block_size"], seed=SEED) for i in range(2)]
            calls.step = step
            accumulate(mine, batches, calls)
            accumulate(theirs, batches)
            g, g_ref = flatten_all(p.grad for p in model.parameters()), flatten_all(p.grad for p in reference.parameters())
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps.append({"grad_diff": (g - g_ref).abs().max().item(), "grad_norm_ratio": (g.norm() / g_ref.norm()).item(),
                          "param_diff": (flatten_all(model.parameters()) - flatten_all(reference.parameters())).abs().max().item(),
                          "calls": [c for c in calls.calls if c["step"] == step]})
        calls.close()

        # the traffic of one plain synced step of each, counted at the c10d operators (torch's reducer included)
        x, y = micro_batch(1000, info.rank, micro_batch_size=MICRO_BATCH, block_size=SHAPE["block_size"], seed=SEED)
        traffic = {}
        for name, m in (("mine", mine), ("torch", theirs)):
            with CollectiveCounter() as counter:
                accumulate(m, [(x, y)])
            traffic[name] = counter.summary(info.world_size)
            m.module.zero_grad(set_to_none=True)

        # time per training step (forward, backward, gradient sync, SGD step), the slowest rank's, in alternating order
        def train_step(m, opt):
            accumulate(m, [(x, y)])
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_ms = {"mine": [], "torch": []}
        for r in range(TIMING_ROUNDS):
            for name in (("mine", "torch") if r % 2 == 0 else ("torch", "mine")):
                m, opt = (mine, opts[0]) if name == "mine" else (theirs, opts[1])
                step_ms[name].append(time_steps(lambda m=m, opt=opt: train_step(m, opt), TIMING_STEPS) * 1e3)

        synced = [[c for c in s["calls"] if c["phase"] != "no_sync backward"] for s in steps]
        # waited on while backward still had gradients to compute: backward stopped for the network
        early = sum(c["waited"] is not None and c["waited"]["phase"] == "backward" and c["waited"]["ready"] < calls.n_grads
                    for s in steps for c in s["calls"])
        # launched before backward's last gradient, and every one complete before backward went on: the hooks waited
        launched = [c for s in steps for c in s["calls"] if c["phase"] == "backward" and c["ready"] < calls.n_grads]
        held = bool(launched) and all(c["in_flight"] == 0 for c in launched)
        ok = (steps[-1]["param_diff"] <= PARAM_ATOL and all(len(c) == len(mine.buckets) for c in synced)
              and all(c["phase"] == "backward" for s in steps for c in s["calls"]) and not early and not held)
        log(f"{len(mine.buckets)} bucket(s); all-reduces per step in no_sync backward / backward / after backward: "
            f"{[[sum(c['phase'] == ph for c in s['calls']) for ph in ('no_sync backward', 'backward', 'after backward')] for s in steps]}"
            f"{f', {early} waited on inside backward' if early else ''}"
            f"{', each complete before backward went on' if held else ''}; "
            f"max |param - DDP param| after {STEPS} steps {steps[-1]['param_diff']:.1e} -> {'PASS' if ok else 'FAIL'}",
            all_ranks=True)
        sys.stdout.write("RESULT " + json.dumps({
            "rank": info.rank, "world_size": info.world_size,
            "config": {"seed": SEED, "shape": SHAPE, "micro_batch": MICRO_BATCH, "bucket_cap_mb": BUCKET_CAP_MB,
                       "steps": STEPS, "lr": LR},
            "n_grads": calls.n_grads, "buckets": [[names.get(id(p), "?") for p in b.params] for b in mine.buckets],
            "init_diff": init_diff, "steps": steps, "traffic": traffic, "step_ms": step_ms, "ok": ok}) + "\n")
        sys.stdout.flush()  # one write per RESULT line: the lines of two ranks cannot interleave
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
