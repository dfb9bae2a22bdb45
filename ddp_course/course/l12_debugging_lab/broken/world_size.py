"""Bug: a world size written into the code that is not the one the job was launched with.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.world_size --out_dir=runs/broken/world_size

The program was written for a 4-GPU machine and says so in a constant::

    WORLD_SIZE = 4
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=...)

Launched with ``--nproc_per_node=2``, torchrun starts ranks 0 and 1 (and sets ``WORLD_SIZE=2`` in
their environment, which the explicit argument overrides). ``init_process_group`` then waits in the
rendezvous for ranks 2 and 3, who never come, until the timeout (``--timeout_s``); the error names
the store key it was waiting for -- the address of a rank that does not exist.

``--variant=fixed`` lets ``init_process_group`` read the world size and rank from the environment
torchrun prepared (the course's ``ddp_course.dist.setup`` does this), and completes. Each rank notes
in ``rank<R>.json`` what torchrun told it and what the code asked for, then any error; ``@record``
puts the failing rank's traceback into torchrun's error file.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course.cli import FlagError, command
from ddp_course.course.l12_debugging_lab.broken._common import Record, announce_cpu, flags

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.world_size"
WORLD_SIZE = 4  # "we train on a 4-GPU machine" -- THE BUG when the job is launched with another size


@record  # if this rank fails, torchrun's error file carries its traceback
@command
def main(argv: list[str]) -> None:
    opts = flags(argv, {"variant": "broken", "timeout_s": 5.0}, PROG)
    if opts["variant"] not in ("fixed", "broken"):
        raise FlagError(f"{PROG}: --variant must be fixed or broken")
    rank = int(os.environ["RANK"])
    announce_cpu(rank)
    rec = Record(opts["out_dir"], rank)
    timeout = timedelta(seconds=opts["timeout_s"])
    try:
        if opts["variant"] == "broken":
            rec.note(asked_world_size=WORLD_SIZE, in_call="init_process_group")
            dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timeout)  # by design: CPU
        else:
            rec.note(asked_world_size=None, in_call="init_process_group")
            dist.init_process_group("gloo", timeout=timeout)  # rank and world size from torchrun's environment
        rec.note(in_call="barrier", joined_world_size=dist.get_world_size())
        dist.barrier()
        rec.note(in_call=None, completed=True)
        if rank == 0:
            print(f"[{opts['variant']}] {dist.get_world_size()} ranks joined the process group", flush=True)
    except Exception as exc:
        rec.error(exc, where=rec.data["in_call"])
        print(f"[rank {rank}] gave up in {rec.data['in_call']} after {rec.data['error']['seconds']}s: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
