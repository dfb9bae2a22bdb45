"""The 2-D plan on paper: which layout each tensor has between MiniGPT's modules, and the collectives
one training step issues per mesh dimension, derived from the plan (lesson 13 checks them against
what its lab counts).

Over ``tp``, with sequence parallelism (the strategy's plan, ``parallel._tp_plan``), per block:

- forward: the LayerNorm works on this rank's slice of the sequence (``Shard(1)``); the attention
  needs the whole sequence, so it all-gathers it (``Shard(1) -> Replicate``); its column-wise ``qkv``
  leaves each rank its heads' features, its row-wise ``proj`` a partial sum, which a reduce-scatter
  sums and cuts back onto the sequence (``Partial -> Shard(1)``). The MLP does the same: per block
  **2 all-gathers and 2 reduce-scatters**. Around the blocks, the first block's input is cut from the
  replicated embeddings locally (no message), and the head all-gathers the sequence once.
- backward: every redistribution runs in reverse. In each block the gradient of a reduce-scatter is an
  all-gather, and the gradient arriving at the whole-sequence input of ``qkv`` (of ``mlp.fc``) is a
  partial sum -- each rank's columns contributed theirs -- which a reduce-scatter adds up and cuts back
  onto the sequence: again 2 all-gathers and 2 reduce-scatters per block. The cut at the first block's
  input becomes an all-gather (each rank had the gradient of its slice only). The head's all-gather
  needs nothing back: the head computes the same on every rank of the group, so the gradient of its
  input is whole everywhere and is only cut. The LayerNorms' weights and biases are replicated over
  ``tp`` while each rank saw a slice of the sequence: their gradients are partial sums, all-reduced over
  ``tp`` (one per tensor: 4 per block and 2 for the final LayerNorm).

With the tied table sharded by vocabulary (``vocab_parallel``, the loss under ``loss_parallel``), over
``tp`` on top of the above: in forward the embedding's lookup is a partial sum of each rank's rows,
all-reduced (1), and the loss takes three all-reduces across the vocabulary shards -- the largest
logit, the sum of exponentials, the target's logit (torch/distributed/tensor/parallel/loss.py,
``_log_softmax`` and ``_nll_loss_forward``); in backward the head's input gradient is now a partial
sum (each rank's logits came from its rows of the table), which the head's all-gather turns into a
reduce-scatter (1). The loss's backward is local; the table's gradient stays on its rows.

Without sequence parallelism the residual stream is whole on every rank of a group: each row-wise
``proj`` all-reduces its output (2 per block), and in backward the gradient arriving at each
column-wise input is all-reduced (2 per block).

Over ``dp``, FSDP2 with each block a unit and the root one (lesson 09): forward all-gathers the root's
and every block's shards (L + 1); backward all-gathers the blocks again (resharded after forward) and
reduce-scatters every unit's gradients (L + 1).
"""

from __future__ import annotations


def expected_collectives(n_layer: int, *, sequence_parallel: bool = True, dp: int = 2,
                         reshard_after_forward: bool = True, vocab_parallel: bool = False) -> dict[str, dict[str, int]]:
    """``{"forward": {"tp:all_gather": n, ...}, "backward": {...}}`` for one step (zeros left out);
    ``vocab_parallel``: the sequence-parallel plan with the tied table sharded by vocabulary and the
    loss under ``loss_parallel``."""
    L = n_layer
    if sequence_parallel:
        fwd = {"tp:all_gather": 2 * L + 1, "tp:reduce_scatter": 2 * L}
        bwd = {"tp:all_gather": 2 * L + 1, "tp:reduce_scatter": 2 * L, "tp:all_reduce": 4 * L + 2}
    else:
        fwd = {"tp:all_reduce": 2 * L}
        bwd = {"tp:all_reduce": 2 * L}
    if vocab_parallel:
        if not sequence_parallel:
            raise ValueError("the vocabulary-sharded plan is derived here on top of sequence parallelism")
        fwd["tp:all_reduce"] = fwd.get("tp:all_reduce", 0) + 1 + 3  # the embedding's partial sums; the loss's three
        bwd["tp:reduce_scatter"] += 1  # the head's input gradient: a partial sum over the vocabulary shards
    if dp > 1:
        fwd["dp:all_gather"] = L + 1
        bwd["dp:all_gather"] = L if reshard_after_forward else 0
        bwd["dp:reduce_scatter"] = L + 1
    return {"forward": {k: v for k, v in fwd.items() if v}, "backward": {k: v for k, v in bwd.items() if v}}


