"""When to use which parallelism: memory per rank and communication per step, computed for one model.

    from ddp_course.course.l11_beyond_data_parallel import plan
    rows = plan.compare(plan.GPT2_SMALL, world_size=4, batch_size=32)
    print(plan.table(rows, unit="GiB"))

Every layout trains the same model on the same global batch of ``batch_size`` sequences with N =
``world_size`` ranks, fp32 weights and AdamW (lesson 09's assumptions). For each it gives what the
*fullest* rank holds -- ``params``, ``grads``, ``optimizer`` (AdamW's two moments and one step
counter per tensor), ``activations`` (what autograd keeps for the backward), ``gathered`` (weights
held only for a while, FSDP's) -- and ``comm``: the bytes one rank *sends* per optimizer step, with
the usual ring algorithms (an all-reduce of S bytes over n ranks sends 2 (n - 1) / n x S per rank, an
all-gather or a reduce-scatter (n - 1) / n x S); ``calls``: the collectives or messages of one rank
per step; ``bubble``: the pipeline's idle fraction (0 elsewhere).

Lesson 09's calculator (``ddp_course.course.l09_fsdp.memory``) gives DDP, ZeRO-1 and FSDP outright
(``predict``), and its ``parameter_table`` and ``activation_bytes`` are the ground for the others.
The formula of each layout is in its function's docstring: :func:`ddp`, :func:`zero1`, :func:`fsdp`,
:func:`tp`, :func:`pp`, :func:`fsdp_tp`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ddp_course.course.l09_fsdp import memory

FP32 = memory.FP32
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb=25

LESSON = {"vocab_size": 65, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}  # the pipeline lab's model
GPT2_SMALL = {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}  # as in lesson 09

# Megatron-LM's split of a transformer block (tensor parallelism): the first linear of attention and
# of the MLP is cut by output features ("column-parallel": weight rows and bias), the second by input
# features ("row-parallel": weight columns; its bias is added once, after the all-reduce, so it stays
# whole). LayerNorms, the embeddings and the tied head stay whole on every rank here (Megatron-LM
# also splits the vocabulary; this plan does not).
COLUMN_PARALLEL = (".attn.qkv.weight", ".attn.qkv.bias", ".mlp.fc.weight", ".mlp.fc.bias")
ROW_PARALLEL = (".attn.proj.weight", ".mlp.proj.weight")
# Of the 16 (B, T, C)-sized tensors a block keeps for its backward (activation_bytes' docstring), 12
# are outputs of the column-parallel linears or computed from them -- q, k, v (3), the attention
# output (1), the MLP's hidden layer before and after GELU (4 + 4) -- and are split under tensor
# parallelism; the other 4 (the block input, the two LayerNorm outputs, the residual sum) are whole.
TP_SPLIT_PER_BLOCK = 12


@dataclass(frozen=True)
class Layout:
    """One row of the comparison: what the fullest rank holds and sends (bytes)."""

    name: str  # e.g. "FSDP"
    degrees: str  # how the N ranks are arranged, e.g. "DP 4" or "FSDP 2 x TP 2"
    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int  # weights held only for a while (FSDP: one block's full weights and the root's)
    comm: int  # bytes sent by one rank per optimizer step
    calls: int  # collectives or point-to-point messages of one rank per step
    bubble: float  # idle fraction of a pipeline step (0 for the others)
    what: str  # what crosses the network

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered


def n_params(shape: dict[str, int]) -> int:
    return sum(t.numel for t in memory.parameter_table(shape))


def _check(shape: dict[str, int], batch_size: int, ranks: int, what: str) -> None:
    if batch_size % ranks:
        raise ValueError(f"batch_size={batch_size} does not divide over {ranks} {what}; choose a multiple of {ranks}.")


def ddp(shape: dict[str, int], world_size: int, batch_size: int) -> Layout:
    """DDP: every rank holds everything -- 4 + 4 + 8 bytes per parameter -- and the activations of
    its batch_size / N sequences (``memory.predict("ddp", ...)``). Per step one all-reduce of the
    gradients (4P bytes), cut into 25 MiB buckets that overlap the backward: 2 (N - 1) / N x 4P sent."""
    _check(shape, batch_size, world_size, "data-parallel ranks")
    r = memory.predict("ddp", world_size, shape, micro_batch_size=batch_size // world_size)[0]
    size = n_params(shape) * FP32
    return Layout("DDP", f"DP {world_size}", r["params"], r["grads"], r["optimizer"], r["activations"], 0,
                  _all_reduce(size, world_size), math.ceil(size / BUCKET_BYTES), 0.0, "all-reduce of the gradients")


def zero1(shape: dict[str, int], world_size: int, batch_size: int) -> Layout:
    """ZeRO-1 as PyTorch's ``ZeroRedundancyOptimizer`` does it under DDP (``memory.predict("zero1", ...)``):
    weights and gradients whole on every rank, AdamW's states only for the tensors this rank owns --
    whole tensors, the largest first, each to the rank that owns the fewest elements so far
    (``memory.zero1_partition``); the fullest rank is shown. Per step DDP's all-reduce, then every
    rank broadcasts the weights it updated: an all-gather's worth, (N - 1) / N x 4P more bytes,
    1.5 x DDP's in all (the ZeRO paper's version reduce-scatters the gradients instead of
    all-reducing them, and moves DDP's bytes). ``calls``: DDP's buckets, plus one broadcast per
    parameter tensor, which every rank joins -- the library's default,
    ``parameters_as_bucket_view=False``, sends "parameter-by-parameter" (``_sync_params`` and
    ``_broadcast_params_from_rank`` in ``torch/distributed/optim/zero_redundancy_optimizer.py``);
    with ``parameters_as_bucket_view=True`` it would be one broadcast per rank."""
    base = ddp(shape, world_size, batch_size)
    rows = memory.predict("zero1", world_size, shape, micro_batch_size=batch_size // world_size)
    r = max(rows, key=lambda x: x["states"])
    size = n_params(shape) * FP32
    return Layout("ZeRO-1", f"DP {world_size}", r["params"], r["grads"], r["optimizer"], r["activations"], 0,
                  base.comm + _all_gather(size, world_size), base.calls + len(memory.parameter_table(shape)), 0.0,
                  "all-reduce of the gradients, broadcast of the updated weights")


def fsdp(shape: dict[str, int], world_size: int, batch_size: int) -> Layout:
    """FSDP2, full shard (ZeRO-3), one unit per block and the root: ``memory.predict("fsdp", ...)`` --
    1/N of the states (plus padding), batch_size / N sequences of activations, and one block plus
    the root gathered at a time. Per step: every unit's weights all-gathered in forward, the blocks'
    again in backward (the root stays gathered), every gradient reduce-scattered:
    (N - 1) / N x (4P + 4P_blocks + 4P), about 1.5 x DDP's bytes, in 3L + 2 collectives."""
    _check(shape, batch_size, world_size, "data-parallel ranks")
    rows = memory.predict("fsdp", world_size, shape, micro_batch_size=batch_size // world_size)
    r = max(rows, key=lambda x: x["states"])
    total, blocks = _sizes(shape)
    comm = _all_gather(total + blocks, world_size) + _all_gather(total, world_size)
    return Layout("FSDP", f"FSDP {world_size}", r["params"], r["grads"], r["optimizer"], r["activations"],
                  r["gathered"], comm, 3 * shape["n_layer"] + 2, 0.0,
                  "all-gather of the weights (forward, backward), reduce-scatter of the gradients")


def tp(shape: dict[str, int], world_size: int, batch_size: int, *, name: str = "TP") -> Layout:
    """Tensor parallelism over t = N ranks, Megatron-LM's split of every block (``COLUMN_PARALLEL``,
    ``ROW_PARALLEL``): those tensors 1/t per rank, the rest whole. All t ranks compute on the same
    batch_size sequences; each keeps 1/t of the 12 split (B, T, C) tensors of a block and of the
    attention's log-sum-exp, the rest whole (``TP_SPLIT_PER_BLOCK``). Per step 4 all-reduces per block
    of the (batch_size, T, C) activations -- after the attention's and the MLP's row-parallel linear
    in forward, before their column-parallel linear in backward -- each inside the block's
    computation, which waits for it: 4L x 2 (t - 1) / t x 4 batch_size T C bytes. The gradients of the
    whole tensors need no all-reduce: every rank computes them from the same full inputs."""
    t = world_size
    _check_tp(shape, t)
    mine = sum(_tp_numel(x, t) for x in memory.parameter_table(shape))
    acts = _tp_activations(shape, batch_size, t)
    count = len(memory.parameter_table(shape))
    act_bytes = batch_size * shape["block_size"] * shape["n_embd"] * FP32
    return Layout(name, f"TP {t}", mine * FP32, mine * FP32, 2 * mine * FP32 + count * FP32, acts, 0,
                  4 * shape["n_layer"] * _all_reduce(act_bytes, t), 4 * shape["n_layer"], 0.0,
                  "all-reduce of activations, 4 per block, on the critical path")


def pp(shape: dict[str, int], world_size: int, batch_size: int, micro_batches: int = 8) -> Layout:
    """Pipeline parallelism over p = N stages, GPipe with m = ``micro_batches``: stage s holds its
    share of the blocks (as even as possible), the first stage also the embeddings, the last the final
    LayerNorm and its own copy of the tied embedding/head matrix (V x C). GPipe keeps the activations
    of all m micro-batches until their backward, so a stage holds its blocks' activations for the
    whole batch_size (the last stage also the logits). Per step each stage sends its output
    activations (4 batch_size T C bytes) forward and its input's gradient back, in m messages each;
    the first and the last stage all-reduce the tied matrix's gradient (4 V C bytes, 2 ranks).
    Idle fraction (p - 1) / (m + p - 1)."""
    p, m = world_size, micro_batches
    _check(shape, batch_size, m, "micro-batches")
    if shape["n_layer"] < p:
        raise ValueError(f"{shape['n_layer']} blocks cannot fill {p} pipeline stages; use at most {shape['n_layer']}.")
    base, extra = divmod(shape["n_layer"], p)
    bounds, lo = [], 0
    for s in range(p):
        bounds.append((lo, lo + base + (s < extra)))
        lo = bounds[-1][1]
    table = memory.parameter_table(shape)
    tied = next(x for x in table if x.name == "tok_emb.weight")
    act_msg = batch_size * shape["block_size"] * shape["n_embd"] * FP32
    rows = []
    for s, (lo, hi) in enumerate(bounds):
        mine = [x for x in table if x.unit.startswith("blocks.") and lo <= int(x.unit.split(".")[1]) < hi]
        if s == 0:
            mine += [x for x in table if x.name in ("tok_emb.weight", "pos_emb.weight")]
        if s == p - 1:
            mine += [x for x in table if x.name.startswith("ln_f.")] + ([tied] if p > 1 else [])
        numel = sum(x.numel for x in mine)
        sub = {**shape, "n_layer": hi - lo}
        if s == p - 1:  # the blocks plus the final LayerNorm, the logits, ids and targets
            acts = memory.activation_bytes(sub, batch_size)
        else:  # the blocks only
            acts = memory.activation_bytes(sub, batch_size) - memory.activation_bytes({**shape, "n_layer": 0}, batch_size)
        sends = (s < p - 1) * act_msg + (s > 0) * act_msg  # forward to s + 1, backward to s - 1
        calls = (s < p - 1) * m + (s > 0) * m
        if p > 1 and s in (0, p - 1):
            sends += _all_reduce(tied.numel * FP32, 2)
            calls += 1
        rows.append((numel * FP32, 2 * numel * FP32 + len(mine) * FP32, acts, sends, calls))
    params = max(r[0] for r in rows)
    return Layout("PP", f"PP {p}, m = {m}", params, params, max(r[1] for r in rows), max(r[2] for r in rows), 0,
                  max(r[3] for r in rows), max(r[4] for r in rows), (p - 1) / (m + p - 1),
                  "activations and their gradients between stages; the tied matrix's all-reduce")


def fsdp_tp(shape: dict[str, int], world_size: int, batch_size: int, tp_size: int = 2) -> Layout:
    """2-D: d = N / t groups of data parallelism, each a tensor-parallel group of t ranks (FSDP x TP,
    as torchtitan arranges them on a 2-D device mesh). Every rank holds the TP shard of each tensor
    (:func:`tp`), and FSDP shards that again over the d ranks with the same TP position: the states
    of :func:`tp` / d (exactly, up to FSDP's row padding). Activations: :func:`tp`'s for the
    batch_size / d sequences of its group. Communication: :func:`tp`'s inside the group, on the
    group's batch, plus :func:`fsdp`'s all-gathers and reduce-scatter of the TP shards over d."""
    t = tp_size
    if world_size % t:
        raise ValueError(f"tp_size={t} does not divide world_size={world_size}.")
    d = world_size // t
    _check(shape, batch_size, d, "data-parallel groups")
    inner = tp(shape, t, batch_size // d)
    total = sum(_tp_numel(x, t) for x in memory.parameter_table(shape)) * FP32
    blocks = sum(_tp_numel(x, t) for x in memory.parameter_table(shape) if x.unit != "root") * FP32
    comm = inner.comm + _all_gather(total + blocks, d) + _all_gather(total, d)
    gathered = _tp_root_and_block(shape, t)
    return Layout("FSDP x TP", f"FSDP {d} x TP {t}", math.ceil(inner.params / d), math.ceil(inner.grads / d),
                  math.ceil(inner.optimizer / d), inner.activations, gathered if d > 1 else 0, comm,
                  inner.calls + (3 * shape["n_layer"] + 2 if d > 1 else 0), 0.0,
                  "TP's all-reduces inside a group; FSDP's all-gathers and reduce-scatter across groups")


def compare(shape: dict[str, int], world_size: int, batch_size: int, *, micro_batches: int = 8,
            tp_size: int = 2) -> list[Layout]:
    """Every layout for one model, on ``world_size`` ranks, with the same global batch."""
    return [ddp(shape, world_size, batch_size), zero1(shape, world_size, batch_size),
            fsdp(shape, world_size, batch_size), tp(shape, world_size, batch_size),
            pp(shape, world_size, batch_size, micro_batches), fsdp_tp(shape, world_size, batch_size, tp_size)]


def table(rows: list[Layout], unit: str = "MiB") -> str:
    """The rows as a text table, memory and communication in ``unit`` (KiB, MiB or GiB)."""
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    head = (f"{'layout':<11}{'ranks':<16}{'params':>9}{'grads':>9}{'AdamW':>9}{'activ.':>9}{'gathered':>9}"
            f"{'total':>9}{'comm/step':>11}{'calls':>7}{'bubble':>8}")
    lines = [f"per rank (the fullest), {unit}; comm = bytes one rank sends per optimizer step", head]
    for r in rows:
        vals = [r.params, r.grads, r.optimizer, r.activations, r.gathered, r.total]
        lines.append(f"{r.name:<11}{r.degrees:<16}" + "".join(f"{v / scale:>9.2f}" for v in vals)
                     + f"{r.comm / scale:>11.2f}{r.calls:>7}{r.bubble:>8.0%}")
    return "\n".join(lines)


def as_dicts(rows: list[Layout]) -> list[dict]:
    return [{**asdict(r), "total": r.total} for r in rows]


# --- helpers ------------------------------------------------------------------------------------------

def _all_reduce(size: int, n: int) -> int:
    return 2 * (n - 1) * size // n


def _all_gather(size: int, n: int) -> int:
    return (n - 1) * size // n


def _sizes(shape: dict[str, int]) -> tuple[int, int]:
    """Bytes of all parameters and of the blocks' parameters (fp32)."""
    table = memory.parameter_table(shape)
    return sum(t.numel for t in table) * FP32, sum(t.numel for t in table if t.unit != "root") * FP32


def _check_tp(shape: dict[str, int], t: int) -> None:
    if shape["n_head"] % t or shape["n_embd"] % t:
        raise ValueError(f"tensor parallelism over {t} ranks splits the heads and the width: n_head={shape['n_head']} "
                         f"and n_embd={shape['n_embd']} must both be divisible by {t}.")


def _tp_numel(t: memory.Tensor, tp_size: int) -> int:
    """Elements of tensor ``t`` on one rank under Megatron's split (see COLUMN_PARALLEL, ROW_PARALLEL)."""
    if t.unit != "root" and t.name.endswith(COLUMN_PARALLEL + ROW_PARALLEL):
        return t.numel // tp_size
    return t.numel


def _tp_activations(shape: dict[str, int], batch: int, t: int) -> int:
    """:func:`memory.activation_bytes` for ``batch`` sequences, with the split tensors of every block 1/t."""
    B, T, C, nh = batch, shape["block_size"], shape["n_embd"], shape["n_head"]
    split = TP_SPLIT_PER_BLOCK * B * T * C * FP32 + B * nh * T * FP32  # and SDPA's fp32 log-sum-exp (B, nh, T)
    return memory.activation_bytes(shape, batch) - shape["n_layer"] * (split - split // t)


def _tp_root_and_block(shape: dict[str, int], t: int) -> int:
    """FSDP's gathered weights over the TP shards: the root's and the largest block's (fp32)."""
    units: dict[str, int] = {}
    for x in memory.parameter_table(shape):
        units[x.unit] = units.get(x.unit, 0) + _tp_numel(x, t) * FP32
    return units["root"] + max(v for k, v in units.items() if k != "root")
