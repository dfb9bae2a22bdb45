"""What each rank of a job was doing when it failed or hung, told in the learner's terms.

A job launched by :mod:`ddp_course.launch` carries, in every rank, the small start-up hook in
``ddp_course/_postmortem/sitecustomize.py`` (:func:`environment`). It leaves in the job's postmortem
folder (one ``attempt<N>`` folder per torchrun restart), per rank, the exception that ended the rank
(``rank<R>.error.json``, its text in ``rank<R>.traceback.txt``), where its threads were if it died
below Python (``rank<R>.fatal``) and, on request, a stack dump of all its threads (``rank<R>.stack``,
written by ``faulthandler`` on SIGUSR1: :func:`ask_for_stacks`).

From those files :func:`describe_failure` and :func:`describe_hang` write what a learner needs: which
ranks failed and with what exception, or where each rank was waiting, as ``File "path", line N``
frames of the learner's own file (or of any file outside the installed packages), each with its
source line -- the way Python shows a traceback, without the launcher's and torch's frames. The full
traceback stays in the folder. :func:`syntax_error` finds a syntax error before any process starts,
and :func:`without_launcher` removes torchrun's report from a job's output.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import signal
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_course.paths import show

FOLDER_VAR = "DDP_COURSE_POSTMORTEM"
RANK_VAR = "DDP_COURSE_POSTMORTEM_RANK"  # a job without torchrun: its one process is rank 0
SITE = Path(__file__).resolve().with_name("_postmortem")
# Errors a rank gets because another rank died: a consequence, not the cause.
LOST_PEER = ("Connection closed by peer", "Connection reset", "Broken pipe", "failed to recv", "failed to send",
             "NCCL communicator was aborted", "Socket Timeout", "ProcessGroupGloo::", "Connection refused")
# A collective that waited past the process group's timeout (gloo, NCCL's watchdog, the store)
TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")
# the C++ source location gloo and c10d put before their messages: "[/path/to/pair.cc:534] "
_SOURCE_TAG = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")
# torch.distributed functions a rank can wait in; the stack names the one it is in.
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather",
               "scatter", "send", "recv", "isend", "irecv", "wait", "monitored_barrier", "broadcast_object_list",
               "init_process_group", "destroy_process_group", "new_group")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    source: str = ""
    col: int | None = None  # the failing expression's columns in the line (Python 3.11+), for the carets
    end_col: int | None = None

    def shown(self, carets: bool = False) -> str:
        """Two lines, as Python prints a frame of a traceback (three with ``carets`` under the failing
        expression, when its columns are known)."""
        linecache.checkcache(self.file)  # the learner may have edited the file since it was last read
        raw = linecache.getline(self.file, self.line).rstrip("\n")
        source = self.source or raw.strip()
        text = f'  File "{show(self.file)}", line {self.line}, in {self.function}' + (f"\n    {source}" if source else "")
        if carets and source and self.col is not None and self.end_col and raw.strip() == source:
            indent = len(raw) - len(raw.lstrip())
            width = self.end_col - self.col
            if 0 < width < len(source) and self.col >= indent:
                text += "\n    " + " " * (self.col - indent) + "^" * width
        return text


@dataclass(frozen=True)
class RankState:
    """One rank's exception (``kind`` "error") or its stack when asked (``kind`` "stack")."""

    rank: int
    kind: str
    frames: tuple[Frame, ...]  # outermost first, as in a traceback
    error: str = ""  # "NameError: name 'nn' is not defined"
    text: str = ""  # the whole traceback as Python printed it
    path: str = ""  # the file it was read from

    @property
    def lost_peer(self) -> bool:
        return any(s in self.error for s in LOST_PEER)


def environment(folder: Path, base: dict[str, str], *, without_torchrun: bool) -> dict[str, str]:
    """``base`` with the start-up hook on ``PYTHONPATH`` and the folder its ranks write to."""
    path = os.pathsep.join(p for p in (str(SITE), base.get("PYTHONPATH", "")) if p)
    env = {**base, "PYTHONPATH": path, FOLDER_VAR: str(folder)}
    if without_torchrun:
        env[RANK_VAR] = "0"
    return env


