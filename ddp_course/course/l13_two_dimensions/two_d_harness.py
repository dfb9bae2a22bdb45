"""What lesson 13's lab and exercise measure of a MiniGPT split over a 2-D mesh, against one process.

:func:`train_side_by_side` takes a model-building function and a ``parallelize(model, mesh)``, trains
the split model on every rank's share of the same global batches as a one-process model trained on the
whole of them, and returns, for this rank: each step's loss against the reference, the first step's
gradients against the reference's (parameter by parameter, the qkv rows put back in the model's
order), the weights at the end, where each parameter lives (its mesh dimensions, placements and local
elements), the ranks of this rank's group along each mesh dimension, which modules are FSDP units,
the bytes of parameters, gradients and AdamW state this rank holds, the activations autograd saved in
the first forward, and the collectives of the first step by mesh dimension
(:class:`CollectiveCounter`: every collective of the mesh's groups, checked against what each group
ran). :func:`report` prints one line per rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddp_course.course.l05_inside_ddp.ddp_common import collective_kind
from ddp_course.course.l09_fsdp import memory
from ddp_course.course.l11_beyond_data_parallel.pp_lab import one_process
from ddp_course.dist import log
from ddp_course.parallel import _tensor_parallel as heads

# fp32 tolerances. The split model adds the same numbers as one process in other orders (a row-wise
# layer sums its partial products over tp, FSDP averages over dp, the loss is averaged over dp
# groups): ~1e-7 relative on the loss and the gradients, which the bounds below leave a factor of 10
# to 100 above. The weights after a few AdamW steps carry, besides, the differences of the tiny
# gradients that AdamW moves far more than SGD would (lesson 04, section 6): ~5e-5 of the distance
# the weights moved, under 1e-3.
LOSS_RTOL, GRAD_RTOL, UPDATE_RTOL = 1e-6, 1e-5, 1e-3


class CollectiveCounter(TorchDispatchMode):
    """Every collective of this rank while active, counted as ``"<dim>:<kind>"``, ``dim`` the mesh
    dimension of its process group (``groups``: dimension name -> its process group, or a list of them).

    A dispatch mode sees each operator reach PyTorch's dispatcher -- but not what is dispatched while
    its own handler runs: the mode is off then (torch/utils/_python_dispatch.py). So an operator on
    DTensors is handed back to DTensor (``NotImplemented``), whose handler then runs with the mode on,
    and the collectives it issues are seen -- DTensor's redistributions, and the all-reduces of
    ``loss_parallel``'s vocabulary-sharded loss (torch/distributed/tensor/parallel/loss.py), issued
    inside DTensor's handlers of the log-softmax and the NLL loss; torch's own ``CommDebugMode``
    does the same (torch/distributed/tensor/debug/_comm_mode.py, ``__torch_dispatch__``). FSDP's
    collectives go through c10d's operators, which carry the group itself.

    And the counts are checked against the wire: each process group numbers the collectives its
    backend runs (``ProcessGroup._get_sequence_number_for_group``, the number the flight recorder
    logs as ``collective_seq_id``). On exit, what a group ran and the counter did not see is counted
    as ``"<dim>:unseen"``, so a table held against the counts cannot be short of a collective.
    """

    def __init__(self, groups: dict[str, Any]) -> None:
        super().__init__()
        # a dimension may have several groups over the same ranks (two meshes of one shape: lesson 13's
        # three-dimensional lab builds its own and the strategy it runs builds another)
        self.groups = {d: list({pg.group_name: pg for pg in (g if isinstance(g, (list, tuple)) else [g])}.values())
                       for d, g in groups.items()}  # each group once
        self.names = {g.group_name: d for d, gs in self.groups.items() for g in gs}
        self.counts: dict[str, int] = {}
        self._start: dict[str, int] = {}

    def _dim(self, args: tuple) -> str:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # c10d's ops carry the group boxed for the dispatcher
                try:
                    a = dist.ProcessGroup.unbox(a)
                except RuntimeError:  # another boxed argument: the reduce op of an all-reduce
                    continue
            name = a if isinstance(a, str) else getattr(a, "group_name", None)
            if isinstance(name, str) and name in self.names:
                return self.names[name]
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its handler with this mode on: what it issues is seen
        kind = collective_kind(func)
        if kind is not None:
            key = f"{self._dim(tuple(args) + tuple((kwargs or {}).values()))}:{kind}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._start = {d: sum(g._get_sequence_number_for_group() for g in gs) for d, gs in self.groups.items()}
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for d, gs in self.groups.items():
            ran = sum(g._get_sequence_number_for_group() for g in gs) - self._start[d]
            seen = sum(n for k, n in self.counts.items() if k.split(":")[0] == d)
            if ran != seen:
                self.counts[f"{d}:unseen"] = ran - seen
        return out


def mesh_groups(mesh) -> dict[str, Any]:
    """Each named dimension of ``mesh`` -> its process group (this rank's group along it)."""
    return {d: mesh[d].get_group() for d in mesh.mesh_dim_names}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered: a collective over its mesh), detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def natural(named: dict[str, torch.Tensor], n_embd: int, tp: int) -> dict[str, torch.Tensor]:
    """Whole tensors with the qkv rows in the model's own order (every rank: collectives)."""
    return heads.natural_rows({n: full(t) for n, t in named.items()}, n_embd, tp)


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |b| over a dict of tensors, in float64 (inf where a tensor is missing or misshaped)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in b):
        return float("inf")
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b)
    return float((num / sum((b[k].double() ** 2).sum() for k in b)).sqrt())


