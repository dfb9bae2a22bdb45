"""A program that joins the process group and reports how many ranks joined.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.join_group --out_dir=runs/broken/join_group

Exercise B of lesson 12: what goes wrong in this program is for the learner to find, so the program
says no more about it than a real one would. (The answer, for maintainers: ``BUGS["join_group"]`` in
``broken/__init__.py``; ``--variant=fixed`` joins the way it should.)

Joining waits ``--timeout_s`` for the other ranks. It starts counting only once every process torchrun
started is up (``_common.roll_call``, through torchrun's own store, with a generous timeout), so a rank
that a busy machine started late is never what it waited for. Each rank writes ``rank<R>.json``: the
environment torchrun gave it, the call it is in, the error that ended it; ``@record`` puts a failing
rank's traceback into torchrun's error file.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_course.cli import FlagError, command
from ddp_course.course.l12_debugging_lab.broken._common import Record, announce_cpu, flags, roll_call

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.join_group"
WORLD_SIZE = 4  # we train on a 4-GPU machine


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
    roll_call()  # the lab's own step: every process torchrun started is up before the timeout below counts
    try:
        rec.note(in_call="init_process_group")
        if opts["variant"] == "broken":
            dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timeout)  # by design: CPU
        else:
            dist.init_process_group("gloo", timeout=timeout)  # rank and world size from torchrun's environment
        rec.note(in_call="barrier", joined_world_size=dist.get_world_size())
        dist.barrier()
        rec.note(in_call=None, completed=True)
        if rank == 0:
            print(f"[{opts['variant']}] {dist.get_world_size()} ranks joined the process group", flush=True)
    except Exception as exc:
        rec.error(exc, where=rec.data["in_call"])
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