BLOCK_ORDER = ("ln1", "attn", "attn.qkv", "attn.proj", "ln2", "mlp", "mlp.fc", "mlp.proj")
ROOT_ORDER = ("tok_emb", "blocks.0", "ln_f", "head")


def _fmt(layouts) -> str:
    return ", ".join(str(x).replace("dim=", "") for x in layouts) if layouts else "-"


def describe(plan: dict, order: tuple[str, ...]) -> list[tuple[str, str, str, str]]:
    """One row per module of ``plan`` in forward order: (module, style, layout in, layout out). A
    layout is DTensor's placement of the activation over ``tp``: ``Shard(1)`` a slice of the sequence,
    ``Shard(-1)`` a slice of the features, ``Replicate()`` whole on every rank of the group."""
    rows = []
    for name in order:
        style = plan.get(name)
        if style is None:
            continue
        kind = type(style).__name__
        if kind == "SequenceParallel":
            rows.append((name, kind, _fmt(style.sequence_sharding), _fmt(style.sequence_sharding)))
        elif kind == "PrepareModuleInput":
            rows.append((name, kind, _fmt(style.input_layouts), _fmt(style.desired_input_layouts)))
        elif kind == "RowwiseParallel":
            rows.append((name, kind, _fmt(style.input_layouts), "Partial (summed) -> " + _fmt(style.output_layouts)))
        else:
            rows.append((name, kind, _fmt(getattr(style, "desired_input_layouts", style.input_layouts)),
                         _fmt(style.output_layouts)))
    return rows


# --------------------------------------------------------------------------------------------------
# bytes per rank, predicted

def tp_local_table(shape: dict[str, int], tp: int) -> list:
    """MiniGPT's parameter tensors as one tensor-parallel rank holds them (Megatron's split of lesson
    11's planner: column-parallel tensors cut on their rows, row-parallel weights on their columns, the
    rest whole)."""
    from ddp_course.course.l09_fsdp import memory
    from ddp_course.course.l11_beyond_data_parallel.plan import COLUMN_PARALLEL, ROW_PARALLEL

    out = []
    for t in memory.parameter_table(shape):
        dims = list(t.shape)
        if t.name.endswith(COLUMN_PARALLEL):
            dims[0] //= tp
        elif t.name.endswith(ROW_PARALLEL):
            dims[1] //= tp
        out.append(memory.Tensor(t.name, tuple(dims), t.unit))
    return out


def predicted_states(shape: dict[str, int], dp: int, tp: int) -> list[dict[str, int]]:
    """Per rank (row by row on the ``(dp, tp)`` mesh): parameters, gradients and AdamW state in bytes.

    FSDP2 shards each tensor a tensor-parallel rank holds again on its first dimension over ``dp``,
    with lesson 09's rules (``memory._fsdp2_states``): every rank's storage padded to the chunk of
    ``ceil(rows / dp)`` rows, AdamW's moments of the real rows only, one step counter per tensor."""
    from ddp_course.course.l09_fsdp import memory

    table = tp_local_table(shape, tp)
    return [{**memory._fsdp2_states(table, dp, rank // tp), "rank": rank} for rank in range(dp * tp)]


def sequence_parallel_activations(shape: dict[str, int], batch: int, tp: int) -> int:
    """What autograd keeps of one forward on a rank with sequence parallelism: lesson 11's
    tensor-parallel activations (``plan._tp_activations``, ``batch`` sequences) less what sequence
    parallelism cuts to 1/tp -- per block the block's input and the residual sum after the attention
    (the two LayerNorms' inputs), and the two LayerNorms' statistics; once, the final LayerNorm's input
    and statistics. What the attention and the MLP keep is not cut: their inputs are the all-gathered,
    whole sequence."""
    from ddp_course.course.l11_beyond_data_parallel.plan import _tp_activations

    B, T, C, L = batch, shape["block_size"], shape["n_embd"], shape["n_layer"]
    fp32 = 4
    per_block = 2 * B * T * C * fp32 + 2 * 2 * B * T * fp32  # two (B, T, C) tensors, two LayerNorms' mean and rstd
    once = B * T * C * fp32 + 2 * B * T * fp32
    return _tp_activations(shape, batch, tp) - (L * per_block + once) * (tp - 1) // tp
