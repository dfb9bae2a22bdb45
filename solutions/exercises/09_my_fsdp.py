"""Exercise 09, third part -- FSDP (ZeRO-3) by hand: shard the parameters themselves, yourself.

ZeRO-1 split only AdamW's state. FSDP splits the parameters too: every rank keeps 1/N of each weight
(its *shard*) and the whole weight exists only while a unit of the model computes. The wrapper below,
``MyFSDP(model, units=..., compute_dtype=..., prefetch=...)``, works on any module: the weights of its
``nn.Linear`` and ``nn.Embedding`` layers are sharded, every other parameter (biases, norms) is
replicated. A *unit* is a module whose sharded weights are gathered and freed together (the model
itself is always the last unit: it takes the weights no other unit took). The wrapper's plumbing --
which tensor sits where, the hooks, the checks -- is written; complete the seven functions it calls:

- ``shard_of``: this rank's elements of a weight, flattened: rank r keeps elements
  ``[r * c, (r + 1) * c)`` with ``c = ceil(numel / world_size)``, cut at ``numel`` (the last ranks may
  keep fewer elements, or none: a shard never holds padding);
- ``start_gather``: start (without waiting) the all-gather of every rank's shard into ``out``, a
  buffer of ``world_size * c`` elements in the dtype the weights travel and compute in;
- ``reduce_gradient``: the gradient of a whole weight, summed over the ranks and averaged, cut back to
  this rank's shard: what the optimizer steps with, in fp32 and in the shard's shape;
- ``average_replicated``: a replicated parameter's gradient, averaged over the ranks in place;
- ``before_forward`` / ``after_forward`` / ``before_backward``: when each unit's weights are gathered,
  waited for and freed, with ``prefetch`` further units' all-gathers started ahead.

Run it (from the repository root):

    torchrun --standalone --nproc_per_node=2 lessons/exercises/09_my_fsdp.py

The harness trains MiniGPT wrapped in your FSDP with SGD and with AdamW, a small model of odd sizes,
and MiniGPT in bf16, each next to a one-process reference that computes the two ranks' micro-batches
itself. It checks that the fp32 runs equal the reference bit for bit, the bf16 run within what bf16
rounding explains, how many parameter bytes were gathered at once, that the next unit's all-gather
was in flight while a unit computed, and prints PASS or FAIL on every rank. The course's grader runs
it the same way and explains what is wrong:

    python -m ddp_course check 09 lessons/exercises/09_my_fsdp.py
"""

import json
import math
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_course.course.l05_inside_ddp.ddp_common import CollectiveCounter
from ddp_course.course.tiny import micro_batch, tiny_model
from ddp_course.dist import log, setup

# PyTorch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and
# reduce_scatter_single: either name works here (the old ones, the only ones before 2.13, warn from 2.13 on)
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

SHAPE = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}
MICRO_BATCH_SIZE, STEPS, LR, SEED = 4, 6, 1e-2, 0
PREFETCH = 1  # further units whose all-gather starts before a unit computes (0: none)
# bf16 keeps 8 significant bits: every weight and activation is rounded by up to 2^-8 of itself (bf16's unit
# roundoff: half a unit in the last place). The mean loss over the ranks' 2 x 4 x 32 tokens, each term
# computed from such numbers, is allowed that same 2^-8 of the fp32 reference's. The fp32 runs have no
# tolerance at all: bit for bit.
BF16_LOSS_RTOL = 0.00390625  # 2^-8


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's elements of ``full`` as a new 1-D tensor: ``[rank * c, (rank + 1) * c)`` of its flattened
    elements, ``c = ceil(full.numel() / world_size)``, cut at ``full.numel()`` (so possibly shorter, or empty)."""
    # BEGIN SOLUTION hint: this rank's elements as the docstring defines them: 1-D, no padding, a storage of its own
    flat = full.detach().reshape(-1)
    chunk = -(-flat.numel() // world_size)
    return flat[rank * chunk:(rank + 1) * chunk].clone()  # a slice past the end is short, or empty
    # END SOLUTION


def start_gather(shard: torch.Tensor, out: torch.Tensor, world_size: int) -> dist.Work:
    """Start the all-gather of every rank's ``shard`` into ``out`` (``world_size * c`` elements, in the dtype
    the weights travel in) and return its handle at once: rank r's elements land at ``out[r * c:]``."""
    # BEGIN SOLUTION hint: returns a running all-gather's handle; once it is waited for, out holds the shards in rank order
    chunk = out.numel() // world_size
    padded = torch.zeros(chunk, dtype=out.dtype)
    padded[:shard.numel()] = shard  # cast to the compute dtype here: the weights travel in it
    return dist.all_gather_into_tensor(out, padded, async_op=True)
    # END SOLUTION


