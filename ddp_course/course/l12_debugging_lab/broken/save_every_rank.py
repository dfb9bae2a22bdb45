"""Bug: every rank writes the checkpoint. N writers race for one file.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.save_every_rank --out_dir=runs/broken/save_every_rank

After a few DDP steps the replicas are identical, so one copy of the weights is the checkpoint; the
bug is the save without ``if rank == 0``::

    torch.save({"model": model.module.state_dict(), "saved_by": rank}, path)   # on every rank

Here that means two processes writing the same file at the same moment; on a cluster, every GPU of
every node writing the same path on a shared filesystem -- N times the I/O, and a file that is
whichever writer finished last (or, with writers that differ, a mix of them). Sometimes nothing
visibly breaks, which is why it survives.

The program saves both ways into ``--out_dir``: **broken** (every rank, ``ckpt_broken.pt``) and
**fixed** (rank 0 only, then a ``barrier`` so no rank reads before the file is complete,
``ckpt_fixed.pt``). Each rank notes in ``rank<R>.json`` whether it wrote, when its write started and
ended (wall clock, to compare the ranks' windows), how many bytes, and which rank's content it finds
when it loads the file afterwards.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.cli import command
from ddp_course.course.l12_debugging_lab.broken._common import (
    started,
    tiny_model,
    token_batch,
)
from ddp_course.dist import log

PROG = "torchrun --standalone --nproc_per_node=2 -m ddp_course.course.l12_debugging_lab.broken.save_every_rank"


def save(model: DDP, path: Path, rank: int) -> dict:
    t0 = time.time()
    torch.save({"model": model.module.state_dict(), "saved_by": rank}, path)
    t1 = time.time()
    return {"wrote": True, "start": t0, "end": t1, "bytes": path.stat().st_size}


@record
@command
def main(argv: list[str]) -> None:
    with started(argv, {"steps": 2, "n_embd": 256}, PROG) as (opts, info, rec):  # see _common.CPU_BY_DESIGN
        out = Path(opts["out_dir"])
        model = DDP(tiny_model(n_embd=opts["n_embd"]))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(opts["steps"]):
            _, loss = model(*token_batch(100 * info.rank + step, 4))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for variant in ("broken", "fixed"):
            path = out / f"ckpt_{variant}.pt"
            if info.is_main:
                path.unlink(missing_ok=True)
            dist.barrier()  # all ranks reach the save together, as after a training step
            if variant == "broken" or info.is_main:  # the fix is the second condition alone
                wrote = save(model, path, info.rank)
            else:
                wrote = {"wrote": False}
            dist.barrier()  # nobody reads before every writer is done
            found = torch.load(path, map_location="cpu", weights_only=True)["saved_by"]
            rec.note(**{variant: {**wrote, "found_saved_by": found, "path": str(path),
                                  "size_on_disk": os.path.getsize(path)}})
            log(f"[{variant}] rank {info.rank}: " + (f"wrote {wrote['bytes']:,} bytes in "
                f"{(wrote['end'] - wrote['start']) * 1e3:.1f} ms" if wrote["wrote"] else "did not write")
                + f"; the file now holds rank {found}'s save", all_ranks=True)


if __name__ == "__main__":
    sys.exit(main())
