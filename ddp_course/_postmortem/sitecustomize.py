"""Loaded at start-up by every Python process of a course job (``ddp_course.postmortem`` puts this
folder first on ``PYTHONPATH``). Standard library only, and nothing at all unless the job's
environment names a folder (``DDP_COURSE_POSTMORTEM``) and this process is a rank (``RANK``, or
``DDP_COURSE_POSTMORTEM_RANK`` for a job without torchrun). Then it keeps two things for the course
to read after the job, one file each per rank, in a folder per attempt (``attempt<N>``, as torchrun
counts restarts):

- ``rank<R>.error.json``: the exception that ended the process, with its frames (an excepthook,
  chained to whatever hook was there, so the traceback is printed as before);
- ``rank<R>.stack``: where every thread of the process is, written by ``faulthandler`` when the
  process receives SIGUSR1 (the course sends it to a job that ran past its timeout, before stopping
  it; and a rank whose collective timed out sends it to the job's other ranks before it ends, since
  torchrun stops them as soon as it has);
- ``rank<R>.fatal``: the same, written by ``faulthandler`` when the process dies of a fatal signal
  (a C++ library aborting, a segmentation fault), where no Python exception is left.
"""

import os

_KEEP: list = []  # the files faulthandler writes to: open for as long as the process lives
JOB_VAR = "DDP_COURSE_JOB"  # every process of a course job carries its id (ddp_course.launch sets it)


def _install() -> None:
    folder = os.environ.get("DDP_COURSE_POSTMORTEM")
    rank = os.environ.get("RANK", os.environ.get("DDP_COURSE_POSTMORTEM_RANK"))
    if not folder or rank is None or not rank.isdigit():
        return
    import faulthandler
    import json
    import signal
    import sys
    import traceback

    # a restarted job (torchrun --max-restarts) writes each attempt apart: the course reads the last
    folder = os.path.join(folder, f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    base = os.path.join(folder, f"rank{rank}")
    try:
        os.makedirs(folder, exist_ok=True)
        stack = open(base + ".stack", "w")  # kept open: faulthandler writes to its descriptor
    except OSError:
        return
    try:
        fatal = open(base + ".fatal", "w")  # a crash below Python (abort, segfault): where each thread was
        faulthandler.enable(file=fatal, all_threads=True)
        _keep_fatal_here(faulthandler, fatal)
    except OSError:
        fatal = None
    _KEEP.extend((stack, fatal))
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    previous = sys.excepthook

    def record(kind, value, tb):
        try:
            text = _as_python_prints(kind, value, tb) or "".join(traceback.format_exception(kind, value, tb))
            entry = {"rank": int(rank), "type": kind.__name__, "module": kind.__module__,
                     "error": _error_line(kind, value, text),
                     "frames": [{"file": f.filename, "line": f.lineno, "function": f.name, "source": f.line or "",
                                 "col": getattr(f, "colno", None), "end_col": getattr(f, "end_colno", None),
                                 "end_line": getattr(f, "end_lineno", None)}
                                for f in traceback.extract_tb(tb)],
                     "text": text}
            with open(base + ".traceback.txt", "w") as f:
                f.write(text)
            if isinstance(value, SyntaxError):
                entry["syntax"] = {"file": value.filename, "line": value.lineno, "offset": value.offset,
                                   "text": value.text}
            with open(base + ".error.json.part", "w") as f:
                json.dump(entry, f)
            os.replace(base + ".error.json.part", base + ".error.json")
            if _TIMED_OUT.search(entry["error"]):
                _ask_the_others(folder)
        except Exception:  # noqa: BLE001 -- never hide the learner's error behind one of ours
            pass
        previous(kind, value, tb)

    sys.excepthook = record


def _keep_fatal_here(faulthandler, fatal) -> None:
    """Keep the crash dump in ``fatal`` when the program enables faulthandler again without a file.

    torch.distributed.elastic's ``@record``, which wraps the entry point of ``ddp_course.train`` and of
    the labs, calls ``faulthandler.enable(all_threads=True)`` as it starts (``ErrorHandler.initialize``,
    torch/distributed/elastic/multiprocessing/errors/error_handler.py): that took the dump away to the
    job's output, ``rank<R>.fatal`` stayed empty, and the course named a rank that had died of a
    segmentation fault as one torchrun had stopped. Held by tests/core/test_launch.py.
    """
    enable = faulthandler.enable

    def enable_here(file=None, all_threads=True):
        return enable(file=fatal if file is None else file, all_threads=all_threads)

    faulthandler.enable = enable_here


def _timed_out_pattern():
    import re

    # gloo's "Timed out waiting 30000ms for recv", NCCL's watchdog "timeout", the store's "Timeout"
    return re.compile(r"[Tt]imed out|[Tt]imeout")


_TIMED_OUT = _timed_out_pattern()


def _ask_the_others(folder: str, wait_s: float = 3.0) -> None:
    """This rank's collective timed out: ask the job's other ranks (the processes that carry its id, a
    rank number and this rank's parent, torchrun) where they are, and wait until they have written it.
    torchrun stops them as soon as this process ends, and a rank that never arrived is the cause."""
    import signal
    import time

    job = os.environ.get(JOB_VAR)
    if not job or not hasattr(signal, "SIGUSR1") or not os.path.isdir("/proc"):
        return
    me, parent = os.getpid(), os.getppid()
    needle = f"{JOB_VAR}={job}".encode()
    asked = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        rank = next((v[5:].decode() for v in env if v.startswith(b"RANK=")), None)
        if needle in env and ppid == parent and rank is not None and rank.isdigit():
            try:
                os.kill(int(entry), signal.SIGUSR1)
                asked.append(os.path.join(folder, f"rank{rank}.stack"))
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in asked):
            time.sleep(0.2)  # the last lines of a dump
            return
        time.sleep(0.05)


def _error_line(kind, value, text: str) -> str:
    """``Type: message``, first line only (a message can hold a C++ stack), with the interpreter's
    "Did you mean ...?" when it printed one."""
    import traceback

    only = "".join(traceback.format_exception_only(kind, value)).splitlines()
    names = (kind.__qualname__, f"{kind.__module__}.{kind.__qualname__}")
    first = next((ln for ln in only if ln.startswith(names)), only[-1] if only else kind.__name__).strip()
    printed = next((ln.strip() for ln in text.splitlines() if ln.startswith(first)), first)
    return printed[:400]


def _as_python_prints(kind, value, tb) -> str:
    """The traceback exactly as the interpreter prints it (before 3.12 only the interpreter adds the
    "Did you mean" suggestions of a NameError or AttributeError)."""
    import io
    import sys

    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        sys.__excepthook__(kind, value, tb)
        return sys.stderr.getvalue()
    except Exception:  # noqa: BLE001
        return ""
    finally:
        sys.stderr = saved


def _chain() -> None:
    """Run the ``sitecustomize`` that this one hides on ``sys.path``, if there is one."""
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(candidate) != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_hidden_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_install()
_chain()