def reduce_gradient(full_grad: torch.Tensor, world_size: int, shard_numel: int) -> torch.Tensor:
    """The gradient of this rank's shard: ``full_grad`` (a whole weight's, in the compute dtype) summed over
    the ranks, averaged, cut to this rank's ``shard_numel`` elements; fp32, 1-D."""
    # BEGIN SOLUTION hint: the ranks' average of this rank's shard_numel elements of the gradient: 1-D, fp32
    flat = full_grad.reshape(-1)
    chunk = -(-flat.numel() // world_size)
    padded = torch.zeros(world_size * chunk, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    mine = torch.empty(chunk, dtype=flat.dtype)
    dist.reduce_scatter_tensor(mine, padded, op=dist.ReduceOp.SUM)
    return mine[:shard_numel].float() / world_size
    # END SOLUTION


def average_replicated(grad: torch.Tensor, world_size: int) -> None:
    """A replicated parameter's gradient, in place: the average over the ranks."""
    # BEGIN SOLUTION hint: when this returns, grad holds the average of every rank's grad
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    grad /= world_size
    # END SOLUTION


def before_forward(units: list, i: int, prefetch: int) -> None:
    """Before ``units[i]`` computes its forward (``units``: in the order their forwards run): its weights
    gathered and waited for, and the all-gathers of up to ``prefetch`` units after it started, not waited for.

    A unit has ``state`` ("sharded", "gathering" or "gathered"), ``start()`` (start its all-gathers),
    ``wait()`` (wait for them) and ``free()`` (release the gathered weights).
    """
    # BEGIN SOLUTION hint: units[i] usable on return; up to `prefetch` later units' all-gathers started, not waited for
    for unit in units[i:i + 1 + prefetch]:
        if unit.state == "sharded":
            unit.start()
    units[i].wait()
    # END SOLUTION


def after_forward(unit) -> None:
    """After ``unit``'s forward: what it gathered is no longer needed until its backward."""
    # BEGIN SOLUTION hint: when this returns, the unit holds only its shards
    unit.free()
    # END SOLUTION


def before_backward(units: list, i: int, prefetch: int) -> None:
    """Before ``units[i]`` computes its backward (``units``: in the order their backwards run): as
    ``before_forward``, for the backward's order."""
    # BEGIN SOLUTION hint: units[i] whole for autograd on return; up to `prefetch` later units' gathers started, not waited for
    for unit in units[i:i + 1 + prefetch]:
        if unit.state == "sharded":
            unit.start()
    units[i].wait()
    # END SOLUTION


# --- the wrapper (part of the harness: keep it) ------------------------------------------------------

SHARDED_TYPES = (nn.Linear, nn.Embedding)


class Unit:
    """One unit's sharded weights: each weight's shard (an fp32 ``nn.Parameter``, 1-D), the buffer it is
    gathered into (``world_size * c`` elements of the compute dtype, released when free) and the whole
    weight the modules compute with (a view of the buffer's first ``numel`` elements)."""

    def __init__(self, name: str, weights: list, rank: int, world_size: int, dtype: torch.dtype, watch) -> None:
        self.name, self.world_size, self.state, self.works, self.watch = name, world_size, "sharded", [], watch
        self.ready = False  # prepared for its backward
        self.shards, self.buffers, self.full, self.numels, self.places = [], [], [], [], []
        for weight, places in weights:
            self.shards.append(nn.Parameter(shard_of(weight, rank, world_size)))
            chunk = math.ceil(weight.numel() / world_size)
            buffer = torch.empty(world_size * chunk, dtype=dtype)
            # .data: a view with a version counter of its own, so that refilling the buffer before
            # backward is not taken by autograd for a change of the tensors it saved
            self.full.append(buffer.data[:weight.numel()].view(weight.shape).requires_grad_())
            buffer.untyped_storage().resize_(0)  # nothing gathered yet
            self.buffers.append(buffer)
            self.numels.append(weight.numel())
            self.places.append(places)

    def start(self) -> None:
        if self.state != "sharded":
            raise RuntimeError(f"start() on unit {self.name}, which is {self.state}: start a unit's all-gather once, "
                               "while it is sharded")
        for buffer in self.buffers:
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        self.works = [start_gather(s.detach(), b, self.world_size) for s, b in zip(self.shards, self.buffers)]
        self.state = "gathering"
        if any(work is None for work in self.works):  # no handle: the all-gather ran to its end before returning
            self.watch.synchronous += 1
        self.watch.started(self)

    def wait(self) -> None:
        if self.state == "sharded":
            raise RuntimeError(f"wait() on unit {self.name}, whose all-gather was never started: start() it first")
        if self.state == "gathering":
            for work in self.works:
                if work is not None:
                    work.wait()
            self.works, self.state = [], "gathered"
            self.watch.waited(self)

    def free(self) -> None:
        for work in self.works:  # an all-gather still in flight must land before its buffer goes
            if work is not None:
                work.wait()
        for buffer in self.buffers:
            buffer.untyped_storage().resize_(0)
        self.works, self.state = [], "sharded"

    def gathered_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers)


class Watch:
    """What the harness measures while the wrapper runs: the most parameter bytes held at once, and, at
    each unit's compute, which units' all-gathers were in flight (started, not yet waited for)."""

    def __init__(self) -> None:
        self.units: list[Unit] = []
        self.base = 0  # shards + replicated parameters: always held
        self.peak = 0
        self.computes: list[dict] = []
        self.waited_s = 0.0
        self.synchronous = 0  # start() calls whose all-gathers returned no handle (not asynchronous)

    def sample(self) -> None:
        self.peak = max(self.peak, self.base + sum(u.gathered_bytes() for u in self.units))

    def started(self, unit: Unit) -> None:
        self.sample()

    def waited(self, unit: Unit) -> None:
        self.sample()

    def computing(self, unit: Unit, phase: str) -> None:
        self.sample()
        self.computes.append({"unit": unit.name, "phase": phase, "in_flight": [
            u.name for u in self.units if u.state == "gathering" and all(w is not None for w in u.works)]})


class MyFSDP(nn.Module):
    """``model`` sharded: Linear and Embedding weights (tied ones once) split over the ranks, by unit; every
    other parameter replicated. ``units``: modules of ``model``, in the order their forwards run; a weight
    belongs to the innermost unit holding it, the model itself to the weights left. ``compute_dtype``: the
    dtype weights travel and compute in (None: fp32); the shards stay fp32 (master weights)."""

    def __init__(self, model: nn.Module, units: list[nn.Module] = (), compute_dtype: torch.dtype | None = None,
                 prefetch: int = 0) -> None:
        super().__init__()
        if compute_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"compute_dtype={compute_dtype}: choose None, torch.float32, torch.float16 or torch.bfloat16")
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: the number of units gathered ahead is 0 or more")
        self.module, self.prefetch, self.world_size = model, prefetch, dist.get_world_size()
        self.dtype, self.watch = compute_dtype, Watch()
        inner = [(name, m) for name, m in model.named_modules() if any(m is u for u in units)]
        if len(inner) != len(units):
            raise ValueError("every unit must be a module of the model, given once")
        owner = {id(model): "root"} | {id(m): name for name, m in inner}
        weights: dict[str, dict[int, tuple]] = {name: {} for name, _ in inner} | {"root": {}}
        self.names: dict[int, str] = {}  # parameter -> its first name in the model
        for name, p in model.named_parameters(remove_duplicate=True):
            self.names[id(p)] = name
        replicated: dict[int, list] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            for attr, p in list(module._parameters.items()):
                if p is None:
                    continue
                if isinstance(module, SHARDED_TYPES) and attr == "weight":
                    unit = next(owner[id(m)] for m in reversed(_path(model, mod_name)) if id(m) in owner)
                    weights[unit].setdefault(id(p), (p, []))[1].append((module, attr))
                else:
                    replicated.setdefault(id(p), [p, []])[1].append((module, attr))
                del module._parameters[attr]
        rank = dist.get_rank()
        order = [name for name, _ in inner] + ["root"]
        self.units = {n: Unit(n, list(weights[n].values()), rank, self.world_size, compute_dtype or torch.float32,
                              self.watch) for n in order}
        self.shards = nn.ParameterList([s for u in self.units.values() for s in u.shards])
        self.shard_names = [self.names[id(p)] for n in order for p, _ in weights[n].values()]
        self.replicated = nn.ParameterList([p for p, _ in replicated.values()])
        self.replicated_places = [places for _, places in replicated.values()]
        for unit in self.units.values():
            for full, places in zip(unit.full, unit.places):
                for module, attr in places:
                    setattr(module, attr, full)
                full.register_post_accumulate_grad_hook(lambda t, u=unit: self._grad_ready(u))
        for p in self.replicated:
            p.register_post_accumulate_grad_hook(lambda p: average_replicated(p.grad, self.world_size))
        self.forward_order = [self.units["root"]] + [self.units[n] for n, _ in inner]
        self.backward_order = [self.units["root"]] + [self.units[n] for n, _ in reversed(inner)]
        for module, unit in [(model, self.units["root"])] + [(m, self.units[n]) for n, m in inner]:
            module.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
            module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))
        self.watch.units = list(self.units.values())
        self.watch.base = sum(p.numel() * p.element_size() for p in self.parameters())
        self._pending: dict[str, int] = {}
        self._index = {id(p): k for k, p in enumerate(self.shards)}
        self.problems: list[str] = []  # gradients no optimizer could step with (dtype, shape)
        self._in_backward = False

    def forward(self, *args, **kwargs):
        for p, places in zip(self.replicated, self.replicated_places):
            value = p.view_as(p) if self.dtype is None else p.to(self.dtype)  # autograd carries the gradient to p
            for module, attr in places:
                setattr(module, attr, value)
        if self.dtype is not None:
            args = tuple(a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return self.module(*args, **kwargs)

    def _pre_forward(self, unit: Unit) -> None:
        start = time.perf_counter()
        before_forward(self.forward_order, self.forward_order.index(unit), self.prefetch)
        self.watch.waited_s += time.perf_counter() - start
        if unit.state != "gathered":
            raise RuntimeError(f"unit {unit.name} is about to compute its forward with its weights {unit.state}: "
                               "before_forward must leave units[i] gathered")
        self.watch.computing(unit, "forward")

    def _post_forward(self, unit: Unit, out) -> None:
        after_forward(unit)
        self.watch.sample()
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(out) if t.requires_grad]
            for t in tensors:
                t.register_hook(lambda g, u=unit: self._pre_backward(u))

    def _pre_backward(self, unit: Unit) -> None:
        if not self._in_backward:  # the first unit of this backward: the end of backward is when it finishes
            self._in_backward = True
            self._pending = {u.name: len(u.full) for u in self.units.values()}
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self._pending.get(unit.name, 0) == 0 or unit.ready:
            return  # reduced already, or already prepared by another of its outputs
        start = time.perf_counter()
        before_backward(self.backward_order, self.backward_order.index(unit), self.prefetch)
        self.watch.waited_s += time.perf_counter() - start
        if unit.state != "gathered":
            raise RuntimeError(f"unit {unit.name} is about to compute its backward with its weights {unit.state}: "
                               "autograd would read freed storage; before_backward must leave units[i] gathered")
        unit.ready = True
        self.watch.computing(unit, "backward")

    def _grad_ready(self, unit: Unit) -> None:
        self._pending[unit.name] -= 1
        if self._pending[unit.name] == 0:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        for shard, full in zip(unit.shards, unit.full):
            if full.grad is None:
                continue
            grad = reduce_gradient(full.grad, self.world_size, shard.numel())
            full.grad = None
            if grad.dtype != torch.float32 or grad.shape != shard.shape:  # an optimizer could not step with it
                self.problems.append(f"the gradient of {self.shard_names[self._index[id(shard)]]} is "
                                     f"{str(grad.dtype).replace('torch.', '')} of shape {tuple(grad.shape)}, its "
                                     f"parameter float32 of shape {tuple(shard.shape)}")
                continue
            shard.grad = grad if shard.grad is None else shard.grad + grad
        unit.free()  # after its backward, a unit keeps its shards only
        unit.ready = False

    def _finish_backward(self) -> None:
        for unit in self.units.values():
            if self._pending.get(unit.name, 0) > 0:  # some weight got no gradient: reduce what there is
                self._pending[unit.name] = 0
                self._reduce(unit)
            if unit.state != "sharded":
                unit.free()
            unit.ready = False
        self._in_backward = False

    def named_original(self) -> list[tuple[str, nn.Parameter]]:
        """(the model's name, the parameter the optimizer steps): the shards, then the replicated ones."""
        return list(zip(self.shard_names, self.shards)) + [(self.names[id(p)], p) for p in self.replicated]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, fp32, under the model's own names (for a comparison, a checkpoint, sampling)."""
        out = {}
        for unit in self.units.values():
            for shard, full in zip(unit.shards, unit.full):
                chunk = math.ceil(full.numel() / self.world_size)
                buffer = torch.empty(self.world_size * chunk)
                start_gather(shard.detach(), buffer, self.world_size).wait()
                out[self.shard_names[len(out)]] = buffer[:full.numel()].view(full.shape).clone()
        for p in self.replicated:
            out[self.names[id(p)]] = p.detach().clone()
        return out


