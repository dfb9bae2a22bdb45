"""The debugging lab: one small torchrun program per classic DDP bug (lesson 12).

    from ddp_course.course.l12_debugging_lab import broken
    run = broken.launch("collective_rank0", "runs/12/collective_rank0")   # never hangs: timeouts
    print(broken.symptom(run))          # what the learner sees in the terminal, condensed
    broken.records(run)                 # what each rank noted: rank<R>.json, as data
    broken.error_files(run)             # torchrun's error files, written through @record

Every program is launched with a short process-group timeout (``--timeout_s``, 5 s) and an outer
timeout on the whole job, so a program that hangs ends with an error a learner can read.
``BUGS`` lists them with their symptom, the tool that diagnoses them and the fix;
``check_exercise`` grades the three diagnoses of the lesson's exercise against what the programs
recorded.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_course.check import NOT_COMPLETE, Verdict
from ddp_course.check.records import notebook_exercise

PACKAGE = "ddp_course.course.l12_debugging_lab.broken"
PG_TIMEOUT_S = 5.0  # the process-group timeout the lab runs with: long enough for a tiny job, short to wait out


@dataclass(frozen=True)
class Bug:
    key: str
    title: str
    symptom: str  # what the learner sees
    tool: str  # what diagnoses it
    fix: str
    hangs: bool = False  # ends only through the process-group timeout
    nodes: int = 1  # 2: launched as two torchrun agents (two "nodes")

    @property
    def module(self) -> str:
        return f"{PACKAGE}.{self.key}"


BUGS: dict[str, Bug] = {b.key: b for b in (
    Bug("collective_rank0", "a collective called on rank 0 only",
        "the job stops making progress; after the process-group timeout every rank fails with "
        "'Timed out waiting ... for recv operation' (or 'Connection closed by peer' once the other rank is gone)",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is checked against the other ranks' first, and the error "
        "names the collective each rank is in",
        "every rank calls every collective: all_reduce on all ranks, then only rank 0 prints", hangs=True),
    Bug("world_size", "a world size written into the code",
        "the job never gets past init_process_group; after the timeout: DistStoreError 'wait timeout ... keys: "
        "/default_pg/0//cpu//0/2' -- the address of rank 2, which does not exist",
        "torchrun's error file (@record) with the failing rank's traceback, and the per-rank log of WORLD_SIZE",
        "let init_process_group read RANK and WORLD_SIZE from torchrun's environment", hangs=True),
    Bug("no_set_epoch", "DistributedSampler without set_epoch",
        "nothing fails; every epoch reads the same samples in the same order on each rank",
        "comparing per-rank data across epochs",
        "sampler.set_epoch(epoch) at the start of every epoch"),
    Bug("same_seed", "the same data seed on every rank",
        "nothing fails; the ranks' local losses are identical to the last digit",
        "comparing per-rank data: the windows each rank trained on, and each rank's local loss",
        "a DistributedSampler (shared seed, disjoint shards), or a data seed that includes the rank"),
    Bug("uneven_batches", "uneven batches without drop_last",
        "the epoch never ends: one rank waits in a backward's all-reduce, the other in the next collective, "
        "until the timeout",
        "comparing per-rank batch counts (len(loader) on every rank), then the timeout message",
        "drop_last=True (DistributedSampler and DataLoader), or the loop inside Join([model])", hangs=True),
    Bug("no_sync_placement", "no_sync() in the wrong place",
        "nothing fails; accumulation is no faster (forward outside no_sync), or the replicas drift apart "
        "(the last micro-step inside it)",
        "counting all-reduces with a communication hook, and comparing the replicas' weights",
        "forward and backward of every non-final micro-step inside no_sync(), the last one outside"),
    Bug("save_every_rank", "every rank saving the checkpoint",
        "usually nothing visible: N processes write one file at once; which rank's save it holds is a race",
        "per-rank logs of who wrote, when and how much",
        "if rank == 0: save, then a barrier before anyone reads it"),
    Bug("device_global_rank", "the device chosen by the global RANK",
        "works on one node; on the second node ranks ask for GPUs that do not exist (invalid device) "
        "or share one with another rank",
        "printing RANK, LOCAL_RANK and the device each rank picks, per node",
        "torch.cuda.set_device(LOCAL_RANK)", nodes=2),
)}


def launch(key: str, out_dir: str | Path, *, nproc: int = 2, timeout: float = 90.0, env: dict[str, str] | None = None,
           **flags: Any):
    """Run bug program ``key`` (flags as ``--key=value``) with a job timeout of ``timeout`` seconds.

    The programs that hang give up after their process-group timeout (``timeout_s``, default
    :data:`PG_TIMEOUT_S`); the outer timeout only guards against the unforeseen.

    The folder is emptied first (no record of an earlier run can be mistaken for this one's). A job
    that fails is the point: it comes back as a failed ``Run`` (``check=False``) rather than raising.
    A two-node bug (``device_global_rank``) runs as two torchrun agents and returns the agents'
    command lines instead.
    """
    from ddp_course.launch import run

    bug = BUGS[key]
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if bug.nodes == 2:
        from ddp_course.course.l04_ddp.two_nodes import run_two_nodes

        script = ["-m", bug.module, f"--out_dir={out.resolve()}", *(f"--{k}={v}" for k, v in flags.items())]
        # both "nodes" see every GPU: the program only picks a device, it runs no collective on one
        return run_two_nodes(out, nproc_per_node=nproc, timeout=timeout, script=script, env=env, share_gpus=True)
    return run(bug.module, nproc=nproc, out_dir=out, timeout=timeout, check=False, progress=False, echo="none",
               env=env, **job_flags(key, **flags))


def job_flags(key: str, **flags: Any) -> dict[str, Any]:
    """The options :func:`launch` passes to program ``key``: ``flags``, and a hanging program's timeout."""
    return {"timeout_s": PG_TIMEOUT_S, **flags} if BUGS[key].hangs else dict(flags)


def launch_all(base_dir: str | Path, keys: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Start the programs ``keys`` (default: all of :data:`BUGS`) at the same time, each into
    ``base_dir/<key>``; returns {key: future} whose ``.result()`` is what :func:`launch` returns.

    Most of a hanging program's time is spent waiting for its timeout, and most of the others' in
    starting Python and torch: side by side they finish in far less time than one after another.
    Every job keeps its own timeouts.
    """
    from concurrent.futures import ThreadPoolExecutor

    keys = list(BUGS) if keys is None else keys
    pool = ThreadPoolExecutor(max_workers=len(keys), thread_name_prefix="broken")
    futures = {k: pool.submit(launch, k, Path(base_dir) / k, **kwargs) for k in keys}
    pool.shutdown(wait=False)
    return futures


def _folder(run_or_dir) -> Path:
    return Path(getattr(run_or_dir, "out_dir", None) or run_or_dir)


def records(run_or_dir) -> dict[int, dict[str, Any]]:
    """{rank: what that rank noted} from the ``rank<R>.json`` files of a run."""
    out = {}
    for p in sorted(_folder(run_or_dir).glob("rank*.json")):
        data = json.loads(p.read_text(encoding="utf-8"))
        out[int(data["rank"])] = data
    return dict(sorted(out.items()))


def error_files(run_or_dir) -> list[dict[str, Any]]:
    """torchrun's error files for a failed run (one per failed rank, written by ``@record``), by rank.

    Each: the file's path, the rank, the error message, and the traceback that rank printed (read by
    :func:`ddp_course.launch.error_files`, which puts the likely cause first instead).
    """
    from ddp_course.launch import error_files as read_error_files

    found = read_error_files(_folder(run_or_dir) / "torchrun_logs")
    return [{k: e[k] for k in ("path", "rank", "message", "traceback")}
            for e in sorted(found, key=lambda e: (e["rank"] is None, e["rank"] or 0))]


_TORCH_TRACE = re.compile(r"^\[rank(\d+)\]:")  # torch prefixes every line of a worker's traceback like this
_NOISE = re.compile(r"^\[(\d+)\]:$|^\[[WIE]\d{4} ")  # torchrun's summary headers; C++ log lines (W1122 ...)


def symptom(run, max_lines: int = 14) -> str:
    """What the terminal shows, condensed: the program's own lines, each failing rank's last error line,
    and how the job ended. Tracebacks are left to :func:`error_files`."""
    lines = run.output.splitlines()
    own = [ln for ln in lines if ln.startswith("[") and not _TORCH_TRACE.match(ln) and not _NOISE.match(ln)]
    last_error: dict[str, str] = {}
    for ln in lines:
        m = _TORCH_TRACE.match(ln)
        if m and re.match(r"^\[rank\d+\]: \w+(Error|Exception)\b", ln):
            last_error[m.group(1)] = ln
    out = own[:max_lines]
    if len(own) > max_lines:
        out.append(f"... ({len(own) - max_lines} more lines)")
    out += [last_error[r] for r in sorted(last_error)]
    ended = "finished" if run.returncode == 0 else f"FAILED, exit code {run.returncode}"
    out.append(f"-> the job {ended} after {run.elapsed_s:.1f} s")
    return "\n".join(ln if len(ln) <= 240 else ln[:237] + "..." for ln in out)


# ------------------------------------------------------------------------------------------------
# the exercise: three diagnoses, graded against what the programs recorded

def _norm(name: Any) -> str:
    return re.sub(r"[^a-z]", "", str(name).lower())


def _overlap(a: list[list[int]], b: list[list[int]]) -> float:
    sa = {i for batch in a for i in batch}
    sb = [i for batch in b for i in batch]
    return sum(i in sa for i in sb) / len(sb)


@notebook_exercise(lambda number, *args, **kwargs: f"answer_{'abc'[number - 1] if number in (1, 2, 3) else number}")
def check_exercise(number: int, answer: Any, out_dir: str | Path) -> Verdict:
    """Grade diagnosis ``number`` (1, 2 or 3) of lesson 12's exercise against the run in ``out_dir``.

    1. ``collective_rank0``: ``{rank: collective}``, the collective each rank was stuck in.
    2. ``world_size``: ``{"asked": N, "launched": M}``, the world size the code asked for and the one
       torchrun started.
    3. ``same_seed``: ``{"broken": f, "fixed": g}``, the fraction of rank 1's training windows that
       rank 0 also trained on, in each variant.
    """
    if number in (1, 2, 3) and answer is None:
        name = "answer_" + "abc"[number - 1]
        return Verdict(False, f"{NOT_COMPLETE}: {name} is not set yet. Fill in the TODO in the exercise cell above "
                              f"and run that cell (it sets {name}), then re-run this cell.")
    recs = records(out_dir)
    if not recs:
        return Verdict(False, f"no rank records in {out_dir}: run the program first (broken.launch(...)).")
    if number == 1:
        truth = {r: rec.get("in_collective") for r, rec in recs.items()}
        if not isinstance(answer, dict):
            return Verdict(False, "answer with a dict {rank: collective}, e.g. {0: 'broadcast', 1: 'all_gather'}.")
        got = {int(k): _norm(v) for k, v in answer.items()}
        wrong = [r for r in truth if got.get(r) != _norm(truth[r])]
        if wrong:
            r = wrong[0]
            return Verdict(False, f"rank {r} was not in {answer.get(r, answer.get(str(r)))!r}. With "
                                  "TORCH_DISTRIBUTED_DEBUG=DETAIL each rank's error begins 'Rank N is running "
                                  "collective: CollectiveFingerPrint(... OpType=...)': read each rank's own line.")
        return Verdict(True, "rank " + " and rank ".join(f"{r} was in {truth[r]}" for r in truth)
                       + ": two different collectives, so neither can complete -- the all_reduce must run on every rank.")
    if number == 2:
        from ddp_course.course.l12_debugging_lab.broken.world_size import WORLD_SIZE

        launched = {int(rec["env"]["WORLD_SIZE"]) for rec in recs.values()}
        truth = {"asked": WORLD_SIZE, "launched": launched.pop()}
        if not isinstance(answer, dict) or set(answer) != {"asked", "launched"}:
            return Verdict(False, "answer with a dict {'asked': N, 'launched': M}.")
        if int(answer["asked"]) != truth["asked"]:
            return Verdict(False, f"the code did not ask for {answer['asked']} ranks: follow the error file's "
                                  "traceback to the init_process_group line and read the value it passes.")
        if int(answer["launched"]) != truth["launched"]:
            return Verdict(False, f"torchrun did not start {answer['launched']} ranks: the store waited for the "
                                  "address of a rank that was never started -- the key's last number -- and "
                                  "every rank's record holds the WORLD_SIZE torchrun gave it.")
        return Verdict(True, f"the code asked for {truth['asked']} ranks, torchrun started {truth['launched']}: "
                             "ranks 0 and 1 waited for the addresses of the others until the timeout.")
    if number == 3:
        truth = {v: _overlap(recs[0][v]["indices"], recs[1][v]["indices"]) for v in ("broken", "fixed")}
        if not isinstance(answer, dict) or set(answer) != {"broken", "fixed"}:
            return Verdict(False, "answer with a dict {'broken': fraction, 'fixed': fraction}.")
        for v in ("broken", "fixed"):
            # the fractions are counts over a handful of windows: exact up to float rounding
            if abs(float(answer[v]) - truth[v]) > 1e-9:
                return Verdict(False, f"the {v} variant's overlap is not {answer[v]}: collect every window index "
                                      "rank 0 trained on, then count how many of rank 1's are among them.")
        return Verdict(True, f"rank 1 trained on windows rank 0 also saw: {truth['broken']:.0%} of them with the "
                             f"shared seed, {truth['fixed']:.0%} with the DistributedSampler.")
    raise ValueError(f"exercise {number}: there are diagnoses 1, 2 and 3.")
