"""The multi-node torchrun command, run for real with two "nodes" on this one machine.

    python -m ddp_course.course.l04_ddp.two_nodes --nproc_per_node=2 --out_dir=runs/two_nodes

On a real cluster you run the same torchrun command once on every node; only ``--node_rank``
differs. Here both "nodes" are torchrun agents on this machine that meet at a rendezvous endpoint
on 127.0.0.1, each starting ``--nproc_per_node`` workers of ``ddp_course.course.l00_setup.env_report``, which
write what their environment says (RANK, LOCAL_RANK, GROUP_RANK, ...) into ``--out_dir``.

``run_two_nodes(..., rendezvous="c10d", script=[...])`` runs any program instead (lesson 10 trains
MiniGPT this way) and lets the agents meet through the elastic c10d rendezvous instead of the static
``--node_rank``/``--master_addr`` one.

Real nodes have GPUs of their own, numbered from 0 on each; two agents on one machine would both
give their LOCAL_RANK 0 the same GPU, and NCCL refuses two ranks on one GPU. So each "node" is shown
GPUs of its own (``CUDA_VISIBLE_DEVICES``) when the machine has enough for both, and none otherwise:
then both run on the CPU, the same device on every rank (see :func:`gpus_per_node`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ddp_course.cli import command, parse_flags
from ddp_course.course.l04_ddp.spawn_demo import free_port
from ddp_course.launch import _JOB_VAR, stop_job

PROG = "python -m ddp_course.course.l04_ddp.two_nodes"
DEFAULTS = {"nproc_per_node": 2, "out_dir": "runs/two_nodes", "timeout_s": 90.0}


def node_command(node_rank: int, nnodes: int, nproc_per_node: int, master_addr: str, master_port: int,
                 script: list[str], python: str = "torchrun") -> list[str]:
    """The torchrun command for one node (static rendezvous: node 0 hosts it at master_addr:port)."""
    launcher = [python] if python == "torchrun" else [python, "-m", "torch.distributed.run"]
    return [*launcher, f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc_per_node}",
            f"--master_addr={master_addr}", f"--master_port={master_port}", *script]


def elastic_command(nnodes: int, nproc_per_node: int, endpoint: str, job_id: str, script: list[str],
                    python: str = "torchrun") -> list[str]:
    """The torchrun command with the c10d rendezvous: the same line on every node, node ranks given when it closes."""
    launcher = [python] if python == "torchrun" else [python, "-m", "torch.distributed.run"]
    return [*launcher, f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}", f"--rdzv_id={job_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *script]


def gpus_per_node(nproc_per_node: int, share: bool = False) -> tuple[list[str], str]:
    """``CUDA_VISIBLE_DEVICES`` for node 0 and node 1 of a two-"node" job on this machine, and why.

    ``share=True`` shows both "nodes" every GPU (for a program that puts no collective on a GPU,
    like the debugging lab's device_global_rank, to which each "node" then looks like a node with
    these GPUs).
    """
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i for i in visible.split(",") if i.strip()] if visible is not None else [str(i) for i in range(n)]
    ids = ids[:n]
    if share or n == 0:
        everything = ",".join(ids)
        return [everything, everything], ("every GPU shown to both nodes" if share and n else "no CUDA GPU")
    if n >= 2 * nproc_per_node:
        per = [",".join(ids[r * nproc_per_node:(r + 1) * nproc_per_node]) for r in (0, 1)]
        return per, f"{nproc_per_node} GPU(s) of their own for each node"
    return ["", ""], (f"GPUs hidden from both nodes: {n} GPU(s) cannot give each of the 2 x {nproc_per_node} "
                      "processes its own, so both nodes run on the CPU")


def run_two_nodes(out_dir: str | Path, nproc_per_node: int = 2, timeout: float = 90.0, *,
                  script: list[str] | None = None, rendezvous: str = "static",
                  env: dict[str, str] | None = None, share_gpus: bool = False) -> list[str]:
    """Start two torchrun agents (node_rank 0 and 1) on 127.0.0.1 and wait for both.

    ``script`` is what each agent starts (default: the environment report, writing into
    ``out_dir``); ``rendezvous`` is ``static`` (``--node_rank``, ``--master_addr``/``--master_port``)
    or ``c10d`` (the same line for both agents, ``--rdzv_endpoint=127.0.0.1:PORT``); ``env`` is added
    to the agents' environment. Each agent's output goes to ``out_dir/node<R>.log``, whose first line
    says which GPUs the node was given (:func:`gpus_per_node`; ``share_gpus`` passes ``share``).

    Returns the two command lines. Raises RuntimeError (with the output) if either fails, and stops
    every process of both jobs on timeout.
    """
    if rendezvous not in ("static", "c10d"):
        raise ValueError(f"rendezvous={rendezvous!r}: choose 'static' or 'c10d'.")
    port = free_port()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if script is None:
        script = ["-m", "ddp_course.course.l00_setup.env_report", f"--out_dir={out_dir}"]
    job = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {}), _JOB_VAR: job}
    if rendezvous == "static":
        cmds = [node_command(r, 2, nproc_per_node, "127.0.0.1", port, script, python=sys.executable) for r in (0, 1)]
    else:  # one line for both agents; the agent that can bind the port hosts the rendezvous store
        line = elastic_command(2, nproc_per_node, f"127.0.0.1:{port}", job[:8], script, python=sys.executable)
        cmds = [line, list(line)]
    gpus, why = gpus_per_node(nproc_per_node, share=share_gpus)
    logs = [open(out_dir / f"node{r}.log", "w", encoding="utf-8") for r in (0, 1)]  # a pipe could fill up
    for r, log in enumerate(logs):
        log.write(f"# node {r}: CUDA_VISIBLE_DEVICES={gpus[r]!r} ({why})\n")
        log.flush()
    procs = [subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              env={**env, "CUDA_VISIBLE_DEVICES": gpus[r]}, start_new_session=True)
             for r, (c, log) in enumerate(zip(cmds, logs))]
    start = time.monotonic()
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the two-node job did not finish within {timeout:.0f}s and was stopped")
            time.sleep(0.2)
    finally:
        for p, log in zip(procs, logs):
            stop_job(p, job)  # a no-op for a finished agent; otherwise it and its workers are stopped
            log.close()
    outputs = [(out_dir / f"node{r}.log").read_text(encoding="utf-8") for r in (0, 1)]
    for r, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"node {r} exited with {p.returncode}:\n{out[-3000:]}")
    return [" ".join(c) for c in cmds]


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG)
    for line in run_two_nodes(opts["out_dir"], opts["nproc_per_node"], opts["timeout_s"]):
        print(line)
    for f in sorted(Path(opts["out_dir"]).glob("env_rank*.json")):
        print(f.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
