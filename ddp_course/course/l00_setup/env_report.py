"""What a launcher gives each process: its environment, and what the process group then says.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l00_setup.env_report --out_dir=runs/env

Every rank writes ``env_rank<R>.json`` into ``--out_dir`` and prints one line, after rank 0's line
on the device and backend (``--device=auto``, the default: NCCL on GPUs when every rank has one of
its own, else gloo on the CPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_course.cli import command, parse_flags
from ddp_course.course.options import require_device
from ddp_course.dist import log, setup
from ddp_course.metrics import write_json

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l00_setup.env_report"
DEFAULTS = {"out_dir": "runs/env_report", "device": "auto"}  # --device: auto, cpu or cuda

# Set by torchrun for every worker. Of the first six, env:// (init_process_group's default) reads RANK,
# WORLD_SIZE, MASTER_ADDR and MASTER_PORT; LOCAL_RANK and LOCAL_WORLD_SIZE are for the program. The
# rest are torchrun's extras, of which env:// also reads TORCHELASTIC_USE_AGENT_STORE ("True": the
# agent hosts the store; torch/distributed/rendezvous.py, _create_c10d_store).
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    env = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    require_device(opts["device"])  # refuse a device this machine cannot give before any process group is made
    with setup(device=opts["device"]) as info:
        log(f"[env_report] {info.world_size} process(es), {info.device_reason}")
        seen = {"pid": os.getpid(), "env": env, "info": {"rank": info.rank, "world_size": info.world_size,
                                                         "backend": info.backend, "device": str(info.device)}}
        if info.is_distributed:
            seen["dist"] = {"get_rank": dist.get_rank(), "get_world_size": dist.get_world_size(),
                            "get_backend": dist.get_backend()}
            dist.barrier()  # everyone has joined before anyone reports
        write_json(Path(opts["out_dir"]) / f"env_rank{info.rank}.json", seen)
        log(f"pid {os.getpid()}: RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} "
            f"WORLD_SIZE={env['WORLD_SIZE']} MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}",
            all_ranks=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
