"""Commands for a job on several nodes, generated so that nobody edits them by hand.

    python -m ddp_course multinode --nnodes=2 --nproc=8 --master_addr=10.0.0.1
    python -m ddp_course multinode --nnodes=2 --nproc=8 --partition=gpu --time=02:00:00 -- --strategy=ddp --max_steps=5000

prints, for ``--nnodes`` nodes with ``--nproc`` GPUs each:

1. the torchrun line for every node with the **static** rendezvous: ``--node_rank`` differs per
   node, ``--master_addr``/``--master_port`` name node 0, which hosts the rendezvous store;
2. the one torchrun line for every node with the elastic **c10d** rendezvous: the same text on
   every node, ``--rdzv_endpoint`` names a host:port all nodes reach, and the node ranks are given
   when the rendezvous closes (sorted by host address and agent process id, not by arrival);
3. a Slurm batch script that runs (2) on its allocation through ``srun``, one agent per node;
4. the NCCL environment knobs worth knowing when such a job hangs or crawls.

Every generated torchrun line is parsed by torchrun's own argument parser
(``torch.distributed.run.get_args_parser()``) before it is printed, so a command this module
prints is one torchrun accepts. Arguments after ``--`` go to the training module unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from ddp_course.cli import FlagError, command, parse_flags

PROG = "python -m ddp_course multinode"


class MultinodeError(FlagError):
    """A bad option, or a generated command that torchrun would refuse. The message says why
    (a ``FlagError``: ``@command`` prints it and the command exits with code 2)."""


@dataclass(frozen=True)
class JobSpec:
    """What the commands describe: how many nodes and GPUs, where they meet, what runs."""

    nnodes: int = 2  # machines in the job
    nproc: int = 8  # processes (GPUs) per machine
    master_addr: str = "node0"  # node 0's hostname or IP, reachable from every node
    port: int = 29500  # TCP port on node 0 for the rendezvous store (open it in the firewall)
    job_id: str = "ddp_course"  # c10d rendezvous id: the same on every node of one job
    module: str = "ddp_course.train"  # what each process runs (python -m MODULE)
    args: tuple[str, ...] = ("--strategy=ddp",)  # its arguments
    job_name: str = "ddp_course"  # Slurm job name
    partition: str = ""  # Slurm partition (empty: the cluster's default)
    time: str = "01:00:00"  # Slurm wall-clock limit
    cpus_per_task: int = 0  # CPU cores for each node's agent and its workers (0: 4 per GPU)
    env: dict[str, str] = field(default_factory=dict)  # exported before torchrun (NCCL knobs)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    def script(self) -> list[str]:
        return ["-m", self.module, *self.args]


# ------------------------------------------------------------------------------------------------
# the commands

def static_commands(spec: JobSpec) -> list[list[str]]:
    """One torchrun command per node: ``--node_rank=i``; node 0 (``master_addr``) hosts the store."""
    return [["torchrun", f"--nnodes={spec.nnodes}", f"--node_rank={i}", f"--nproc_per_node={spec.nproc}",
             f"--master_addr={spec.master_addr}", f"--master_port={spec.port}", *spec.script()]
            for i in range(spec.nnodes)]


def c10d_command(spec: JobSpec, endpoint: str | None = None) -> list[str]:
    """The one torchrun command every node runs with the c10d rendezvous (node ranks given when it closes)."""
    endpoint = endpoint or f"{spec.master_addr}:{spec.port}"
    return ["torchrun", f"--nnodes={spec.nnodes}", f"--nproc_per_node={spec.nproc}", f"--rdzv_id={spec.job_id}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", *spec.script()]


SLURM_OPTIONS = {  # the sbatch options the script uses, with what each means
    "job-name": "name shown by squeue",
    "nodes": "machines in the allocation",
    "ntasks-per-node": "one task per node: the torchrun agent, which starts the workers itself",
    "gpus-per-node": "GPUs on each machine, one per worker",
    "cpus-per-task": "cores for the agent and its workers (DataLoader workers live here too)",
    "time": "wall-clock limit",
    "partition": "queue to submit to",
    "output": "log file; %x is the job name, %j the job id",
}


def slurm_script(spec: JobSpec) -> str:
    """A batch script: one ``srun`` task per node runs the c10d torchrun line; the first node of
    the allocation hosts the rendezvous (its hostname comes from ``scontrol show hostnames``)."""
    cpus = spec.cpus_per_task or 4 * spec.nproc
    sbatch = {"job-name": spec.job_name, "nodes": spec.nnodes, "ntasks-per-node": 1, "gpus-per-node": spec.nproc,
              "cpus-per-task": cpus, "time": spec.time, "output": "%x-%j.out"}
    if spec.partition:
        sbatch["partition"] = spec.partition
    torchrun = c10d_command(dataclasses.replace(spec, job_id="$SLURM_JOB_ID"), endpoint=f"$head_node:{spec.port}")
    # quote everything except the $variables, which the shell on each node must expand
    quoted = " ".join(_shell_word(w) for w in torchrun)
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{k}={v}" for k, v in sbatch.items()]
    lines += [
        "set -euo pipefail",
        "",
        "# The first node of the allocation hosts the c10d rendezvous store on port "
        f"{spec.port} (open to the other nodes).",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=" + str(max(1, cpus // spec.nproc)),
    ]
    for k, v in spec.env.items():
        lines.append(f"export {k}={shlex.quote(v)}")
    lines += ["", f"# {spec.nnodes} nodes x {spec.nproc} processes = {spec.world_size} ranks",
              "# Slurm 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to srun (man sbatch): given again here.",
              f'srun --ntasks-per-node=1 "--cpus-per-task=$SLURM_CPUS_PER_TASK" {quoted}', ""]
    return "\n".join(lines)


def _shell_word(word: str) -> str:
    """Quote for bash, but leave ``$VAR`` references to be expanded (inside double quotes)."""
    if "$" in word:
        return '"' + word.replace('"', '\\"') + '"'
    return shlex.quote(word)


# ------------------------------------------------------------------------------------------------
# checking what was generated

def parse_torchrun(cmd: list[str]):
    """Parse a ``torchrun ...`` command with torchrun's own parser; returns its namespace.

    Raises :class:`MultinodeError` carrying torchrun's complaint if it would refuse the command.
    """
    from torch.distributed.run import get_args_parser

    if not cmd or cmd[0] != "torchrun":
        raise MultinodeError(f"not a torchrun command: {shlex.join(cmd)!r}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return get_args_parser().parse_args(cmd[1:])
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise MultinodeError(f"torchrun refuses `{shlex.join(cmd)}`: "
                             f"{lines[-1].split('error:', 1)[1].strip() if lines else err.getvalue()}") from None


def check_commands(spec: JobSpec) -> dict[str, Any]:
    """Parse every generated line with torchrun's parser and check what it understood.

    Returns a summary (per node: nnodes, node_rank, nproc_per_node, rendezvous). Raises
    :class:`MultinodeError` if torchrun would refuse a line or read it differently than intended.
    """
    out: dict[str, Any] = {"static": [], "c10d": None, "slurm": None}
    for i, cmd in enumerate(static_commands(spec)):
        a = parse_torchrun(cmd)
        got = (a.nnodes, a.node_rank, a.nproc_per_node, a.master_addr, a.master_port, a.module, a.training_script)
        want = (str(spec.nnodes), i, str(spec.nproc), spec.master_addr, spec.port, True, spec.module)
        if got != want:
            raise MultinodeError(f"torchrun read node {i}'s line as {got}, expected {want}")
        out["static"].append({"node_rank": a.node_rank, "nnodes": a.nnodes, "nproc_per_node": a.nproc_per_node,
                              "rdzv_backend": a.rdzv_backend, "script_args": a.training_script_args})
    a = parse_torchrun(c10d_command(spec))
    if (a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) != ("c10d", f"{spec.master_addr}:{spec.port}", spec.job_id):
        raise MultinodeError(f"torchrun read the c10d line's rendezvous as {a.rdzv_backend} {a.rdzv_endpoint} {a.rdzv_id}")
    out["c10d"] = {"nnodes": a.nnodes, "nproc_per_node": a.nproc_per_node, "rdzv_endpoint": a.rdzv_endpoint,
                   "rdzv_id": a.rdzv_id}
    out["slurm"] = check_slurm(slurm_script(spec), spec)
    return out


def check_slurm(script: str, spec: JobSpec, example_host: str = "gpu-node-001",
                example_job_id: str = "123456") -> dict[str, Any]:
    """Check a generated batch script: bash syntax (``bash -n``), known ``#SBATCH`` options, and the
    torchrun line (after the shell would expand ``$head_node`` and ``$SLURM_JOB_ID``) parsed by torchrun."""
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, timeout=30)
    if proc.returncode != 0:
        raise MultinodeError(f"bash -n refuses the batch script: {proc.stderr.strip()}")
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            m = re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line)
            if not m or m.group(1) not in SLURM_OPTIONS:
                raise MultinodeError(f"unexpected #SBATCH line {line!r}")
            options[m.group(1)] = m.group(2)
    if int(options["nodes"]) != spec.nnodes or int(options["gpus-per-node"]) != spec.nproc:
        raise MultinodeError(f"#SBATCH asks for {options['nodes']} nodes x {options['gpus-per-node']} GPUs, "
                             f"the job is {spec.nnodes} x {spec.nproc}")
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    if len(srun) != 1:
        raise MultinodeError("the batch script should hold exactly one srun line")
    expanded = srun[0].replace("$head_node", example_host).replace("$SLURM_JOB_ID", example_job_id)
    words = shlex.split(expanded)
    cmd = words[words.index("torchrun"):]
    a = parse_torchrun(cmd)
    if a.rdzv_endpoint != f"{example_host}:{spec.port}" or a.rdzv_id != example_job_id or a.nnodes != str(spec.nnodes):
        raise MultinodeError(f"torchrun read the srun line as endpoint {a.rdzv_endpoint}, id {a.rdzv_id}, "
                             f"nnodes {a.nnodes}")
    return {"sbatch": options, "torchrun": cmd}


# ------------------------------------------------------------------------------------------------
# what to know on a real cluster

# NCCL_DEBUG and NCCL_DEBUG_SUBSYS as NCCL's src/debug.cc (ncclDebugInit) reads them: unset, the level is
# NONE; the subsystem mask defaults to INIT|BOOTSTRAP|ENV, and a list without a leading ^ replaces it
# (with ^ it removes subsystems from all of them). Communicators are created lazily, at a process group's
# first collective, unless init_process_group gets a device_id (its docstring in
# torch/distributed/distributed_c10d.py), and INFO prints their set-up each time.
NCCL_KNOBS = {
    "NCCL_DEBUG": ("INFO", "NCCL prints its version, the network interface and transport it picked (NVLink/P2P, "
                   "shared memory, InfiniBand, sockets) and the rings/trees it built, every time it creates a "
                   "communicator: PyTorch creates one per process group (at its first collective, unless "
                   "init_process_group got a device_id), so subgroups (FSDP's, tensor parallelism's) print "
                   "their own later in the run. "
                   "The first thing to set when a multi-node job hangs in init_process_group or the first "
                   "collective. Unset (the default), NCCL prints nothing of its own; WARN prints only problems. "
                   "NCCL_DEBUG_SUBSYS selects what INFO prints: a list replaces the default subsystems "
                   "(INIT,BOOTSTRAP,ENV), so INIT,NET shows start-up and the network and drops the rest."),
    "NCCL_SOCKET_IFNAME": ("eth0", "Which network interface NCCL uses for its bootstrap connections and its socket "
                           "transport; a prefix (eth, ens) or an exclusion list (^docker0,lo). If NCCL picks an "
                           "interface the other nodes cannot reach (a docker bridge, a management port), the job "
                           "hangs at the first collective. gloo has its own: GLOO_SOCKET_IFNAME."),
    "NCCL_IB_DISABLE": ("1", "Do not use InfiniBand/RoCE (RDMA); fall back to TCP sockets. A diagnosis switch: if a "
                        "job works with it and hangs without, the InfiniBand set-up (drivers, GPUDirect RDMA, "
                        "NCCL_IB_HCA) is the problem. On a cluster with InfiniBand it costs most of the "
                        "inter-node bandwidth, so never leave it on by accident."),
    "NCCL_P2P_DISABLE": ("1", "Do not copy directly between GPUs of one node (NVLink or PCIe peer-to-peer); go "
                         "through host memory instead. A workaround for machines whose PCIe topology breaks P2P "
                         "(some virtual machines, ACS enabled): the job stops hanging or corrupting, and the "
                         "intra-node bandwidth drops."),
}

# Published peak link speeds, per direction, from the vendors' specifications: nothing here is
# measured. GB/s = 1e9 bytes per second. One entry per link a gradient can cross.
LINKS = {
    "NVLink 4 (H100 SXM, per GPU)": (450.0, "intra-node", "900 GB/s total over both directions"),
    "NVLink 3 (A100 SXM, per GPU)": (300.0, "intra-node", "600 GB/s total over both directions"),
    "PCIe 5.0 x16": (63.0, "intra-node", "32 GT/s x 16 lanes, 128b/130b encoding"),
    "PCIe 4.0 x16": (31.5, "intra-node", "16 GT/s x 16 lanes"),
    "InfiniBand NDR (400 Gb/s port)": (50.0, "inter-node", "one port; DGX H100 has one per GPU"),
    "InfiniBand HDR (200 Gb/s port)": (25.0, "inter-node", "one port"),
    "Ethernet 100 Gb/s": (12.5, "inter-node", "one port"),
    "Ethernet 10 Gb/s": (1.25, "inter-node", "one port"),
}


def ring_allreduce_s(n_bytes: float, world_size: int, link_gb_s: float) -> float:
    """Lower bound on a ring all-reduce: every rank sends 2 (n - 1) / n x the message over its link.

    It assumes that all of a rank's ring traffic crosses that one link: for a network port, one GPU
    per node. A node with several GPUs and several ports can spread the traffic that leaves it over
    all of them, so for such a job a port's row is no bound. Latency and protocol overheads are
    ignored, so real collectives on one such link are slower.
    """
    if world_size < 2:
        return 0.0
    return 2 * (world_size - 1) / world_size * n_bytes / (link_gb_s * 1e9)


def link_table(n_params: float, bytes_per_grad: int = 4, world_size: int = 16) -> list[dict[str, Any]]:
    """For each link in :data:`LINKS`: the ring all-reduce lower bound for ``n_params`` gradients, with
    every rank's whole ring traffic through one such link (:func:`ring_allreduce_s`)."""
    n_bytes = n_params * bytes_per_grad
    return [{"link": name, "where": where, "gb_per_s": bw, "note": note,
             "allreduce_ms": 1e3 * ring_allreduce_s(n_bytes, world_size, bw)}
            for name, (bw, where, note) in LINKS.items()]