def _path(model: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``model`` down to the one called ``name``."""
    path, module = [model], model
    for part in name.split(".") if name else []:
        module = getattr(module, part)
        path.append(module)
    return path


def _tensors(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


# --- the runs ----------------------------------------------------------------------------------------

class OddModel(nn.Module):
    """A model of odd sizes (no weight's element count divides by 2): an embedding, two linear layers, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.up, self.norm = nn.Embedding(13, 7), nn.Linear(7, 9), nn.LayerNorm(9)
        self.down = nn.Linear(9, 13, bias=False)

    def forward(self, x, y):
        logits = self.down(torch.relu(self.norm(self.up(self.emb(x)))))
        return logits, nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def build(kind: str) -> nn.Module:
    if kind == "odd":
        torch.manual_seed(SEED)
        return OddModel()
    return tiny_model(SEED, **SHAPE)


def batch(kind: str, step: int, rank: int):
    if kind == "odd":
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 13, (MICRO_BATCH_SIZE, 5), generator=g)
        return x, (x * 3 + 1) % 13
    return micro_batch(step, rank, micro_batch_size=MICRO_BATCH_SIZE, block_size=SHAPE["block_size"], seed=SEED)


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR)


def reference(kind: str, opt_name: str, world_size: int) -> tuple[nn.Module, list[float], dict]:
    """One process: each step, every rank's micro-batch in turn, the gradients summed rank by rank in
    rank order and divided by the number of ranks, as the ranks' reduction adds them; then one step."""
    model = build(kind)
    opt = optimizer(opt_name, model.parameters())
    losses, first = [], {}
    for step in range(STEPS):
        grads: dict[str, torch.Tensor] = {}
        total = 0.0
        for r in range(world_size):
            _, loss = model(*batch(kind, step, r))
            loss.backward()
            total += loss.item()
            for name, p in model.named_parameters():
                grads[name] = p.grad.clone() if name not in grads else grads[name] + p.grad
            model.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            p.grad = grads[name] / world_size
        if step == 0:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / world_size)
    return model, losses, first


