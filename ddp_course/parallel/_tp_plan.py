"""MiniGPT's tensor- and sequence-parallel plans: which module of a block, and of the model around the
blocks, gets which parallel style of ``torch.distributed.tensor.parallel`` (``--strategy=fsdp_tp``,
``--strategy=pipeline`` for each stage, and lesson 13's labs; not a strategy: its name starts with ``_``),
and :func:`indivisible`, the one check that the tensor-parallel ranks can split the model.

The plans (:func:`block_plan`, :func:`root_plan`) follow Megatron-LM's layout: ``qkv`` and ``mlp.fc``
column-wise, ``attn.proj`` and ``mlp.proj`` row-wise. With ``sequence_parallel`` the LayerNorms and the
residual stream between the blocks are sharded along the sequence (``Shard(1)``): each row-wise layer
reduce-scatters its output onto the sequence instead of all-reducing it, and each block's attention and
MLP all-gather the sequence back first. Without it the residual stream is replicated and each row-wise
layer all-reduces. ``vocab_parallel`` shards the tied embedding table by vocabulary rows (the embedding
row-wise, the output head column-wise with its logits left sharded for ``loss_parallel``).
:func:`tensor_parallel` applies them to every block, after the head split of ``_tensor_parallel``.

This module is apart from ``_tensor_parallel`` (the head split, the qkv row order), which lesson 13's
exercise imports: the plans are that exercise's answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_course.parallel._tensor_parallel import HeadParallelAttention, rearrange_qkv

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ddp_course.model import MiniGPT


def block_plan(sequence_parallel: bool = True) -> dict[str, Any]:
    """``parallelize_module``'s plan for one block: attention and MLP split Megatron-style; with
    ``sequence_parallel``, the LayerNorms on sequence shards and the row-wise outputs reduce-scattered
    onto the sequence (else replicated: the row-wise outputs all-reduced)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {"attn.qkv": ColwiseParallel(), "mlp.fc": ColwiseParallel()}
    if not sequence_parallel:
        return {**plan, "attn.proj": RowwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {**plan, "ln1": SequenceParallel(), "ln2": SequenceParallel(), "attn": gather, "mlp": gather,
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


def root_plan(sequence_parallel: bool = True, vocab_parallel: bool = False) -> dict[str, Any]:
    """The plan around the blocks: where the residual stream becomes sequence-sharded (the first
    block's input, cut locally) and whole again (the head's input, all-gathered); with
    ``vocab_parallel`` the tied table sharded by vocabulary rows."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {}
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        plan["ln_f"] = SequenceParallel()
    before_head = Shard(1) if sequence_parallel else Replicate()
    if vocab_parallel:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["head"] = PrepareModuleInput(input_layouts=(before_head,), desired_input_layouts=(Replicate(),),
                                          use_local_output=False)
    elif sequence_parallel:
        plan["head"] = PrepareModuleInput(input_layouts=(before_head,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True)
    return plan


def stage_plan(first: bool, last: bool) -> dict[str, Any]:
    """:func:`root_plan` (sequence parallel) for one stage of a pipeline: the residual stream is cut onto
    the sequence on the first stage only (a later stage receives its sequence shard from the stage before
    it, already cut) and made whole before the head on the last."""
    return {key: style for key, style in root_plan(sequence_parallel=True).items()
            if (first if key == "blocks.0" else last)}


def indivisible(cfg: Any, tp: int, *, sequence_parallel: bool = True) -> tuple[str, int] | None:
    """The first of the model's sizes (``cfg``: a ``TrainConfig`` or ``GPTConfig``) that ``tp`` ranks cannot
    split, as (option, value): the heads, the width and, with sequence parallelism, the sequence. None
    when every one divides."""
    sizes = [("n_head", cfg.n_head), ("n_embd", cfg.n_embd)] + ([("block_size", cfg.block_size)]
                                                                if sequence_parallel else [])
    return next(((what, size) for what, size in sizes if size % tp), None)


def tensor_parallel(model: MiniGPT, mesh: DeviceMesh, *, sequence_parallel: bool = True,
                    vocab_parallel: bool = False, root: dict[str, Any] | None = None) -> MiniGPT:
    """Split every block of ``model`` over the 1-D ``mesh`` (the tensor-parallel ranks), in place.

    ``model``: a MiniGPT, or a part of one with its ``cfg`` and ``blocks`` (a pipeline stage, which
    passes ``root=stage_plan(...)`` in place of :func:`root_plan`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    n = mesh.size()
    bad = indivisible(model.cfg, n, sequence_parallel=sequence_parallel)
    if bad:
        raise ValueError(f"{bad[0]}={bad[1]} does not split over {n} tensor-parallel ranks")
    for block in model.blocks.children():  # a list of blocks, or a pipeline stage's dict of them
        rearrange_qkv(block.attn, n)
        block.attn = HeadParallelAttention(block.attn, n)
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    plan = root_plan(sequence_parallel, vocab_parallel) if root is None else root
    if plan:
        parallelize_module(model, mesh, plan)
    if vocab_parallel:
        model.head.weight = model.tok_emb.weight  # re-tie: the vocabulary-sharded table serves both
    return model
