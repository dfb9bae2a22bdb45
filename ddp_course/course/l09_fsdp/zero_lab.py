"""ZeRO-1 from the library: ``torch.distributed.optim.ZeroRedundancyOptimizer`` against DDP + AdamW.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l09_fsdp.zero_lab --out_dir=runs/zero_lab

Every rank trains two copies of a small MiniGPT from the same weights on the same batches (the
batches of exercise 09's second part, ``micro_batch`` of lesson 06), both wrapped in DDP (which
averages the gradients): one with a plain ``torch.optim.AdamW``, one with
``ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=...)``, which keeps an AdamW
over the parameters this rank owns only, steps them, and broadcasts them to the other ranks. After
``--steps`` steps each rank reports

- the parameters its local AdamW (``.optim``) steps and the bytes of that optimizer's state, next to
  the plain AdamW's and the lesson's calculator (``memory.predict("zero1", ...)``);
- the largest parameter difference from the DDP + AdamW copy, and from rank 0's parameters;

then ``consolidate_state_dict(to=0)`` gathers every rank's AdamW state on rank 0, which compares the
full state dict with the plain AdamW's, moment by moment. Rank 0 writes ``zero_lab.json`` into
``--out_dir``. Options are ``--key=value`` (``--help`` lists them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l09_fsdp import memory
from ddp_course.course.options import lab_help, require_device
from ddp_course.course.tiny import VOCAB, micro_batch, tiny_model
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json
from ddp_course.paths import show

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l09_fsdp.zero_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/zero_lab",
    "steps": 4,
    "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "micro_batch_size": 4,
    "lr": 1e-3, "seed": 0,
    "timeout_s": 60.0,
    "device": "auto",
}
HELP = lab_help("zero_lab", DEFAULTS, steps="optimizer steps of each copy",
                micro_batch_size="sequences per rank per step", lr="AdamW's learning rate (both copies)",
                seed="model init and data")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq and step per parameter)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def compare_states(full: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The consolidated ZeRO state dict against a plain AdamW's: same parameters, largest moment difference.

    ``consolidate_state_dict`` gathers the shards into CPU tensors, whatever the device: both sides are
    compared on the CPU."""
    a, b = full["state"], plain["state"]
    diff = max((a[k][m].cpu().float() - b[k][m].cpu().float()).abs().max().item()
               for k in b for m in ("exp_avg", "exp_avg_sq"))
    return {"same_parameters": sorted(a) == sorted(b), "max_abs_diff_moments": diff,
            "same_steps": all(float(a[k]["step"]) == float(b[k]["step"]) for k in b),
            "bytes": sum(v.numel() * v.element_size() for s in a.values() for v in s.values()
                         if isinstance(v, torch.Tensor))}


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    if opts["steps"] < 1:
        raise FlagError(f"--steps={opts['steps']}: give at least 1 optimizer step.")
    shape = {k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}
    require_device(opts["device"])  # refuse a device this machine cannot give before any process group is made
    with setup(device=opts["device"], timeout_s=opts["timeout_s"]) as info:
        if not info.is_distributed:
            raise FlagError(f"the lab compares optimizers across ranks: launch it with `{PROG}`.")
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        device = info.device
        ids = [device.index] if device.type == "cuda" else None
        plain_model = DDP(tiny_model(opts["seed"], **shape).to(device), device_ids=ids)
        zero_model = DDP(tiny_model(opts["seed"], **shape).to(device), device_ids=ids)
        plain = torch.optim.AdamW(plain_model.parameters(), lr=opts["lr"])
        zero = ZeroRedundancyOptimizer(zero_model.parameters(), optimizer_class=torch.optim.AdamW, lr=opts["lr"])
        log(f"[zero_lab] {info.world_size} ranks, {info.device_reason}; DDP + AdamW against DDP + "
            f"ZeroRedundancyOptimizer(AdamW), {opts['steps']} steps")

        for step in range(opts["steps"]):
            x, y = (t.to(device) for t in micro_batch(step, info.rank, micro_batch_size=opts["micro_batch_size"],
                                                         block_size=opts["block_size"], seed=opts["seed"]))
            for model, optimizer in ((plain_model, plain), (zero_model, zero)):
                model(x, y)[1].backward()  # DDP averages the gradients of both copies
                optimizer.step()  # ZeRO: this rank's AdamW steps its parameters, then every rank broadcasts its own
                optimizer.zero_grad(set_to_none=True)

        names = {id(p): n for n, p in zero_model.module.named_parameters()}
        owned = [names[id(p)] for group in zero.optim.param_groups for p in group["params"]]
        params = list(zero_model.module.parameters())
        flat = torch.cat([p.detach().flatten() for p in params])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        shape_v = {"vocab_size": VOCAB, **shape}
        row = {"rank": info.rank, "owned": owned, "zero_optimizer_bytes": state_bytes(zero.optim),
               "plain_optimizer_bytes": state_bytes(plain),
               "predicted_zero1": memory.predict("zero1", info.world_size, shape_v)[info.rank]["optimizer"],
               "predicted_ddp": memory.predict("ddp", info.world_size, shape_v)[info.rank]["optimizer"],
               "max_abs_diff_vs_ddp": max((p.detach() - q.detach()).abs().max().item()
                                          for p, q in zip(params, plain_model.module.parameters())),
               "max_abs_diff_across_ranks": (flat - rank0).abs().max().item()}
        rows = [None] * info.world_size
        dist.all_gather_object(rows, row)
        log(f"[zero_lab] rank {info.rank}: steps {len(owned)} of {len(params)} parameters, AdamW state "
            f"{row['zero_optimizer_bytes']:,} B (plain AdamW {row['plain_optimizer_bytes']:,} B); max |param - DDP| "
            f"{row['max_abs_diff_vs_ddp']:.1e}", all_ranks=True)

        zero.consolidate_state_dict(to=0)  # a collective: every rank sends its AdamW state to rank 0
        if info.is_main:
            consolidated = compare_states(zero.state_dict(), plain.state_dict())
            log(f"[zero_lab] consolidated on rank 0: {consolidated['bytes']:,} B of AdamW state, moments equal to "
                f"the plain AdamW's within {consolidated['max_abs_diff_moments']:.1e}")
            path = Path(opts["out_dir"]) / "zero_lab.json"
            write_json(path, {"world_size": info.world_size, "backend": info.backend, "device": device.type,
                              "options": opts, "n_params": len(params), "per_rank": rows,
                              "consolidated": consolidated})
            log(f"[zero_lab] wrote {show(path)}")
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
