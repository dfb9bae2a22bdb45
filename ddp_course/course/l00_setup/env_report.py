"""What a launcher gives each process: its environment, and what the process group then says.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l00_setup.env_report --out_dir=runs/env

Every rank writes ``env_rank<R>.json`` into ``--out_dir`` and prints one line, after rank 0's line
on the device and backend (``--device=auto``, the default: NCCL on GPUs when every rank has one of
its own, else gloo on the CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_course.dist import DeviceError, choose_device, log, setup

# Set by torchrun for every worker. The first six are what any launcher must provide for
# init_process_group's default env:// rendezvous; the rest are torchrun's extras.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS")


def main(argv: list[str]) -> dict:
    out_dir, device = Path("runs/env_report"), "auto"
    for arg in argv:
        if arg.startswith("--out_dir="):
            out_dir = Path(arg.split("=", 1)[1])
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
        else:
            raise SystemExit(f"error: unknown option {arg!r}; the options are --out_dir=PATH and "
                             "--device=auto|cpu|cuda")
    env = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    try:  # refuse a device this machine cannot give before any process group is made
        choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except DeviceError as exc:
        raise SystemExit(f"error: {exc}") from None
    with setup(device=device) as info:
        log(f"[env_report] {info.world_size} process(es), {info.device_reason}")
        seen = {"pid": os.getpid(), "env": env, "info": {"rank": info.rank, "world_size": info.world_size,
                                                         "backend": info.backend, "device": str(info.device)}}
        if info.is_distributed:
            seen["dist"] = {"get_rank": dist.get_rank(), "get_world_size": dist.get_world_size(),
                            "get_backend": dist.get_backend()}
            dist.barrier()  # everyone has joined before anyone reports
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"env_rank{info.rank}.json").write_text(json.dumps(seen, indent=2), encoding="utf-8")
        log(f"pid {os.getpid()}: RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} "
            f"WORLD_SIZE={env['WORLD_SIZE']} MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}",
            all_ranks=True)
    return seen


if __name__ == "__main__":
    main(sys.argv[1:])
