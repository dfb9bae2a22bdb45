"""Run a torchrun job from a notebook cell (or the command line) and get its results back.

    from ddp_course.launch import run
    r = run("ddp_course.train", nproc=2, strategy="ddp", max_steps=200)
    r.summary["tokens_per_s"], r.train_rows[-1]["loss"]

The job is a subprocess -- ``torchrun --standalone --nproc_per_node=N -m MODULE --key=value ...`` --
in a process group of its own: the notebook's kernel never joins a process group itself, so a cell
can always be re-run. Rank 0's lines stream into the cell and a progress bar follows the metrics
file. If a rank fails, :class:`LaunchError` carries that rank's traceback (from torchrun's error
file); on KeyboardInterrupt or timeout the whole job -- torchrun and every worker -- is stopped.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_course import parallel, postmortem
from ddp_course.config import ConfigError, from_dict, to_cli
from ddp_course.dist import DeviceError, choose_device, cpu_count
from ddp_course.metrics import read_jsonl, write_json
from ddp_course.paths import shorten

TRAIN_MODULE = "ddp_course.train"
_JOB_VAR = "DDP_COURSE_JOB"  # every process of a job carries this id, so none can be left behind
_RANK_PREFIX = re.compile(r"^\[rank ?(\d+)\]")
RECORD = "launch.json"  # how a job ended, written into its folder: Run.load reads it back


class LaunchError(RuntimeError):
    """A launched job failed. ``str(err)`` explains; ``.run`` holds the output and exit code."""

    def __init__(self, message: str, run: Run) -> None:
        super().__init__(message)
        self.run = run


class LaunchTimeout(LaunchError):
    """The job ran past its timeout and was stopped."""


class LaunchStalled(LaunchTimeout):
    """No rank of the job used the CPU for ``idle_s`` seconds (every rank waiting), so it was stopped."""


class LaunchRefused(LaunchError):
    """The job's program refused its input (an ``error:`` paragraph): bad input, not a crash."""