def reference(model: nn.Module, data: list, lr: float) -> dict[str, Any]:
    """One process, the whole global batch: losses, the first step's gradients, the final weights."""
    return one_process(model, torch.optim.AdamW(model.parameters(), lr=lr, foreach=False), data)


def global_batches(vocab: int, block_size: int, batch_size: int, steps: int, seed: int) -> list:
    """``steps`` global batches of random tokens, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [(torch.randint(vocab, (batch_size, block_size), generator=g),
             torch.randint(vocab, (batch_size, block_size), generator=g)) for _ in range(steps)]


def where(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: the mesh dimensions it is spread over, its placements, and its elements here."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = {"dims": list(p.device_mesh.mesh_dim_names or ()), "placements": [str(x) for x in p.placements],
                         "local": p.to_local().numel(), "numel": p.numel()}
        else:
            out[name] = {"dims": [], "placements": [], "local": p.numel(), "numel": p.numel()}
    return out


def fsdp_units(model: nn.Module) -> dict[str, Any]:
    """Which modules are FSDP units (what ``fully_shard`` was given): the root, each block."""
    from torch.distributed.fsdp import FSDPModule

    return {"root": isinstance(model, FSDPModule),
            "blocks": [isinstance(b, FSDPModule) for b in getattr(model, "blocks", [])]}


PROBED = ("blocks.0", "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.ln2",
          "blocks.0.mlp", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "ln_f", "head")


def _layout(t: Any, seq: int) -> dict[str, Any] | None:
    """How a module's first input or output lies on this rank: a DTensor's placements, or a plain
    tensor's local sequence length (the whole ``seq``, or a slice of it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, tuple | list):
        t = t[0] if t else None
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return None
    if isinstance(t, DTensor):
        return {"dtensor": True, "placements": [str(p) for p in t.placements], "local_seq": t.to_local().shape[1],
                "seq": seq}
    return {"dtensor": False, "placements": [], "local_seq": t.shape[1], "seq": seq}


@contextlib.contextmanager
def probe_layouts(model: nn.Module, seq: int):
    """Record, while active, the layout of the first input and the output of the modules in ``PROBED``
    (the first block's, the final LayerNorm, the head) in the order they run; the records are printed
    as one ``PROBE {json}`` line when the block ends, also when the forward fails (then the last record
    shows where)."""
    import json
    import sys

    records: list[dict[str, Any]] = []
    handles = []
    for name, module in model.named_modules():
        if name in PROBED:
            def pre(mod, args, name=name):
                weight = getattr(mod, "weight", None)
                records.append({"module": name, "input": _layout(args, seq),
                                "weight": [str(p) for p in weight.placements] if hasattr(weight, "placements") else []})

            def post(mod, args, out, name=name):
                for r in reversed(records):
                    if r["module"] == name and "output" not in r:
                        r["output"] = _layout(out, seq)
                        break

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
        if dist.get_rank() == 0:
            sys.stdout.write("PROBE " + json.dumps(records) + "\n")
            sys.stdout.flush()