def train(kind: str, opt_name: str, dtype, prefetch: int, rank: int, world_size: int) -> dict:
    """One run of the wrapper next to its one-process reference: what the grader reads."""
    model = build(kind)
    units = list(model.blocks) if kind == "gpt" else [model.up]
    fsdp = MyFSDP(model, units=units, compute_dtype=dtype, prefetch=prefetch)
    opt = optimizer(opt_name, fsdp.parameters())
    ref, ref_losses, ref_grads = reference(kind, opt_name, world_size)
    losses, problems, grad_ratio, comm, waits, times = [], [], {}, {}, [], []
    for step in range(STEPS):
        waited, start = fsdp.watch.waited_s, time.perf_counter()
        counter = CollectiveCounter() if step == 0 else None  # the collectives of one step (the first)
        if counter is not None:
            counter.__enter__()
        _, loss = fsdp(*batch(kind, step, rank))
        loss.backward()
        times.append(time.perf_counter() - start)  # forward and backward, this step
        if counter is not None:
            counter.__exit__(None, None, None)
            comm = {"ops": [dict(o) for o in counter.ops]}
        problems += fsdp.problems
        for name, p in fsdp.named_original():
            if p.grad is None and not problems:
                problems.append(f"{name} has no gradient")
            elif p.grad is not None and (p.grad.dtype != torch.float32 or p.grad.shape != p.shape):
                problems.append(f"the gradient of {name} is {str(p.grad.dtype).replace('torch.', '')} of shape "
                                f"{tuple(p.grad.shape)}, its parameter float32 of shape {tuple(p.shape)}")
        if problems:
            break
        if step == 0:
            grad_ratio = _grad_ratios(fsdp, ref_grads, rank, world_size)
        waits.append(fsdp.watch.waited_s - waited)  # this step's time in before_forward / before_backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    full = fsdp.full_parameters() if not problems else {}
    refs = dict(ref.named_parameters())
    diff = max(((full[n] - refs[n].detach()).abs().max().item() for n in full), default=float("inf"))
    bitwise = bool(full) and all(torch.equal(full[n], refs[n].detach()) for n in full)
    numels = torch.tensor([p.numel() for p in fsdp.shards])
    dist.all_reduce(numels)
    return {"kind": kind, "optimizer": opt_name, "dtype": str(dtype or torch.float32).replace("torch.", ""),
            "prefetch": prefetch, "losses": losses, "ref_losses": ref_losses, "bitwise": bitwise,
            "max_abs_diff": diff, "grad_problems": problems[:4], "grad_ratio": grad_ratio,
            "shard_numels_summed": [int(n) for n in numels],
            "weight_numels": [t.numel() for u in fsdp.units.values() for t in u.full],
            "shard_names": fsdp.shard_names, "shard_bytes": sum(p.numel() * 4 for p in fsdp.shards),
            "replicated_bytes": sum(p.numel() * 4 for p in fsdp.replicated),
            "peak_param_bytes": fsdp.watch.peak, "computes": fsdp.watch.computes[-2 * len(fsdp.units):],
            "wait_s": waits, "step_s": times, "synchronous_gathers": fsdp.watch.synchronous, "comm": comm,
            "units": {n: [t.numel() for t in u.full] for n, u in fsdp.units.items()}}


