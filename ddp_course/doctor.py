"""``python -m ddp_course doctor``: what this machine has, and what the course will use on it."""

from __future__ import annotations

import os
import platform
import sys

import torch
import torch.distributed as dist

from ddp_course.data import cache_dir, find_shakespeare
from ddp_course.dist import DeviceError, choose_device, cpu_count
from ddp_course.paths import show


def report() -> dict:
    """Everything doctor prints, as data (the notebook of lesson 00 shows it)."""
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpu_cores": cpu_count(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpu_count": len(gpus),
        "gpus": gpus,
        "bf16_on_gpu": bool(cuda and torch.cuda.is_bf16_supported()),
        "distributed_available": dist.is_available(),
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "plans": {},
    }
    for n in (1, 2, 4):
        try:
            _, _, reason = choose_device("auto", n)
            info["plans"][n] = reason
        except DeviceError as exc:  # pragma: no cover - auto never raises
            info["plans"][n] = str(exc)
    path, why = find_shakespeare(download=False)
    info["corpus"] = show(path) if path else f"not found locally ({why}); first use downloads it into {cache_dir()}"
    info["DDP_COURSE_DATA"] = os.environ.get("DDP_COURSE_DATA")
    return info


def format_report(info: dict) -> str:
    b = info["backends"]
    lines = [
        f"python        {info['python']} on {info['platform']}",
        f"torch         {info['torch']}  (CUDA build: {info['cuda_version'] or 'no, CPU only'})",
        f"CPU cores     {info['cpu_cores']}",
        f"CUDA          {'available' if info['cuda_available'] else 'not available'}; "
        f"{info['gpu_count']} GPU(s){': ' + ', '.join(info['gpus']) if info['gpus'] else ''}",
        f"bf16 on GPU   {'yes' if info['bf16_on_gpu'] else 'no'}",
        f"backends      gloo={'yes' if b['gloo'] else 'no'}  nccl={'yes' if b['nccl'] else 'no'}  "
        f"mpi={'yes' if b['mpi'] else 'no'}",
        f"corpus        {info['corpus']}",
        "",
        "With --device=auto the course will use:",
    ]
    lines += [f"  {n} process(es): {plan}" for n, plan in info["plans"].items()]
    if not info["cuda_available"]:
        lines += ["", "No GPU: every lesson runs on the CPU with gloo (2 to 4 processes). Cells that need",
                  "two or more GPUs say so and skip."]
    return "\n".join(lines)


PROG = "python -m ddp_course doctor"


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_course doctor``: the report; ``--help`` explains it; any other argument is bad input."""
    from ddp_course.cli import HELP_FLAGS, FlagError, parse_flags, usage

    argv = sys.argv[1:] if argv is None else argv
    doc = ("What this machine has (Python, torch, CPU cores, GPUs, backends, the corpus) and which device and "
           "backend the course will use for 1, 2 and 4 processes. It takes no options.")
    if any(a in HELP_FLAGS for a in argv):
        print(usage(PROG, doc, {}))
        return 0
    try:
        parse_flags(argv, {}, PROG)
    except FlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