def last_attempt(folder: Path | None) -> Path | None:
    """The folder of the job's last attempt (``attempt<N>``, N counting torchrun's restarts)."""
    if folder is None or not Path(folder).is_dir():
        return None
    attempts = [p for p in Path(folder).glob("attempt*") if p.name[len("attempt"):].isdigit()]
    return max(attempts, key=lambda p: int(p.name[len("attempt"):])) if attempts else None


def errors(folder: Path | None) -> list[RankState]:
    """The exceptions that ended ranks of the job, by rank; a rank that died of a fatal signal
    instead (kind "fatal") with where it was."""
    folder = last_attempt(folder)
    found = _fatal(folder)
    for path in sorted(Path(folder).glob("rank*.error.json")) if folder else []:
        try:
            e = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        frames = tuple(Frame(f["file"], f["line"], f["function"], f.get("source", ""), f.get("col"),
                             f.get("end_col") if f.get("end_line") in (None, f["line"]) else None)
                       for f in e["frames"])
        syn = e.get("syntax")
        if syn and syn.get("file"):  # where the syntax error is, not where it was compiled from
            frames += (Frame(syn["file"], syn["line"] or 0, "<module>", (syn.get("text") or "").strip()),)
        text_file = path.with_name(path.name.replace(".error.json", ".traceback.txt"))
        found.append(RankState(e["rank"], "error", frames, e["error"], e.get("text", ""),
                               str(text_file if text_file.exists() else path)))
    return sorted(found, key=lambda s: s.rank)


def _fatal(folder: Path | None) -> list[RankState]:
    found = []
    for path in sorted(Path(folder).glob("rank*.fatal")) if folder else []:
        text = path.read_text(encoding="utf-8", errors="replace")
        threads = _threads(text)
        if not threads or path.with_name(path.name.replace(".fatal", ".error.json")).exists():
            continue
        head = next((ln for ln in text.splitlines() if ln.startswith("Fatal Python error")), "Fatal Python error")
        found.append(RankState(_rank_of(path), "fatal", _main_thread(threads), head.strip(), text, str(path)))
    return found


def _rank_of(path: Path) -> int:
    """R of a file ``rank<R>.<kind>`` the start-up hook wrote."""
    return int(path.name[len("rank"):].split(".")[0])


def _main_thread(threads: list[list[Frame]], focus: Path | None = None) -> tuple[Frame, ...]:
    """The thread that runs the program's ``<module>`` (one with a frame in ``focus``, or without a focus
    in the course's or a script's files, first), else the first."""
    main = [t for t in threads if t[0].function == "<module>"] or threads
    inside = [t for t in main if any(_is_focus(f, focus) for f in t)]
    return tuple((inside or main)[0])


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FAULT_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$')


def _threads(text: str) -> list[list[Frame]]:
    """A faulthandler dump: each thread's frames, outermost first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (m := _FAULT_FRAME.match(line)) and threads:
            threads[-1].insert(0, Frame(m.group(1), int(m.group(2)), m.group(3)))
    return [t for t in threads if t]


def stacks(folder: Path | None, focus: Path | None = None) -> list[RankState]:
    """Where each rank was when asked: its main thread (the one that runs the program's ``<module>``,
    preferring one inside ``focus``), by rank."""
    found = []
    folder = last_attempt(folder)
    for path in sorted(Path(folder).glob("rank*.stack")) if folder else []:
        threads = _threads(path.read_text(encoding="utf-8", errors="replace"))
        if threads:
            found.append(RankState(_rank_of(path), "stack", _main_thread(threads, focus), path=str(path)))
    return sorted(found, key=lambda s: s.rank)


def ask_for_stacks(pids: Iterable[int], folder: Path, wait_s: float = 3.0) -> None:
    """Send SIGUSR1 to ``pids`` (ranks carrying the start-up hook) and wait until each has written its
    stack (or ``wait_s`` passed)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    asked = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
            asked.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        written = [p for p in Path(folder).glob("attempt*/rank*.stack") if p.stat().st_size > 0]
        if len(written) >= len(asked):
            time.sleep(0.2)  # the last lines of a dump
            return
        time.sleep(0.1)