# ------------------------------------------------------------------------------------------------
# the command

DEFAULTS: dict[str, Any] = {"nnodes": 2, "nproc": 8, "master_addr": "node0", "port": 29500, "job_id": "ddp_course",
                            "module": "ddp_course.train", "job_name": "ddp_course", "partition": "",
                            "time": "01:00:00", "cpus_per_task": 0, "nccl_debug": "", "socket_ifname": ""}


def spec_from_argv(argv: list[str]) -> JobSpec:
    """``--key=value`` options of the command, then ``--`` and the training module's own arguments."""
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    else:
        train_args = ["--strategy=ddp"]
    try:
        o = parse_flags(argv, DEFAULTS, PROG, doc=__doc__)
    except FlagError as exc:
        raise MultinodeError(str(exc)) from None
    if o["nnodes"] < 1 or o["nproc"] < 1:
        raise MultinodeError(f"--nnodes and --nproc must be at least 1 (got {o['nnodes']} and {o['nproc']}).")
    if not 1 <= o["port"] <= 65535:
        raise MultinodeError(f"--port={o['port']} is not a TCP port (1..65535).")
    env = {}
    if o["nccl_debug"]:
        env["NCCL_DEBUG"] = o["nccl_debug"]
    if o["socket_ifname"]:
        env["NCCL_SOCKET_IFNAME"] = o["socket_ifname"]
        env["GLOO_SOCKET_IFNAME"] = o["socket_ifname"]
    return JobSpec(nnodes=o["nnodes"], nproc=o["nproc"], master_addr=o["master_addr"], port=o["port"],
                   job_id=o["job_id"], module=o["module"], args=tuple(train_args), job_name=o["job_name"],
                   partition=o["partition"], time=o["time"], cpus_per_task=o["cpus_per_task"], env=env)


