"""What lesson 13's plan needs from PyTorch as it is, checked on this machine's PyTorch (section 9).

    python -m ddp_course.course.l13_two_dimensions.limits

Each check runs in this one process, in a process group of one rank (nothing to wait for), and
``tests/lessons/test_two_dimensions.py`` asserts what it finds, so that the day PyTorch changes, a test
says which workaround or sentence of the lesson has become stale:

- :func:`tie_survives` -- ``parallelize_module`` on a tied embedding and head: does the head still hold
  the embedding's parameter afterwards? (It does not: each style replaces a module's parameter by a new
  DTensor parameter, so ``_tensor_parallel.tensor_parallel`` re-ties them.)
- :func:`reduce_scatter_ops` -- what gloo runs for a reduce-scatter: the profiler's names under
  ``reduce_scatter_tensor``. (An all-reduce of the whole buffer: on gloo, sequence parallelism's
  reduce-scatters move an all-reduce's bytes; NCCL has a reduce-scatter of its own.)
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """A gloo process group of this process alone (a store in memory), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tie_survives() -> bool:
    """Whether the tied head still holds the embedding's parameter after the vocabulary-sharded styles."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ddp_course.course.tiny import tiny_model

    model = tiny_model(0, block_size=8, n_layer=1, n_head=2, n_embd=8)
    assert model.head.weight is model.tok_emb.weight  # MiniGPT ties them
    mesh = init_device_mesh("cpu", (1,))
    parallelize_module(model, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                                     "head": ColwiseParallel()})
    return model.head.weight is model.tok_emb.weight


def reduce_scatter_ops() -> list[str]:
    """The profiler's gloo and c10d names under one ``reduce_scatter_tensor``."""
    from torch.profiler import ProfilerActivity, profile

    out, inp = torch.empty(4), torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.reduce_scatter_tensor(out, inp)
    return sorted({e.key for e in prof.key_averages() if e.key.startswith(("gloo:", "c10d::"))})


def check() -> dict[str, object]:
    with one_rank():
        return {"torch": torch.__version__, "tie_survives": tie_survives(), "reduce_scatter_ops": reduce_scatter_ops()}


def report(found: dict[str, object] | None = None) -> list[str]:
    found = found or check()
    return [f"PyTorch {found['torch']}:",
            f"  parallelize_module keeps a tied parameter tied: {found['tie_survives']}"
            + ("" if found["tie_survives"] else " -- the plan re-ties the head to the sharded table"),
            f"  gloo's reduce-scatter runs as: {', '.join(found['reduce_scatter_ops'])}"
            + (" -- an all-reduce of the whole buffer" if "gloo:all_reduce" in found["reduce_scatter_ops"] else "")]


def main() -> int:
    found = check()
    print("\n".join(report(found)))
    print("LIMITS " + json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
