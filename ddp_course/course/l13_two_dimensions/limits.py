"""What lesson 13's plan needs from PyTorch as it is, checked on this machine's PyTorch (section 9).

    python -m ddp_course.course.l13_two_dimensions.limits

Each check runs in this one process, in a process group of one rank (nothing to wait for; the lesson
runs the module as a job of its own, which keeps the profiler's lines out of the notebook), and
``tests/lessons/test_two_dimensions.py`` asserts what it finds, so that the day PyTorch changes, a test
says which workaround or sentence of the lesson has become stale:

- :func:`tie_survives` -- ``parallelize_module`` on a tied embedding and head: does the head still hold
  the embedding's parameter afterwards? (It does not: each style replaces a module's parameter by a new
  DTensor parameter, so ``_tp_plan.tensor_parallel`` re-ties them.)
- :func:`reduce_scatter_ops` -- what gloo runs for a reduce-scatter: the profiler's names under
  ``reduce_scatter_tensor``. (An all-reduce of the whole buffer: on gloo, sequence parallelism's
  reduce-scatters move an all-reduce's bytes; NCCL has a reduce-scatter of its own.)
- :func:`late_optimizer_moves_root` -- an optimizer built after a forward of a ``fully_shard`` model:
  do its steps move the root's own parameters (the embeddings, ``ln_f``)? (They do not: the root
  keeps its parameters unsharded after a forward, and the optimizer takes those; the lab and the
  strategy build the optimizer first.)
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_course.cli import command, parse_flags
from ddp_course.metrics import write_json

PROG = "python -m ddp_course.course.l13_two_dimensions.limits"


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


def late_optimizer_moves_root() -> bool:
    """Whether AdamW, built after one forward of a ``fully_shard`` MiniGPT, moves the root's embedding."""
    from torch.distributed.fsdp import fully_shard

    from ddp_course.course.tiny import tiny_model

    model = tiny_model(0, block_size=8, n_layer=1, n_head=2, n_embd=8)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = torch.randint(model.cfg.vocab_size, (2, 8))
    before = model.tok_emb.weight.detach().full_tensor().clone()
    with torch.no_grad():
        model(x, x)  # a forward before the optimizer exists (a probe, an evaluation, a warm-up)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(x, x)[1].backward()
    opt.step()
    return not torch.equal(before, model.tok_emb.weight.detach().full_tensor())


def reduce_scatter_ops() -> list[str]:
    """The profiler's gloo and c10d names under one ``reduce_scatter_tensor``."""
    from torch.profiler import ProfilerActivity, profile

    out, inp = torch.empty(4), torch.ones(4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.reduce_scatter_tensor(out, inp)
    return sorted({e.key for e in prof.key_averages() if e.key.startswith(("gloo:", "c10d::"))})


def check() -> dict[str, object]:
    with one_rank():
        return {"torch": torch.__version__, "tie_survives": tie_survives(), "reduce_scatter_ops": reduce_scatter_ops(),
                "late_optimizer_moves_root": late_optimizer_moves_root()}


def report(found: dict[str, object] | None = None) -> list[str]:
    found = found or check()
    return [f"PyTorch {found['torch']}:",
            f"  parallelize_module keeps a tied parameter tied: {found['tie_survives']}"
            + ("" if found["tie_survives"] else " -- the plan re-ties the head to the sharded table"),
            f"  gloo's reduce-scatter runs as: {', '.join(found['reduce_scatter_ops'])}"
            + (" -- an all-reduce of the whole buffer" if "gloo:all_reduce" in found["reduce_scatter_ops"] else ""),
            f"  an optimizer built after a forward of a fully_shard model moves the root's embedding: "
            f"{found['late_optimizer_moves_root']}"
            + ("" if found["late_optimizer_moves_root"] else " -- build the optimizer before the first forward")]


def parse(output: str) -> dict[str, object]:
    """What a run of this module found: its ``LIMITS {...}`` line, read back."""
    line = next((ln for ln in output.splitlines() if ln.startswith("LIMITS ")), None)
    if line is None:
        raise ValueError("no LIMITS line in the output: did `python -m ddp_course.course.l13_two_dimensions.limits` run?")
    return json.loads(line[len("LIMITS "):])


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, {"out_dir": ""}, PROG, doc=__doc__,
                       helps={"out_dir": "a folder to write limits.json in as well (default: none)"})
    found = check()
    print("\n".join(report(found)))
    print("LIMITS " + json.dumps(found))
    if opts["out_dir"]:
        write_json(Path(opts["out_dir"]) / "limits.json", found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
