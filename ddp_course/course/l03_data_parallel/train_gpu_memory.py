"""``ddp_course.train``, plus the peak memory of every GPU the process used (lesson 03, dp_vs_ddp).

DataParallel, one process driving every GPU (no torchrun)::

    python -m ddp_course.course.l03_data_parallel.train_gpu_memory --strategy=dp --device=cuda --out_dir=runs/dp

DDP, one process per GPU::

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l03_data_parallel.train_gpu_memory --strategy=ddp --device=cuda --out_dir=runs/ddp

Takes exactly ``ddp_course.train``'s flags and runs its ``main``. Afterwards each process writes
``gpu_memory_rank<R>.json`` into ``--out_dir``: for every GPU it used, the peak bytes PyTorch's
caching allocator handed out (``max_memory_allocated``) and held (``max_memory_reserved``). The
training summary records only the process's own device -- under DP that is GPU 0 alone, and the
point of the comparison is how the other GPUs differ from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course import checkpoint, train
from ddp_course.config import ConfigError, parse_cli
from ddp_course.data import CorpusError
from ddp_course.dist import DeviceError
from ddp_course.metrics import write_json


def gpus_used(strategy: str, device: str) -> list[int]:
    """The GPUs a process of this strategy allocated on: all of them under DP, its own otherwise.

    ``device`` is where the run trained (its summary's ``device``, e.g. "cuda:0" or "cpu"). Its own GPU
    is the current device, which ``ddp_course.dist.setup`` set (LOCAL_RANK under NCCL; a shared GPU
    under the tests' gloo option). None for a run on the CPU: CUDA may be initialized in such a process
    all the same (seen on a GPU machine), and its GPU then holds nothing of the run.
    """
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return []
    return list(range(torch.cuda.device_count())) if strategy == "dp" else [torch.cuda.current_device()]


def main(argv: list[str]) -> dict:
    cfg = parse_cli(argv)
    summary = train.main(cfg)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    per_gpu = {}
    for i in gpus_used(cfg.strategy, str(summary.get("device", ""))):
        per_gpu[str(i)] = {"name": torch.cuda.get_device_name(i),
                           "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(i)),
                           "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(i))}
    result = {"rank": rank, "local_rank": local_rank, "strategy": cfg.strategy, "gpus": per_gpu,
              "cuda_available": torch.cuda.is_available()}
    write_json(Path(cfg.out_dir) / f"gpu_memory_rank{rank}.json", result)
    return {"summary": summary, "memory": result}


@record  # on failure, torchrun's error file carries this rank's traceback
def cli(argv: list[str] | None = None) -> None:
    try:
        main(sys.argv[1:] if argv is None else argv)
    except (ConfigError, DeviceError, CorpusError, checkpoint.CheckpointError) as exc:
        if int(os.environ.get("RANK", 0)) == 0:  # one clear paragraph, as ddp_course.train prints
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