def _grad_ratios(fsdp: MyFSDP, ref_grads: dict, rank: int, world_size: int) -> dict[str, float]:
    """|gradient handed to the optimizer| / |the reference's|, over the sharded and the replicated parameters."""
    mine, want = {"sharded": 0.0, "replicated": 0.0}, {"sharded": 0.0, "replicated": 0.0}
    for name, p in zip(fsdp.shard_names, fsdp.shards):
        g = ref_grads[name].reshape(-1)
        chunk = math.ceil(g.numel() / world_size)
        mine["sharded"] += p.grad.float().pow(2).sum().item()
        want["sharded"] += g[rank * chunk:(rank + 1) * chunk].pow(2).sum().item()
    for p in fsdp.replicated:
        mine["replicated"] += p.grad.float().pow(2).sum().item()
        want["replicated"] += ref_grads[fsdp.names[id(p)]].pow(2).sum().item()
    both = torch.tensor([mine["sharded"], want["sharded"], mine["replicated"], want["replicated"]], dtype=torch.float64)
    dist.all_reduce(both)
    return {"sharded": math.sqrt(both[0] / both[1]), "replicated": math.sqrt(both[2] / both[3])}


RUNS = (("gpt", "sgd", None, 0), ("gpt", "adamw", None, PREFETCH), ("odd", "adamw", None, PREFETCH),
        ("gpt", "adamw", torch.bfloat16, PREFETCH))