@contextlib.contextmanager
def plan_warnings():
    """The warnings ``parallelize_module`` gives while active for a plan key that names no module
    ("Parallelize plan key ... could not be resolved", torch/distributed/tensor/parallel/api.py), kept
    in the list this yields (each text once); every warning is shown as usual, once, also when the
    block raises."""
    import warnings

    kept: list[str] = []
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield kept
    finally:
        shown: set[str] = set()
        for w in caught:
            text = str(w.message)
            if text in shown:
                continue
            shown.add(text)
            if "could not be resolved" in text:
                kept.append(text)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def train_side_by_side(make_model: Callable[[], nn.Module], parallelize: Callable, mesh, info, *, tp: int,
                       batch_size: int, steps: int, lr: float, seed: int, data: list | None = None,
                       loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                       ) -> dict[str, Any]:
    """Train ``parallelize(make_model(), mesh)`` on this rank's share of each global batch, and
    ``make_model()`` on the whole of it in this process; every number of the module docstring.
    ``data``: the global batches (default: ``steps`` batches of random tokens, seeded)."""
    heads.quiet_sequential_redistribution()  # the weights and gradients made whole below, over both dims
    model0 = make_model()
    cfg = model0.cfg
    data = data if data is not None else global_batches(cfg.vocab_size, cfg.block_size, batch_size, steps, seed)
    init = {n: p.detach().clone() for n, p in model0.named_parameters()}
    ref = reference(model0, data, lr)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    with plan_warnings() as skipped:
        model = parallelize(make_model(), mesh)
    placed, units = where(model), fsdp_units(model)
    from torch.distributed.fsdp import FSDPModule

    per = batch_size // dp
    # The optimizer is built before any forward: fully_shard's root keeps its parameters unsharded
    # after a forward (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, "For the root, do not
    # reshard after forward"), swapped onto the modules in place of the sharded ones
    # (_fsdp_param.py, _setattr_on_modules). An optimizer built then holds those unsharded tensors,
    # and its steps never reach the root's sharded parameters: the embeddings and ln_f stay put.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)  # the reference's AdamW: one tensor at a time
    with torch.no_grad(), loss_context(), probe_layouts(model, cfg.block_size) as probed:  # where each layout goes
        model(data[0][0][dp_rank * per:(dp_rank + 1) * per].clone(), data[0][1][dp_rank * per:(dp_rank + 1) * per].clone())
    if isinstance(model, FSDPModule):
        model.reshard()  # as after a training step: the first counted forward all-gathers the root again
    losses, out = [], {}
    for step, (x, y) in enumerate(data):
        # this rank's share, as a data loader would hand it (a copy: a slice would keep the whole batch alive)
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per].clone(), y[dp_rank * per:(dp_rank + 1) * per].clone()
        first = step == 0
        fwd, bwd = CollectiveCounter(mesh_groups(mesh)), CollectiveCounter(mesh_groups(mesh))
        # the activations are measured in the second forward, away from the counter (a dispatch mode
        # changes which views autograd sees): the same tensors as the first, of the same sizes
        measure = step == min(1, len(data) - 1)
        with loss_context():
            with (memory.saved_activations(model.parameters()) if measure else contextlib.nullcontext()) as acts, (
                    fwd if first else contextlib.nullcontext()):
                _, loss = model(xs, ys)
            with bwd if first else contextlib.nullcontext():
                loss.backward()
        if measure:
            out["activations"] = acts.bytes
        value = full(loss)
        dist.all_reduce(value, group=mesh["dp"].get_group())  # the global batch's loss: the mean over dp
        losses.append(value.item() / dp)
        if first:
            grads = natural({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, cfg.n_embd, tp)
            out.update(collectives={"forward": fwd.counts, "backward": bwd.counts},
                       grad_rel_err=rel(grads, ref["grads"]),
                       grad_rel_err_per_param={n: rel({n: grads[n]}, {n: ref["grads"][n]}) if n in grads else float("inf")
                                               for n in ref["grads"]})
            opt.step()
            out["states"] = memory.measure_states(model, opt)  # after the step (AdamW's state exists), before zero_grad
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    weights = natural(dict(model.named_parameters()), cfg.n_embd, tp)
    moved = {n: weights[n] - init[n] for n in weights if n in init}
    want = {n: ref["weights"][n] - init[n] for n in init}
    out.update(rank=info.rank, world_size=info.world_size, dp=dp, tp=mesh["tp"].size(), dp_rank=dp_rank,
               groups={d: [int(r) for r in mesh[d].mesh.flatten().tolist()] for d in mesh.mesh_dim_names},
               mesh_dims=list(mesh.mesh_dim_names), losses=losses, reference_losses=ref["losses"],
               loss_rel_diff=max(abs(a - b) / b for a, b in zip(losses, ref["losses"])),
               update_rel_diff=rel(moved, want), params=placed, fsdp_units=units, probe=probed, skipped_keys=skipped,
               full_bytes=sum(t.numel() * t.element_size() for t in init.values()))
    out["ok"] = out["loss_rel_diff"] <= LOSS_RTOL and out["grad_rel_err"] <= GRAD_RTOL and out["update_rel_diff"] <= UPDATE_RTOL
    return out


def report(result: dict[str, Any], info) -> bool:
    """One line per rank: the parity figures and PASS or FAIL; whether this rank passed."""
    log(f"losses {' '.join(f'{v:.5f}' for v in result['losses'])} (one process: "
        f"{' '.join(f'{v:.5f}' for v in result['reference_losses'])}); relative differences: loss "
        f"{result['loss_rel_diff']:.1e}, first gradients {result['grad_rel_err']:.1e}, weights "
        f"{result['update_rel_diff']:.1e} -> {'PASS' if result['ok'] else 'FAIL'}", all_ranks=True)
    return bool(result["ok"])