@dataclass
class Run:
    """A finished job: where it wrote, how it ended, and what it measured."""

    module: str
    nproc: int
    command: list[str]
    out_dir: Path | None
    returncode: int
    output: str
    elapsed_s: float
    overrides: dict[str, Any] = field(default_factory=dict)
    postmortem: Path | None = None  # where its ranks left their exceptions and stacks (torchrun jobs)

    def failure(self, focus: str | os.PathLike | None = None, keep: str | os.PathLike | None = None) -> str | None:
        """Which ranks failed and why, in the frames of ``focus`` (a script) or of the course's own
        files; None when no rank left an exception (``ddp_course.postmortem``). ``keep``: a folder to
        copy the full traceback into, when the job's own folder will not last."""
        focus_ = Path(focus) if focus else None
        return postmortem.describe_failure(postmortem.errors(self.postmortem), self.nproc, focus_, self.output,
                                           Path(keep) if keep else None, postmortem.stacks(self.postmortem, focus_))

    def hang(self, focus: str | os.PathLike | None = None) -> str | None:
        """Where each rank was when a job that ran past its timeout was stopped; None without stacks."""
        focus_ = Path(focus) if focus else None
        return postmortem.describe_hang(postmortem.stacks(self.postmortem, focus_), self.nproc, focus_)

    @property
    def metrics(self) -> list[dict]:
        return read_jsonl(self.out_dir / "metrics.jsonl") if self.out_dir else []

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.metrics if "loss" in r]

    @property
    def eval_rows(self) -> list[dict]:
        return [r for r in self.metrics if "val_loss" in r]

    def _json(self, name: str) -> dict | None:
        if self.out_dir is None or not (self.out_dir / name).exists():
            return None
        return json.loads((self.out_dir / name).read_text(encoding="utf-8"))

    @property
    def summary(self) -> dict | None:
        return self._json("summary.json")

    @property
    def config(self) -> dict | None:
        return self._json("config.json")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, e.g. ``run.series("loss")``."""
        rows = [r for r in self.metrics if key in r]
        return [r["step"] for r in rows], [r[key] for r in rows]

    @classmethod
    def load(cls, out_dir: str | os.PathLike) -> Run:
        """The finished job recorded in ``out_dir/launch.json`` (written by :func:`run` when it ends)."""
        rec = json.loads((Path(out_dir) / RECORD).read_text(encoding="utf-8"))
        return cls(rec["module"], rec["nproc"], rec["command"], Path(out_dir).resolve(), rec["returncode"],
                   rec["output"], rec["elapsed_s"], rec["overrides"],
                   Path(rec["postmortem"]) if rec.get("postmortem") else None)

    def __repr__(self) -> str:
        s = self.summary or {}
        extra = f", final_loss={s['final_loss']:.4f}" if "final_loss" in s else ""
        return f"Run({self.module}, nproc={self.nproc}, returncode={self.returncode}, out_dir={self.out_dir}{extra})"


def is_script(module: str) -> bool:
    """A path to a .py file (run as a script) rather than a module name (run with -m)."""
    return module.endswith(".py") or os.sep in module


def torchrun_command(module: str, nproc: int, args: list[str], log_dir: Path | None = None,
                     extra: list[str] | None = None) -> list[str]:
    """The torchrun command line for a single-node job (``--standalone`` picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if log_dir is not None:
        cmd.append(f"--log-dir={log_dir}")
    return [*cmd, *(extra or []), *_target(module), *args]


def _target(module: str) -> list[str]:
    """What follows ``python`` (or torchrun's options): the script's absolute path, or ``-m module``."""
    return [str(Path(module).resolve())] if is_script(module) else ["-m", module]


def _job_processes(job_id: str, ranks_only: bool = False) -> list[int]:
    """PIDs of live processes whose environment carries this job's id (Linux /proc; psutil elsewhere);
    with ``ranks_only``, only its ranks (torchrun's workers, whose environment names their rank)."""
    pids = []
    proc = Path("/proc")
    rank_vars = ("RANK", postmortem.RANK_VAR)
    if proc.is_dir():
        needle, ranks = f"{_JOB_VAR}={job_id}".encode(), tuple(f"{v}=".encode() for v in rank_vars)
        for entry in proc.iterdir():
            if entry.name.isdigit():
                try:
                    env = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if needle in env and (not ranks_only or any(v.startswith(ranks) for v in env)):
                    pids.append(int(entry.name))
        return pids
    try:
        import psutil
    except ImportError:
        return pids
    for p in psutil.process_iter(["pid"]):
        try:
            env = p.environ()
            if env.get(_JOB_VAR) == job_id and (not ranks_only or any(v in env for v in rank_vars)):
                pids.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return pids


def stop_job(proc: subprocess.Popen, job_id: str, grace_s: float = 8.0) -> None:
    """Stop torchrun (SIGTERM: it stops its workers), then anything of the job still alive.

    torchrun starts each worker in a session of its own, so killing torchrun's process group alone
    could orphan them; every process of the job carries the job id, which finds them all.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for sig, wait_s in ((signal.SIGTERM, grace_s / 2), (signal.SIGKILL, 3.0)):
        left = _job_processes(job_id)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _job_processes(job_id):
            time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def error_files(log_dir: str | os.PathLike | None) -> list[dict]:
    """The ``error.json`` files torchrun's workers wrote (via ``@record``) anywhere below ``log_dir``.

    One dict per failed worker: ``path``, ``rank_dir`` (the folder torchrun named after the rank),
    ``rank`` (int, or None when that folder is not a number), ``message``, ``traceback`` and
    ``timestamp``. The cause comes first: failures that are not about a lost peer, then the earliest.
    """
    if log_dir is None or not Path(log_dir).exists():
        return []
    found = []
    for path in sorted(Path(log_dir).glob("**/error.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        msg = data.get("message", {})
        if isinstance(msg, str):
            msg = {"message": msg, "extraInfo": {}}
        extra = msg.get("extraInfo", {}) or {}
        rank_dir = path.parent.name
        found.append({"path": str(path), "rank_dir": rank_dir, "rank": int(rank_dir) if rank_dir.isdigit() else None,
                      "message": msg.get("message", ""),
                      "traceback": extra.get("py_callstack", ""), "timestamp": int(extra.get("timestamp", 0) or 0)})
    # A rank that lost its peer ("connection closed", a timeout) is a consequence, not the cause:
    # put the failures that are not about a lost peer first, then the earliest.
    secondary = ("Connection closed by peer", "Connection reset", "Broken pipe", "timed out", "Timeout",
                 "NCCL communicator was aborted", "failed to recv", "failed to send")
    return sorted(found, key=lambda e: (any(s in e["message"] for s in secondary), e["timestamp"]))


def _explain_failure(run: Run, log_dir: Path | None) -> str:
    head = f"The job `{run.module}` with {run.nproc} process(es) failed (exit code {run.returncode})."
    lines = run.output.splitlines()
    # A course program refusing bad input prints one "error: ..." paragraph: that is the message.
    mine = [ln[len("error: "):] for ln in lines if ln.startswith("error: ")]
    if mine:
        return f"{head}\n{mine[0]}"
    failure = run.failure(run.module if is_script(run.module) else None)
    if failure:
        return f"{head}\n{failure}"
    errors = error_files(log_dir)
    tail = "\n".join(postmortem.without_launcher(run.output).splitlines()[-25:])
    if errors:
        first = errors[0]
        who = f"rank {first['rank_dir']}" if first["rank_dir"].isdigit() else "a worker"
        return (f"{head} The first failure was on {who}: {first['message']}\n\n"
                f"Traceback from that rank:\n{first['traceback'].rstrip()}\n\n"
                f"Last lines of the job's output:\n{tail}")
    return f"{head}\n\nLast lines of the job's output:\n{tail}"


def _validate_train(overrides: dict[str, Any], nproc: int) -> None:
    """Check a training config in the kernel, before any process starts (instant, clear errors)."""
    from ddp_course.data import CorpusError, check_corpus

    cfg = from_dict(overrides)
    cfg.resolve_batch(nproc)
    try:
        choose_device(cfg.device, nproc)
        check_corpus(cfg.corpus)
    except (DeviceError, CorpusError) as exc:  # bad input: a ConfigError, told before any process starts
        raise ConfigError(str(exc)) from None
    why = parallel.plan_for(cfg).refusal(distributed=True, world_size=nproc)  # torchrun starts every job of N > 1
    if why and nproc > 1:
        raise ConfigError(why)


def _check_arguments(nproc: int, echo: str) -> None:
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1 (got {nproc}).")
    if echo not in ("rank0", "all", "none"):
        raise ValueError(f"echo must be 'rank0', 'all' or 'none' (got {echo!r}).")


def _out_path(module: str, nproc: int, out_dir: str | os.PathLike | None, overrides: dict[str, Any]) -> Path | None:
    """The job's folder, absolute; a training run without one gets ``runs/<strategy>-<N>p-<time>-<id>``."""
    if out_dir is None and module == TRAIN_MODULE:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out_dir = Path("runs") / f"{overrides.get('strategy', 'single')}-{nproc}p-{stamp}-{uuid.uuid4().hex[:4]}"
    return Path(out_dir).resolve() if out_dir is not None else None


@dataclass
class _Job:
    """One launch: what runs, where it writes, and the id that every one of its processes carries."""

    module: str
    nproc: int
    command: list[str]
    out_path: Path | None
    overrides: dict[str, Any]
    job_id: str
    log_dir: Path | None  # torchrun's --log-dir (its workers' error.json files), None without torchrun

    @property
    def postmortem(self) -> Path | None:
        """Where the ranks leave their exceptions and, when asked, their stacks (torchrun jobs)."""
        return self.log_dir / "postmortem" if self.log_dir is not None else None

    def result(self, returncode: int | None, output: list[str], elapsed_s: float) -> Run:
        return Run(self.module, self.nproc, self.command, self.out_path, returncode, "\n".join(output), elapsed_s,
                   self.overrides, self.postmortem)


def _job(module: str, nproc: int, overrides: dict[str, Any], out_path: Path | None, use_torchrun: bool,
         torchrun_args: list[str] | None) -> _Job:
    """The command line: torchrun (logging into ``<out_dir>/torchrun_logs/<id>``), or one plain ``python``."""
    args, job_id = to_cli(overrides), uuid.uuid4().hex
    if use_torchrun:
        base = out_path if out_path is not None else Path.cwd() / "runs"
        log_dir = base / "torchrun_logs" / job_id[:8]
        cmd = torchrun_command(module, nproc, args, log_dir, torchrun_args)
        return _Job(module, nproc, cmd, out_path, overrides, job_id, log_dir)
    if nproc != 1:
        raise ValueError("use_torchrun=False runs exactly one process: pass nproc=1.")
    return _Job(module, nproc, [sys.executable, *_target(module), *args], out_path, overrides, job_id, None)


def _environment(nproc: int, job_id: str, torchrun_args: list[str] | None, env: dict[str, str] | None
                 ) -> dict[str, str]:
    """This process's environment, unbuffered, the cores shared among the ``nproc`` processes, the job id."""
    threads = str(max(1, cpu_count() // nproc))
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads, _JOB_VAR: job_id}
    if any(a.startswith("--max-restarts") or a.startswith("--max_restarts") for a in torchrun_args or []):
        # Restarted workers would otherwise reuse torchrun's rendezvous store, which still holds the
        # first attempt's addresses, and fail to connect (lesson 08 shows it).
        full_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    full_env.update(env or {})
    return full_env


def _clear_outputs(out_path: Path, resume: bool) -> None:
    """Create the job's folder; remove the last job's record and, unless resuming, its numbers."""
    out_path.mkdir(parents=True, exist_ok=True)
    (out_path / RECORD).unlink(missing_ok=True)
    if not resume:  # a re-run must not show the last run's numbers
        for stale in ("metrics.jsonl", "summary.json"):
            (out_path / stale).unlink(missing_ok=True)


class _Progress:
    """A tqdm bar that follows ``metrics.jsonl``: steps done and the last logged loss."""

    def __init__(self, total: int, desc: str, metrics_path: Path) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="step", leave=True)
        self.metrics_path = metrics_path
        self.seen_step = 0

    def update(self) -> None:
        rows = [r for r in read_jsonl(self.metrics_path) if "loss" in r]
        if rows and rows[-1]["step"] > self.seen_step:
            self.bar.update(rows[-1]["step"] - self.seen_step)
            self.seen_step = rows[-1]["step"]
            self.bar.set_postfix(loss=f"{rows[-1]['loss']:.3f}", refresh=False)


def _echo(line: str, echo: str, progress: _Progress | None) -> None:
    """Print one line of the job's output as ``echo`` asks (above the progress bar when there is one)."""
    if echo == "none":
        return
    m = _RANK_PREFIX.match(line)
    if echo == "rank0" and m and m.group(1) != "0":
        return  # another rank's line ("[rank 1] ..." from log(), "[rank1]: ..." from torch)
    if echo == "rank0" and progress is not None and line.startswith("step "):
        return  # the bar shows progress and loss; every logged step is in run.metrics
    line = shorten(line)  # a traceback names files by the machine's paths: print them as the course does
    if progress is not None:
        progress.bar.write(line)
    else:
        print(line, flush=True)


def _start(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, queue.Queue[str | None]]:
    """Start the job in a session of its own; a thread moves its output lines into a queue (None: the end)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, bufsize=1, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _drain(lines: queue.Queue[str | None], output: list[str], echo: str, progress: _Progress | None) -> bool:
    """Move the lines waiting in the queue (up to 0.2 s for the first) to ``output``; True at the end of output."""
    try:
        item = lines.get(timeout=0.2)
        while item is not None:
            output.append(item)
            _echo(item, echo, progress)
            item = lines.get_nowait()
        return True
    except queue.Empty:
        return False


def _cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used, all its threads together (Linux ``/proc/<pid>/stat``); None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _Stall:
    """Whether every rank of a job has stopped using the CPU: all of them waiting (a collective one
    rank never reaches, a sleep), where a slow machine would still be computing. Independent of the
    machine's speed, so it can be short. Linux only (``/proc``); elsewhere it never fires."""

    SAMPLE_S = 1.0
    BUSY = 0.05  # CPU seconds per second, the ranks together: above it the job is working (waiting: ~0.01)
    SAY_AFTER_S = 10.0

    def __init__(self, job_id: str, limit_s: float) -> None:
        self.job_id, self.limit_s = job_id, limit_s
        self.enabled = Path("/proc").is_dir()
        self.pids: tuple[int, ...] = ()
        self.cpu = 0.0
        self.sampled = self.idle_since = None
        self.said = False

    def stalled(self, now: float) -> bool:
        """Sample (once a second); True when the ranks have been idle for ``limit_s`` seconds."""
        if not self.enabled or (self.sampled is not None and now - self.sampled < self.SAMPLE_S):
            return False
        pids = tuple(sorted(_job_processes(self.job_id, ranks_only=True)))
        times = [_cpu_seconds(p) for p in pids]
        cpu = sum(t for t in times if t is not None)
        if not pids or pids != self.pids or None in times or self.sampled is None:
            self.idle_since = None  # starting, restarting or ending: nothing to judge yet
        elif cpu - self.cpu > self.BUSY * (now - self.sampled):
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = self.sampled
        self.pids, self.cpu, self.sampled = pids, cpu, now
        idle = 0.0 if self.idle_since is None else now - self.idle_since
        if idle >= self.SAY_AFTER_S and not self.said:
            self.said = True
            print(f"Waiting: no process of the job has used the CPU for {idle:.0f} s (a rank waiting for one that "
                  f"never comes looks like this). It is stopped after {self.limit_s:.0f} s of that, with where "
                  "each rank was.", flush=True)
        return idle >= self.limit_s


def _timed_out(job: _Job, proc: subprocess.Popen, lines: queue.Queue[str | None], output: list[str], timeout: float,
               start: float, stalled: bool = False) -> LaunchTimeout:
    """Ask every rank where it is (a stack dump), stop the whole job; the error that says it ran past
    ``timeout`` seconds, or (``stalled``) that its ranks had been idle that long, with where each rank
    was (or, without stacks, the last lines of output)."""
    if job.postmortem is not None:
        postmortem.ask_for_stacks(_job_processes(job.job_id, ranks_only=True), job.postmortem)
    stop_job(proc, job.job_id)
    _drain(lines, output, "none", None)
    run_ = job.result(proc.returncode, output, time.monotonic() - start)
    where = run_.hang()
    detail = (f"Where each rank was:\n{where}" if where else
              "The last lines of output:\n" + "\n".join(postmortem.without_launcher("\n".join(output)).splitlines()[-20:]))
    if stalled:
        return LaunchStalled(f"No process of the job `{job.module}` ({job.nproc} process(es)) used the CPU for "
                             f"{timeout:.0f} s, so it was stopped (all of its processes). A collective waiting "
                             f"on a rank that never arrives looks like this. {detail}", run_)
    return LaunchTimeout(f"The job `{job.module}` with {job.nproc} process(es) ran past its timeout of "
                         f"{timeout:.0f}s and was stopped (all of its processes). A collective waiting "
                         f"on a rank that never arrives looks like this. {detail}", run_)


def _stream(job: _Job, proc: subprocess.Popen, lines: queue.Queue[str | None], *, echo: str,
            progress: _Progress | None, timeout: float | None, start: float, idle_s: float | None) -> list[str]:
    """Follow the job to its end: echo its lines, move the bar; on timeout, a stall or Ctrl-C stop all of it."""
    output: list[str] = []
    stall = _Stall(job.job_id, idle_s) if idle_s is not None else None
    try:
        finished = False
        while not finished:
            finished = _drain(lines, output, echo, progress)
            if progress is not None:
                progress.update()
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise _timed_out(job, proc, lines, output, timeout, start)
            if stall is not None and not finished and stall.stalled(now):
                raise _timed_out(job, proc, lines, output, stall.limit_s, start, stalled=True)
        proc.wait()
    except KeyboardInterrupt:
        stop_job(proc, job.job_id)
        print(f"Interrupted: stopped the job `{job.module}` and all {job.nproc} of its processes.", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            stop_job(proc, job.job_id)
        if progress is not None:
            progress.bar.close()
    return output


def _write_record(run_: Run, env: dict[str, str] | None) -> None:
    """``launch.json`` in the job's folder: how it ended (:meth:`Run.load` reads it back)."""
    assert run_.out_dir is not None
    write_json(run_.out_dir / RECORD, {"module": run_.module, "nproc": run_.nproc, "command": run_.command,
                                       "overrides": run_.overrides, "env": env or {}, "returncode": run_.returncode,
                                       "output": run_.output, "elapsed_s": run_.elapsed_s,
                                       "postmortem": str(run_.postmortem) if run_.postmortem else None})


def run(module: str = TRAIN_MODULE, nproc: int = 2, *, out_dir: str | os.PathLike | None = None,
        timeout: float | None = None, progress: bool = True, echo: str = "rank0", use_torchrun: bool | None = None,
        env: dict[str, str] | None = None, torchrun_args: list[str] | None = None, check: bool = True,
        idle_s: float | None = None, **overrides: Any) -> Run:
    """Launch ``module`` on ``nproc`` processes with ``--key=value`` flags from ``overrides``.

    - ``out_dir``: the run folder (``ddp_course.train`` writes its metrics there); default
      ``runs/<module>-<time>``.
    - ``timeout``: seconds before the job is stopped and :class:`LaunchTimeout` raised.
    - ``idle_s``: stop the job (:class:`LaunchStalled`) when none of its processes has used the CPU
      for that many seconds: every rank is waiting, whatever the machine's speed (graders use it).
    - ``echo``: "rank0" (rank 0's lines and unprefixed output; per-step lines are left to the
      progress bar when there is one), "all", or "none".
    - ``use_torchrun``: default True when nproc > 1 or the strategy needs a process group;
      a one-process strategy (single, dp) starts plain ``python -m`` (faster).
    - ``check``: raise :class:`LaunchError` when the job fails (else return the failed Run).
    """
    _check_arguments(nproc, echo)
    is_train = module == TRAIN_MODULE
    out_path = _out_path(module, nproc, out_dir, overrides)
    if out_path is not None:
        overrides = {**overrides, "out_dir": str(out_path)}
    if is_train:
        _validate_train(overrides, nproc)
    if use_torchrun is None:
        use_torchrun = nproc > 1 or parallel.Strategy(str(overrides.get("strategy", "single"))).needs_process_group
    job = _job(module, nproc, overrides, out_path, use_torchrun, torchrun_args)
    full_env = _environment(nproc, job.job_id, torchrun_args, env)
    if job.postmortem is not None:
        full_env = postmortem.environment(job.postmortem, full_env, without_torchrun=False)
    if out_path is not None:
        _clear_outputs(out_path, bool(overrides.get("resume")))

    total = int(overrides.get("max_steps", 0)) if is_train else 0
    bar = None
    if progress and out_path is not None and total > 0:
        bar = _Progress(total, f"{overrides.get('strategy', module)} x{nproc}", out_path / "metrics.jsonl")
    start = time.monotonic()
    proc, lines = _start(job.command, full_env)
    output = _stream(job, proc, lines, echo=echo, progress=bar, timeout=timeout, start=start, idle_s=idle_s)

    run_ = job.result(proc.returncode, output, time.monotonic() - start)
    if out_path is not None:
        _write_record(run_, env)
    if check and proc.returncode != 0:
        refused = any(line.startswith("error: ") for line in output)
        raise (LaunchRefused if refused else LaunchError)(_explain_failure(run_, job.log_dir), run_)
    return run_
