"""Bug: the GPU chosen by the global RANK instead of LOCAL_RANK. Breaks on the second node.

    python -m ddp_course.course.l04_ddp.two_nodes --nproc_per_node=2   # two "nodes"; this program through run_two_nodes
    torchrun --nnodes=2 --node_rank=N --nproc_per_node=2 ... -m ddp_course.course.l12_debugging_lab.broken.device_global_rank

``torch.cuda.set_device(int(os.environ["RANK"]))`` works on one node, where RANK and LOCAL_RANK are
the same numbers. On a second node, ranks 2 and 3 ask for GPUs 2 and 3 -- which a 2-GPU node does not
have (on bigger nodes: GPUs that belong to other processes, so two ranks share one GPU and NCCL
refuses or deadlocks). Every node numbers its own GPUs from 0; ``LOCAL_RANK`` is that number.

Each rank computes both choices. With as many CUDA GPUs as local processes it really calls
``torch.cuda.set_device`` with the global rank and notes the error it gets. Without them (a CPU
machine) it does not pretend: it notes the indices it *would* use, against ``--gpus_per_node``
(default: the processes on this node, one GPU each), and that the call was not made. Each rank writes
``rank<R>.json`` into ``--out_dir``.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course.cli import command
from ddp_course.course.l12_debugging_lab.broken._common import Record, flags

PROG = "python -m ddp_course.course.l12_debugging_lab.broken.device_global_rank (under torchrun)"


@record
@command
def main(argv: list[str]) -> None:
    opts = flags(argv, {"gpus_per_node": 0}, PROG)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node, local_world = int(os.environ.get("GROUP_RANK", 0)), int(os.environ["LOCAL_WORLD_SIZE"])
    rec = Record(opts["out_dir"], rank)
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    real = n_cuda >= local_world
    gpus = n_cuda if real else (opts["gpus_per_node"] or local_world)
    bad, good = rank, local_rank  # THE BUG is the first: cuda:RANK
    result = {"node": node, "rank": rank, "local_rank": local_rank, "gpus_per_node": gpus, "real_gpus": real,
              "by_global_rank": bad, "by_local_rank": good, "global_rank_exists": bad < gpus,
              "local_rank_exists": good < gpus}
    if real:  # a GPU machine: make the call and keep the real error
        try:
            torch.cuda.set_device(bad)
            torch.zeros(1, device="cuda")
            result["set_device_global_rank"] = "ok"
        except Exception as exc:  # noqa: BLE001 -- the error is the result
            result["set_device_global_rank"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    else:
        result["set_device_global_rank"] = "not called: no CUDA GPUs here (indices computed only)"
    rec.note(**result)
    print(f"[rank {rank}] node {node}, LOCAL_RANK {local_rank}: cuda:RANK -> cuda:{bad} "
          f"({'exists' if bad < gpus else 'does not exist'} on a {gpus}-GPU node), cuda:LOCAL_RANK -> cuda:{good}"
          + ("" if real else " [computed; no GPU touched]"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