def render(spec: JobSpec) -> str:
    """Everything the command prints, checked by torchrun's parser first."""
    check_commands(spec)
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in spec.env.items())
    out = [f"# {spec.nnodes} node(s) x {spec.nproc} process(es) = world size {spec.world_size}",
           "", "## static rendezvous: run line i on node i (node 0 is "
           f"{spec.master_addr}, port {spec.port} open to the other nodes)"]
    for i, cmd in enumerate(static_commands(spec)):
        out.append(f"node {i}:  {env}{shlex.join(cmd)}")
    out += ["", "## c10d rendezvous: the same line on every node (node ranks sorted by address and pid when it "
            "closes; restarts possible)",
            f"{env}{shlex.join(c10d_command(spec))}",
            "", "## Slurm: save as job.sbatch, submit with `sbatch job.sbatch`", slurm_script(spec),
            "## NCCL knobs (export before torchrun when a job hangs or crawls)"]
    for k, (example, why) in NCCL_KNOBS.items():
        out.append(f"# {k}={example}: {why}")
    out.append("# Ports: node 0's --master_port (or the rendezvous port) must accept TCP from every node; NCCL and "
               "gloo then open further connections between every pair of nodes on ephemeral ports, so the "
               "firewall must let the nodes reach each other, not only that one port.")
    out.append("# Every line above was parsed by torchrun's own argument parser.")
    return "\n".join(out)


@command
def main(argv: list[str]) -> int:
    print(render(spec_from_argv(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
