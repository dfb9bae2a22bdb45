"""The debugging lab: one small torchrun program per classic DDP bug (lesson 12).

    from ddp_course.course.l12_debugging_lab import broken
    run = broken.launch("eval_loss", "runs/12/eval_loss")   # never hangs: timeouts, and a stall watch
    print(broken.symptom(run))          # what the learner sees in the terminal, condensed
    broken.records(run)                 # what each rank noted: rank<R>.json, as data
    broken.error_files(run)             # torchrun's error files, written through @record

The programs whose bug hangs run its collectives with a short process-group timeout (``--timeout_s``,
5 s), so a hang ends with an error a learner can read. The job as a whole is judged by the CPU its
processes use, as the graders judge a learner's job: it is stopped (:class:`LabStalled`) once none of
its processes has used the CPU for :data:`IDLE_S` seconds -- every rank waiting, which no slow machine
looks like -- and only a generous wall-clock ceiling (:data:`CEILING_S`, :class:`LabTooBusy`) is left
for a machine too busy to finish it at all. ``BUGS`` lists the programs with their bug, the symptom,
the tool that diagnoses it and the fix; three of them are the lesson's exercise (``Bug.exercise``),
listed by what they do (``Bug.does``) until the learner has found what is wrong. ``check_exercise``
grades the three diagnoses against what the programs did.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_course.check import NOT_COMPLETE, Verdict
from ddp_course.check.records import notebook_exercise
from ddp_course.launch import LaunchStalled, LaunchTimeout

PACKAGE = "ddp_course.course.l12_debugging_lab.broken"
PG_TIMEOUT_S = 5.0  # the process-group timeout of the bugs that hang: long enough for a tiny job, short to wait out
# A job none of whose processes has used the CPU for this long is waiting for something that will not
# come: stopped, with where each rank was. Four times the bugs' own timeout, so it never pre-empts them.
IDLE_S = 20.0
# The last resort, for a machine so busy that a job still working is not done after this long.
CEILING_S = 1800.0
LAB_JOB_VAR = "DDP_COURSE_LAB_JOB"  # every process of a two-node job carries its id (the stall watch finds them)


class LabStalled(LaunchStalled):
    """A lab job none of whose processes used the CPU for :data:`IDLE_S` seconds: every rank waiting."""


class LabTooBusy(LaunchTimeout):
    """A lab job still working at :data:`CEILING_S`: the machine is too busy, the job was not hanging."""


@dataclass(frozen=True)
class Bug:
    key: str
    title: str
    does: str  # what the program does, saying nothing of what is wrong with it
    symptom: str  # what the learner sees
    tool: str  # what diagnoses it
    fix: str
    hangs: bool = False  # ends only through the process-group timeout
    nodes: int = 1  # 2: launched as two torchrun agents (two "nodes")
    exercise: str = ""  # "A", "B", "C": the lesson's exercise asks the learner to find the bug

    @property
    def module(self) -> str:
        return f"{PACKAGE}.{self.key}"

    @property
    def listed(self) -> str:
        """How the lesson lists the program before its section: an exercise by what it does, the others by their bug."""
        if self.exercise:
            return f"{self.does} (exercise {self.exercise}: what is wrong is yours to find)"
        return self.title + (" (two nodes)" if self.nodes == 2 else "")


BUGS: dict[str, Bug] = {b.key: b for b in (
    Bug("eval_loss", "a collective called on rank 0 only",
        "an evaluation job: the mean loss over every rank's shard",
        "the job stops making progress; after the process-group timeout every rank fails with "
        "'Timed out waiting ... for recv operation' (or 'Connection closed by peer' once the other rank is gone)",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective is checked against the other ranks' first, and the error "
        "names the collective each rank is in; or each rank's traceback and stack",
        "every rank calls every collective: all_reduce on all ranks, then only rank 0 prints", hangs=True,
        exercise="A"),
    Bug("join_group", "a world size written into the code",
        "joins the process group and reports how many ranks joined",
        "the job never gets past init_process_group; after the timeout: DistStoreError 'wait timeout ... keys: "
        "/default_pg/0//cpu//0/2' -- the address of rank 2, which does not exist",
        "torchrun's error file (@record) with the failing rank's traceback, and the per-rank log of WORLD_SIZE",
        "let init_process_group read RANK and WORLD_SIZE from torchrun's environment", hangs=True, exercise="B"),
    Bug("no_set_epoch", "DistributedSampler without set_epoch",
        "reads three epochs through a DistributedSampler",
        "nothing fails; every epoch reads the same samples in the same order on each rank",
        "comparing per-rank data across epochs",
        "sampler.set_epoch(epoch) at the start of every epoch"),
    Bug("train_windows", "the same data seed on every rank",
        "a small DDP training on windows of the corpus, run twice",
        "nothing fails; the ranks' local losses are identical to the last digit",
        "comparing per-rank data: the windows each rank trained on, and each rank's local loss",
        "a DistributedSampler (shared seed, disjoint shards), or a data seed that includes the rank", exercise="C"),
    Bug("uneven_batches", "uneven batches without drop_last",
        "one epoch over hand-made shards, then a barrier",
        "the epoch never ends: one rank waits in a backward's all-reduce, the other in the next collective, "
        "until the timeout",
        "comparing per-rank batch counts (len(loader) on every rank), then the timeout message",
        "drop_last=True (DistributedSampler and DataLoader), or the loop inside Join([model])", hangs=True),
    Bug("no_sync_placement", "no_sync() in the wrong place",
        "gradient accumulation with no_sync(), three ways",
        "nothing fails; accumulation is no faster (forward outside no_sync), or the replicas drift apart "
        "(the last micro-step inside it)",
        "counting all-reduces with a communication hook, and comparing the replicas' weights",
        "forward and backward of every non-final micro-step inside no_sync(), the last one outside"),
    Bug("save_every_rank", "every rank saving the checkpoint",
        "a few DDP steps, then a checkpoint",
        "usually nothing visible: N processes write one file at once; which rank's save it holds is a race",
        "per-rank logs of who wrote, when and how much",
        "if rank == 0: save, then a barrier before anyone reads it"),
    Bug("device_global_rank", "the device chosen by the global RANK",
        "picks each rank's GPU, on two nodes",
        "works on one node; on the second node ranks ask for GPUs that do not exist (invalid device) "
        "or share one with another rank",
        "printing RANK, LOCAL_RANK and the device each rank picks, per node",
        "torch.cuda.set_device(LOCAL_RANK)", nodes=2),
)}


def launch(key: str, out_dir: str | Path, *, nproc: int = 2, env: dict[str, str] | None = None, **flags: Any):
    """Run bug program ``key`` (flags as ``--key=value``) into ``out_dir``, judged by its CPU use (:func:`run_job`).

    The programs that hang give up after their process-group timeout (``timeout_s``, default
    :data:`PG_TIMEOUT_S`); the stall watch and the ceiling only guard against the unforeseen.

    The folder is emptied first (no record of an earlier run can be mistaken for this one's). A job
    that fails is the point: it comes back as a failed ``Run`` (``check=False``) rather than raising.
    A two-node bug (``device_global_rank``) runs as two torchrun agents and returns the agents'
    command lines instead.
    """
    bug = BUGS[key]
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if bug.nodes == 2:
        script = ["-m", bug.module, f"--out_dir={out.resolve()}", *(f"--{k}={v}" for k, v in flags.items())]
        return _two_nodes(bug, out, nproc, script, env)
    return run_job(bug.module, out, nproc=nproc, env=env, **job_flags(key, **flags))


def run_job(module: str, out_dir: str | Path, *, nproc: int = 2, env: dict[str, str] | None = None, **flags: Any):
    """One of the lab's torchrun jobs (``ddp_course.launch.run``, a failed job returned, not raised),
    stopped only when none of its processes has used the CPU for :data:`IDLE_S` seconds
    (:class:`LabStalled`, with where each rank was) or, as a last resort, at :data:`CEILING_S`
    (:class:`LabTooBusy`). A busy machine makes a job slow, never idle: it is not stopped for that."""
    from ddp_course.launch import run

    try:
        return run(module, nproc=nproc, out_dir=out_dir, timeout=CEILING_S, idle_s=IDLE_S, check=False,
                   progress=False, echo="none", env=env, **flags)
    except LaunchStalled as exc:
        raise LabStalled(f"{_name(module)}: {exc}", exc.run) from None
    except LaunchTimeout as exc:
        raise LabTooBusy(_too_busy(module, exc.run.elapsed_s), exc.run) from None


def _name(module: str) -> str:
    return f"`{module.rsplit('.', 1)[-1]}`"


def _too_busy(module: str, elapsed_s: float) -> str:
    return (f"{_name(module)} was still working after {elapsed_s / 60:.0f} minutes, so it was stopped: this machine "
            "is too busy to run the lab now. Its processes kept using the CPU (a job that hangs stops using it, and "
            f"is stopped after {IDLE_S:.0f} s of that), so nothing is wrong with the job: close what else is running "
            "and run the cell again.")


class _CpuWatch:
    """The stall watch of a job that ``launch.run`` does not start (the two-node job): a thread that,
    once a second, sums the CPU time of the job's ranks (the processes whose environment holds
    :data:`LAB_JOB_VAR` and a ``RANK``) and stops them all when it has not grown for ``idle_s``
    seconds. Linux only (``/proc``); elsewhere it never fires."""

    BUSY = 0.05  # CPU seconds per second, the ranks together, above which the job is working

    def __init__(self, idle_s: float) -> None:
        self.job, self.idle_s, self.stalled = uuid.uuid4().hex, idle_s, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="lab-stall-watch")

    def __enter__(self) -> _CpuWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _processes(self, ranks_only: bool) -> list[int]:
        found, needle = [], f"{LAB_JOB_VAR}={self.job}".encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    env = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if needle in env and (not ranks_only or any(v.startswith(b"RANK=") for v in env)):
                    found.append(int(entry.name))
        return found

    @staticmethod
    def _cpu(pid: int) -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def _watch(self) -> None:
        if not Path("/proc").is_dir():
            return
        last, idle_since = None, None
        while not self._done.wait(1.0):
            pids = tuple(sorted(self._processes(ranks_only=True)))
            times = [self._cpu(p) for p in pids]
            now = time.monotonic()
            sample = (pids, sum(t for t in times if t is not None), now)
            if not pids or None in times or last is None or last[0] != pids or sample[1] - last[1] > self.BUSY * (now - last[2]):
                idle_since = None  # starting, ending, or working
            elif idle_since is None:
                idle_since = last[2]
            last = sample
            if idle_since is not None and now - idle_since >= self.idle_s:
                self.stalled = True
                for pid in self._processes(ranks_only=False):  # the agents too: they would restart nothing
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return


def _two_nodes(bug: Bug, out: Path, nproc: int, script: list[str], env: dict[str, str] | None) -> list[str]:
    """The two-node program as two torchrun agents (lesson 04's ``run_two_nodes``), under a stall watch of its own."""
    from ddp_course.course.l04_ddp.two_nodes import run_two_nodes

    start = time.monotonic()
    with _CpuWatch(IDLE_S) as watch:
        try:
            # both "nodes" see every GPU: the program only picks a device, it runs no collective on one
            return run_two_nodes(out, nproc_per_node=nproc, timeout=CEILING_S, script=script,
                                 env={**(env or {}), LAB_JOB_VAR: watch.job}, share_gpus=True)
        except RuntimeError as exc:
            if watch.stalled:
                raise LabStalled(f"{_name(bug.module)}: no process of the two-node job used the CPU for "
                                 f"{IDLE_S:.0f} s, so it was stopped (all of its processes).", None) from exc
            if time.monotonic() - start >= CEILING_S:
                raise LabTooBusy(_too_busy(bug.module, time.monotonic() - start), None) from exc
            raise


def job_flags(key: str, **flags: Any) -> dict[str, Any]:
    """The options :func:`launch` passes to program ``key``: ``flags``, and a hanging program's timeout."""
    return {"timeout_s": PG_TIMEOUT_S, **flags} if BUGS[key].hangs else dict(flags)


def launch_all(base_dir: str | Path, keys: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Start the programs ``keys`` (default: all of :data:`BUGS`) at the same time, each into
    ``base_dir/<key>``; returns {key: future} whose ``.result()`` is what :func:`launch` returns.

    Most of a hanging program's time is spent waiting for its timeout, and most of the others' in
    starting Python and torch: side by side they finish in far less time than one after another.
    Each job keeps its own timeouts and stall watch.
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
    """What the terminal shows, condensed: the program's own lines, each failing rank's last error line
    (from torchrun's error file when the rank failed before torch began prefixing its lines), and how the
    job ended. Tracebacks are left to :func:`error_files`."""
    lines = run.output.splitlines()
    own = [ln for ln in lines if ln.startswith("[") and not _TORCH_TRACE.match(ln) and not _NOISE.match(ln)]
    last_error: dict[str, str] = {}
    for ln in lines:
        m = _TORCH_TRACE.match(ln)
        if m and re.match(r"^\[rank\d+\]: [\w.]+(Error|Exception)\b", ln):  # torch.distributed.DistStoreError too
            last_error[m.group(1)] = ln
    if run.returncode != 0 and getattr(run, "out_dir", None):  # a rank that failed before torch prefixed its lines
        for e in error_files(run):
            if e["rank"] is not None and str(e["rank"]) not in last_error:
                last_error[str(e["rank"])] = f"[rank{e['rank']}]: {e['message']}"
    out = own[:max_lines]
    if len(own) > max_lines:
        out.append(f"... ({len(own) - max_lines} more lines)")
    out += [last_error[r] for r in sorted(last_error, key=int)]
    ended = "finished" if run.returncode == 0 else f"FAILED, exit code {run.returncode}"
    out.append(f"-> the job {ended} after {run.elapsed_s:.1f} s")
    return "\n".join(ln if len(ln) <= 240 else ln[:237] + "..." for ln in out)


# ------------------------------------------------------------------------------------------------
# the exercise: three diagnoses, graded against what the programs recorded

def _norm(name: Any) -> str:
    """A collective's name as compared: ``dist.all_reduce``, ``ALLREDUCE``, ``AllReduce``, ``all-reduce`` alike."""
    return re.sub(r"[^a-z]", "", str(name).lower().rsplit(".", 1)[-1])


def _rank_of(key: Any) -> int | None:
    found = re.search(r"\d+", str(key))
    return int(found.group()) if found else None


def _overlap(a: list[list[int]], b: list[list[int]]) -> float:
    sa = {i for batch in a for i in batch}
    sb = [i for batch in b for i in batch]
    return sum(i in sa for i in sb) / len(sb)


def _fraction(value: Any) -> float | None:
    """A fraction as given: 0.5, "50%", or 50 (a number above 1 can only be a percentage)."""
    try:
        text = str(value).strip()
        number = float(text.rstrip("%"))
    except ValueError:
        return None
    return number / 100 if text.endswith("%") or number > 1 else number


def _postmortem_folder(out_dir: Path) -> Path | None:
    """The folder where the ranks of the job run into ``out_dir`` left their exceptions and stacks."""
    folders = sorted(out_dir.glob("torchrun_logs/*/postmortem"), key=lambda p: p.stat().st_mtime)
    return folders[-1] if folders else None


def _waited_in(out_dir: Path) -> dict[int, str | None]:
    """{rank: the ``torch.distributed`` function it was in when its wait ended}, from what the ranks
    left (``ddp_course.postmortem``): the exception that ended a rank, else the stack it dumped when
    another rank timed out. The innermost frame of ``distributed_c10d.py`` names the collective."""
    from ddp_course import postmortem

    folder = _postmortem_folder(out_dir)
    seen: dict[int, str | None] = {}
    for state in postmortem.stacks(folder) + postmortem.errors(folder):  # an exception outranks a stack
        inside = [f.function for f in state.frames if Path(f.file).name == "distributed_c10d.py"]
        if inside or state.rank not in seen:
            seen[state.rank] = inside[-1] if inside else None
    return dict(sorted(seen.items()))


@notebook_exercise(lambda number, *args, **kwargs: f"answer_{'abc'[number - 1] if number in (1, 2, 3) else number}")
def check_exercise(number: int, answer: Any, out_dir: str | Path) -> Verdict:
    """Grade diagnosis ``number`` (1, 2 or 3) of lesson 12's exercise against the run in ``out_dir``.

    1. ``eval_loss``: ``{rank: collective}``, the collective each rank was stuck in (read from where
       each rank's wait ended: its exception, or its stack; the run may be the plain one or one under
       ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
    2. ``join_group``: ``{"asked": N, "launched": M}``, the world size the code asked for and the one
       torchrun started.
    3. ``train_windows``: ``{"broken": f, "fixed": g}``, the fraction of rank 1's training windows that
       rank 0 also trained on, in each variant.
    """
    if number in (1, 2, 3) and answer is None:
        name = "answer_" + "abc"[number - 1]
        return Verdict(False, f"{NOT_COMPLETE}: {name} is not set yet. Fill in the TODO in the exercise cell above "
                              f"and run that cell (it sets {name}), then re-run this cell.")
    out = Path(out_dir)
    recs = records(out)
    if not recs:
        return Verdict(False, f"no rank records in {out_dir}: run the program first (broken.launch(...)).")
    if number == 1:
        if not isinstance(answer, dict) or any(_rank_of(k) is None for k in answer):
            return Verdict(False, "answer with a dict {rank: collective}, e.g. {0: 'broadcast', 1: 'all_gather'}.")
        truth = _waited_in(out)
        if sorted(truth) != sorted(recs) or None in truth.values():
            return Verdict(False, f"the run in {out_dir} left no trace of where every rank waited (ranks with one: "
                                  f"{sorted(r for r, c in truth.items() if c)}): run the program again, then this cell.")
        got = {_rank_of(k): _norm(v) for k, v in answer.items()}
        missing = [r for r in truth if r not in got]
        if missing:
            return Verdict(False, f"name the collective of every rank: {missing} missing from answer_a.")
        wrong = [r for r in truth if got[r] != _norm(truth[r])]
        if wrong:
            r = wrong[0]
            given = next(v for k, v in answer.items() if _rank_of(k) == r)
            return Verdict(False, f"rank {r} was not in {given!r}. Read each rank's own error, not the other's: "
                                  "with TORCH_DISTRIBUTED_DEBUG=DETAIL it begins 'Rank N is running collective: "
                                  "CollectiveFingerPrint(... OpType=...)', where N is that rank; what it says of the "
                                  "other rank may be a step of the check itself.")
        return Verdict(True, "rank " + " and rank ".join(f"{r} was in {truth[r]}" for r in truth)
                       + ": two different collectives, so neither can complete -- the all_reduce must run on every rank.")
    if number == 2:
        from ddp_course.course.l12_debugging_lab.broken.join_group import WORLD_SIZE

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
            if _fraction(answer[v]) is None or abs(_fraction(answer[v]) - truth[v]) > 1e-9:
                return Verdict(False, f"the {v} variant's overlap is not {answer[v]}: collect every window index "
                                      "rank 0 trained on, then count how many of rank 1's are among them.")
        return Verdict(True, f"rank 1 trained on windows rank 0 also saw: {truth['broken']:.0%} of them with the "
                             f"shared seed, {truth['fixed']:.0%} with the DistributedSampler.")
    raise ValueError(f"exercise {number}: there are diagnoses 1, 2 and 3.")
