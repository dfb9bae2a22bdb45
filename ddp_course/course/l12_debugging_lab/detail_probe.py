"""Does DDP run under the debug level set in the environment? One small DDP step, stage by stage.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.detail_probe --out_dir=runs/detail_probe

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the process group so that every collective is first checked
against the other ranks' (the check that names mismatched collectives), and makes DDP log more. A
debugging tool is only useful if the program still runs under it, so this probe tries: join the
process group, wrap a small model in DDP, run one forward and backward. Every rank writes
``probe_rank<R>.json`` into ``--out_dir`` after each stage, so a crash (even a segmentation fault,
which no Python handler sees) leaves the last stage that worked on disk. It runs on the CPU with gloo
on every machine (``CPU_BY_DESIGN``, printed first).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.cli import command, parse_flags
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json

STAGES = ("started", "process_group", "ddp_constructed", "backward_done")
CPU_BY_DESIGN = ("the probe checks the debugging lab's own setting, gloo on the CPU, where its programs run "
                 "(they end in gloo timeouts)")


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, {"out_dir": "runs/detail_probe", "timeout_s": 10.0},
                       "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.detail_probe")
    rank = int(os.environ.get("RANK", 0))
    path = Path(opts["out_dir"]) / f"probe_rank{rank}.json"
    state = {"rank": rank, "debug_level": os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF"),
             "torch": torch.__version__, "stage": "started"}

    def reached(stage: str) -> None:
        state["stage"] = stage
        write_json(path, state)  # atomic: a reader never sees half a file

    reached("started")
    with setup(device="cpu", timeout_s=opts["timeout_s"], threads=1,
               because=CPU_BY_DESIGN) as info:  # by design: see CPU_BY_DESIGN
        log(f"[detail_probe] {info.world_size} ranks, {info.device_reason}")
        reached("process_group")
        model = DDP(torch.nn.Linear(8, 8))
        reached("ddp_constructed")
        model(torch.randn(4, 8)).sum().backward()
        reached("backward_done")
        print(f"[rank {rank}] DDP works under TORCH_DISTRIBUTED_DEBUG={state['debug_level']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
