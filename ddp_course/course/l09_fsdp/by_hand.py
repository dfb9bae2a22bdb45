"""What lesson 09's section on FSDP by hand reads from the exercise's job, and two small experiments.

- :func:`step_bytes`: the bytes one rank sends in a step, from the collectives the exercise's harness
  counted (lesson 05's ``CollectiveCounter``): *logical* (what each collective must move with a ring:
  an all-gather (N-1) x its input, a reduce-scatter (N-1)/N x its input, an all-reduce 2(N-1)/N) and
  ``wire``, computed by counting each reduce-scatter as a ring all-reduce of its whole input (PyTorch's gloo
  backend runs it so: :func:`gloo_reduce_scatter_events`);
- :func:`gloo_reduce_scatter_events`: the gloo work the profiler records for one reduce-scatter, in a
  process group of one rank made in this process;
- :func:`bf16_weight_rounding`: how far rounding MiniGPT's weights to bf16, alone, moves its loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_bytes(op: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective whose input on each rank is ``payload`` bytes (ring algorithms)."""
    n = world_size
    if op.startswith("allgather"):
        return (n - 1) * payload
    if op.startswith("reduce_scatter"):
        return (n - 1) / n * payload
    if op.startswith("allreduce"):
        return 2 * (n - 1) / n * payload
    raise ValueError(f"no byte count for collective {op!r}")


def step_bytes(ops: list[dict], world_size: int) -> dict[str, float]:
    """Per collective kind, the bytes one rank sends in the step ``ops`` recorded: ``logical`` and ``wire``
    (each reduce-scatter counted as a ring all-reduce of its whole input, as PyTorch's gloo backend runs
    it), and how many of each ran."""
    out: dict[str, float] = {}
    for o in ops:
        kind = o["op"]
        out[f"{kind} count"] = out.get(f"{kind} count", 0) + 1
        out[f"{kind} logical"] = out.get(f"{kind} logical", 0.0) + ring_bytes(kind, o["bytes"], world_size)
        wire = "allreduce" if kind.startswith("reduce_scatter") else kind
        out[f"{kind} wire"] = out.get(f"{kind} wire", 0.0) + ring_bytes(wire, o["bytes"], world_size)
    out["logical"] = sum(v for k, v in out.items() if k.endswith(" logical"))
    out["wire"] = sum(v for k, v in out.items() if k.endswith(" wire"))
    return out


def gloo_reduce_scatter_events() -> list[str]:
    """The backend's own work the profiler sees under one ``reduce_scatter_tensor`` on gloo (lesson 02's
    ``backend_ops``), in a process group of one rank made and destroyed here."""
    from ddp_course.course.l02_collectives.collectives import backend_ops

    if dist.is_initialized():
        raise RuntimeError("this process already has a process group: run this in a process without one")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out, x = torch.empty(8), torch.ones(8)
        return backend_ops(lambda: dist.reduce_scatter_tensor(out, x))[1]
    finally:
        dist.destroy_process_group()


def bf16_weight_rounding(shape: dict[str, int], seed: int, micro_batch_size: int, world_size: int) -> float:
    """|loss with the Linear/Embedding weights rounded to bf16 - fp32 loss| / fp32 loss, at initialisation, on
    every rank's first micro-batch at once, computed in fp32: the rounding of the weights alone."""
    from ddp_course.course.tiny import micro_batch, tiny_model

    model = tiny_model(seed, **shape)
    parts = [micro_batch(0, r, micro_batch_size=micro_batch_size, block_size=shape["block_size"], seed=seed)
             for r in range(world_size)]
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    with torch.no_grad():
        fp32 = model(x, y)[1].item()
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
        rounded = model(x, y)[1].item()
    return abs(rounded - fp32) / fp32