def main() -> None:
    with setup(device="cpu") as info:
        rows = [train(kind, opt, dtype, prefetch, info.rank, info.world_size) for kind, opt, dtype, prefetch in RUNS]
        ok = True
        for r in rows:
            if r["dtype"] == "float32":
                good = r["bitwise"]
                said = f"bit for bit: {r['bitwise']}"
            else:
                rel = max((abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])), default=float("inf"))
                good = len(r["losses"]) == STEPS and rel <= BF16_LOSS_RTOL
                said = f"losses within {rel:.1e} of fp32's (allowed {BF16_LOSS_RTOL:.1e})"
            flying = sum(bool(c["in_flight"]) for c in r["computes"])
            good = good and not r["grad_problems"] and (r["prefetch"] == 0 or flying > 0)
            ok = ok and good
            log(f"{r['kind']} {r['optimizer']} {r['dtype']} prefetch {r['prefetch']}: {said}; peak parameter bytes "
                f"{r['peak_param_bytes']:,}; computes with an all-gather in flight {flying}/{len(r['computes'])}"
                f"{'; ' + r['grad_problems'][0] if r['grad_problems'] else ''} -> {'PASS' if good else 'FAIL'}",
                all_ranks=True)
        settings = {"micro_batch_size": MICRO_BATCH_SIZE, "steps": STEPS, "lr": LR, "seed": SEED,
                    "bf16_loss_rtol": BF16_LOSS_RTOL}
        sys.stdout.write("RESULT " + json.dumps({"rank": info.rank, "world_size": info.world_size, "shape": SHAPE,
                                                 "settings": settings, "runs": rows, "ok": ok}) + "\n")  # one write
        sys.stdout.flush()
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