_PACKAGES = tuple({str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"],
                                                    sysconfig.get_paths()["platlib"])})


def _is_focus(frame: Frame, focus: Path | None) -> bool:
    """A frame of the learner's file (``focus``), or with no focus of a file outside the installed
    packages and the standard library (the course's own modules, a script)."""
    if frame.file.startswith("<"):
        return False
    path = Path(frame.file)
    if focus is not None:
        try:
            return path.resolve() == focus.resolve()
        except OSError:
            return False
    resolved = str(path.resolve())
    return not resolved.startswith(_PACKAGES) and "site-packages" not in resolved


def _own(state: RankState, focus: Path | None) -> tuple[list[Frame], Frame | None]:
    """The state's frames in the learner's file, and the innermost frame beyond them (where torch or
    the library was when it raised or waited), if any."""
    mine = [i for i, f in enumerate(state.frames) if _is_focus(f, focus)]
    if not mine:
        return [], None
    rest = state.frames[mine[-1] + 1:]
    named = [f for f in rest if f.function in COLLECTIVES]
    return [state.frames[i] for i in mine], named[0] if named else rest[-1] if rest else None


def _module_of(frame: Frame) -> str:
    """``torch.distributed.distributed_c10d`` for a frame in site-packages/torch/distributed/distributed_c10d.py."""
    parts = Path(frame.file).with_suffix("").parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return ".".join(parts[parts.index(anchor) + 1:])
    return Path(frame.file).stem


def _where(own: list[Frame], beyond: Frame | None, verb: str) -> str:
    lines = [f.shown(carets=i == len(own) - 1 and beyond is None) for i, f in enumerate(own)]
    if beyond is not None:
        lines.append(f"  ({verb} inside {_module_of(beyond)}.{beyond.function})")
    return "\n".join(lines)


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _library_message(output: str) -> str:
    """What a C++ library said as it aborted (``what(): ...``), first line, from the job's output."""
    said = [ln.split("what():", 1)[1].strip() for ln in output.splitlines() if "what():" in ln]
    return said[0][:400] if said else ""


def describe_failure(states: Sequence[RankState], nproc: int, focus: Path | None = None,
                     output: str = "", keep: Path | None = None, waiting: Sequence[RankState] = ()) -> str | None:
    """Which ranks failed, with their exceptions and frames in ``focus`` (None when no rank left one).

    Ranks whose error only says that a peer went away come last, as consequences; ranks with no
    error at all were stopped by torchrun, and where they were is shown when ``waiting`` holds their
    stacks (a rank whose collective timed out asks for them before it ends: the start-up hook). A
    rank that aborted below Python shows where it was and what the library said (from ``output``).
    ``keep``: a folder to copy the full traceback into (a job's own folder may be deleted after it),
    which the text then names."""
    if not states:
        return None
    causes = [s for s in states if not s.lost_peer] or list(states)
    groups: dict[tuple, list[int]] = {}
    for s in causes:
        own, beyond = _own(s, focus)
        error = _SOURCE_TAG.sub("", s.error)
        if s.kind == "fatal":
            said = _library_message(output)
            error = f"no Python exception: the process aborted ({s.error})" + (f", the library saying: {said}"
                                                                                 if said else "")
        groups.setdefault((error, tuple(own), beyond), []).append(s.rank)
    parts = []
    for (error, own, beyond), ranks in groups.items():
        where = _where(list(own), beyond, "raised")
        if not own and focus is not None:
            where = f"  (in no line of {show(focus)}: the full traceback is in the file below)"
        verb = "ended with" if error.startswith("no Python exception") else "raised"
        parts.append(f"{_ranks(ranks)} {verb} {error}\n{where}")
    failed = {s.rank for s in states}
    lost = sorted(s.rank for s in states if s not in causes)
    if lost:
        parts.append(f"{_ranks(lost)} then lost {'its' if len(lost) == 1 else 'their'} peer (a consequence, "
                     "not a second mistake)")
        timed_out = any(TIMED_OUT.search(s.error) for s in causes)
        for s in (s for s in states if s not in causes and timed_out):  # a wait that timed out: where each peer was
            own, beyond = _own(s, focus)
            if own:
                parts.append(f"rank {s.rank} was waiting here when rank {causes[0].rank} timed out\n"
                             f"{_where(own, beyond, 'waiting')}")
    stopped = [r for r in range(nproc) if r not in failed]
    seen = {s.rank: s for s in waiting if s.rank in stopped}
    for rank in sorted(seen):
        own, beyond = _own(seen[rank], focus)
        if not own:
            own = [f for f in seen[rank].frames if _is_focus(f, None)][-1:]
        parts.append(f"rank {rank} was here when {_ranks(sorted(failed))} failed (torchrun then stopped it)\n"
                     f"{_where(own, beyond, 'waiting')}")
    if (seen or lost) and any(TIMED_OUT.search(s.error) for s in causes):
        parts.append("A collective, a send or a receive times out when its peer never reaches the matching call: "
                     "compare where each rank was.")
    stopped = [r for r in stopped if r not in seen]
    if stopped:
        parts.append(f"{_ranks(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped by torchrun when "
                     f"{'it' if len(failed) == 1 else 'they'} failed")
    parts.append(f"Full traceback: {show(_kept(Path(causes[0].path), keep, causes[0].rank))}")
    return "\n".join(parts)


def _kept(path: Path, keep: Path | None, rank: int) -> Path:
    """``path``, or its copy in ``keep`` (``last_failure.rank<R>.txt``) when a folder is given and writable."""
    if keep is None:
        return path
    try:
        keep.mkdir(parents=True, exist_ok=True)
        copy = keep / f"last_failure.rank{rank}{'.fatal' if path.suffix == '.fatal' else ''}.txt"
        copy.write_bytes(path.read_bytes())
        return copy
    except OSError:
        return path


def describe_hang(states: Sequence[RankState], nproc: int, focus: Path | None = None) -> str | None:
    """Where each rank was when the job was stopped: its frames in ``focus``, and the collective (or
    other library function) it was waiting in."""
    if not states:
        return None
    lines = []
    for s in states:
        own, beyond = _own(s, focus)
        if not own:
            own = [f for f in s.frames if _is_focus(f, None)][-1:]
        lines.append(f"rank {s.rank} was at\n{_where(own, beyond, 'waiting')}")
    missing = [r for r in range(nproc) if r not in {s.rank for s in states}]
    if missing:
        lines.append(f"{_ranks(missing)}: no stack (the process had ended, or had not started Python yet)")
    return "\n".join(lines)


def syntax_error(path: Path) -> str | None:
    """Python's own report of a syntax error in ``path`` (file, line, the line and a caret), or None."""
    try:
        source = Path(path).read_bytes()
    except OSError:
        return None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        text = (exc.text or "").rstrip("\n")
        stripped = text.lstrip()
        caret = ""
        if exc.offset and stripped:
            start = max(exc.offset - 1 - (len(text) - len(stripped)), 0)
            end = getattr(exc, "end_offset", None)
            width = max(1, (end - exc.offset) if end and end > exc.offset and exc.end_lineno == exc.lineno else 1)
            caret = "\n    " + " " * start + "^" * width
        return (f'  File "{show(path)}", line {exc.lineno}\n    {stripped}{caret}\n'
                f"{type(exc).__name__}: {exc.msg}")
    return None


_AGENT_START = re.compile(r"^(E|W)\d{4} .*(elastic/multiprocessing/api\.py|torch/distributed/run\.py)")


def without_launcher(output: str) -> str:
    """The job's output without torchrun's own report of the failure (its traceback, the ``=====``
    table of failures, its error-level log lines) and its ``OMP_NUM_THREADS`` banner."""
    kept, skipping = [], False
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if _AGENT_START.match(line):
            continue
        if line.startswith("Traceback (most recent call last):") and any(
                "torch/distributed/run.py" in ln or "<frozen runpy>" in ln for ln in lines[i + 1:i + 4]):
            skipping = True
        if skipping:
            continue
        kept.append(line)
    text = "\n".join(kept)
    return re.sub(r"\*{20,}\nSetting OMP_NUM_THREADS.*?\n\*{20,}\n?", "", text, flags=re.S)

