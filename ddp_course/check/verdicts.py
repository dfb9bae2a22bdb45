"""Verdicts and the runs behind them: ``Verdict``, running an exercise script with torchrun
(``run_exercise``), reading its ``RESULT`` lines, and what a failed, hung or unfinished run reports."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ddp_course.check.registry import RECORDS


@dataclasses.dataclass
class Verdict:
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}: {self.message}"

    def _repr_markdown_(self) -> str:  # shown as a line of text in a notebook
        return f"**{'PASS' if self.ok else 'FAIL'}**: {self.message}"


@dataclasses.dataclass
class GradedRun(Verdict):
    """A verdict that keeps the job's ``RESULT`` records (one per rank; empty when the job gave none),
    so that a notebook can show what the graded run measured without launching it again."""

    records: list[dict] = dataclasses.field(default_factory=list, repr=False)


def judged(found: list[dict] | Verdict, diagnose: Callable[[list[dict]], Verdict]) -> Verdict:
    """A grader's last step: ``run_exercise``'s failing verdict as it is, else ``diagnose(found)`` with
    the job's records kept (a ``GradedRun``), for the notebook cells that show what the run measured."""
    if isinstance(found, Verdict):
        return found
    verdict = diagnose(found)
    return GradedRun(verdict.ok, verdict.message, found)


def graded_records(verdict: Verdict, what: str) -> list[dict]:
    """The records of a graded run (a ``GradedRun``'s), for a notebook cell that shows them; a
    ``ValueError`` that says what to do when there are none. ``what`` names the missing run, e.g.
    "timed run of your loader"."""
    records = getattr(verdict, "records", None)
    if not records:
        raise ValueError(f"there is no {what} yet: the grading verdict is \"{verdict}\". "
                         "Complete the exercise, re-run the grading cell, then this one.")
    return records


# A grader names a mistake when what the job measured is this many times nearer to the grader's own
# simulation of that mistake than to any other explanation it has (the right answer included), not
# when it falls within a fixed tolerance of it. The closest pair of explanations in the course is
# 1.0e-4 apart (relative: exercise 11's forward mistakes); rounding between ranks and one process
# stays below 1e-6 (8e-7 measured), a margin of 100x or more. A number that lies between two
# explanations is never forced into one of them.
MARGIN = 20.0



@dataclasses.dataclass(frozen=True)
class Nearest:
    """The explanation that some measured numbers are nearest to, and the runner-up.

    Distances are the largest relative difference over the numbers compared.
    """

    name: str
    distance: float
    runner_up: str
    runner_up_distance: float

    def clear(self, margin: float = MARGIN) -> bool:
        """True if ``name`` is at least ``margin`` times nearer than any other explanation."""
        return self.distance < float("inf") and self.distance * margin <= self.runner_up_distance

    def shown(self, labels: dict[str, str] | None = None) -> str:
        """The margin in words, for a verdict: how far from this explanation, and from the next one."""
        label = (labels or {}).get(self.runner_up, self.runner_up)
        return (f"the measured numbers are {self.distance:.1e} (relative) from the grader's simulation of this "
                f"mistake, {self.runner_up_distance:.1e} from the next nearest explanation ({label})")


def nearest(measured: Sequence[float | None], candidates: dict[str, Sequence[float]]) -> Nearest:
    """Which of ``candidates`` (name -> the numbers that explanation predicts, in the order of
    ``measured``) is nearest to ``measured``. A missing measurement (None) is infinitely far."""
    def distance(predicted: Sequence[float]) -> float:
        if len(predicted) != len(measured) or any(m is None for m in measured):
            return float("inf")
        return max((abs(m - p) / max(abs(p), 1e-30) for m, p in zip(measured, predicted)), default=0.0)

    (d1, first), (d2, second) = sorted((distance(v), k) for k, v in candidates.items())[:2]
    return Nearest(first, d1, second, d2)


NOT_COMPLETE = "exercise not complete"
STUB = "exercise: complete this part"  # the message of the stub every TODO of lessons/ raises


def not_complete(what: str, where: str | Path | None = None, plural: bool = False) -> Verdict:
    """The verdict on an exercise whose TODO is still there, saying what to do next.

    ``where`` is the exercise script's path; ``None`` means an exercise in the notebook (the cell
    above the check).
    """
    todo = ("fill in the TODO in the exercise cell above and run that cell" if where is None else
            f"fill in the TODO in {where} and save the file")
    return Verdict(False, f"{NOT_COMPLETE}: {what} still raise{'' if plural else 's'} NotImplementedError. {todo[0].upper()}{todo[1:]}, "
                          "then re-run this cell.")


def results(output: str) -> list[dict]:
    """The ``RESULT {json}`` lines an exercise script printed (one per rank)."""
    import json

    decoder = json.JSONDecoder()
    found = []
    for line in output.splitlines():
        # Usually one per line; tolerate two ranks' lines glued together ("RESULT {..}RESULT {..}").
        start = line.find("RESULT {")
        while start >= 0:
            try:
                obj, end = decoder.raw_decode(line, start + len("RESULT "))
            except json.JSONDecodeError:
                break
            found.append(obj)
            start = line.find("RESULT {", end)
    return found


def last_lines(output: str, n: int = 15) -> str:
    """`` Last lines:`` and the last ``n`` lines of a job's output, without torchrun's own report of
    the failure: what a failing verdict shows when no rank left an exception to show instead."""
    from ddp_course.postmortem import without_launcher

    return " Last lines:\n" + "\n".join(without_launcher(output).splitlines()[-n:])


def crash_report(job, path: str | Path | None, tail: Callable[[str], str] = last_lines) -> str:
    """Why a job (a ``launch.Run``) failed, for a verdict: each failing rank's exception with its frames
    in ``path`` (the learner's file), as Python shows a traceback; else the end of its output."""
    described = job.failure(path, keep=RECORDS)
    if not described:
        return tail(job.output)
    return f"\n{described}" + (f"\nFix it in {Path(path).name} and run the check again." if path else "")


def hang_report(job, path: str | Path | None, tail: Callable[[str], str] = last_lines) -> str:
    """Where each rank of a job stopped at its timeout was waiting (its line in ``path``, and the
    collective); else the end of its output."""
    where = job.hang(path)
    return f" Where each rank was waiting:\n{where}" if where else tail(job.output)


def syntax_verdict(path: str | Path) -> Verdict | None:
    """A failing verdict for a script Python cannot compile, before any process starts; else None."""
    from ddp_course.postmortem import syntax_error

    found = syntax_error(Path(path))
    if found is None:
        return None
    return Verdict(False, f"{Path(path).name} has a syntax error, so no process could start it:\n{found}\n"
                          "Fix that line (an unclosed bracket often shows on the line after it), then run the "
                          "check again.")


def stub_left(job) -> bool:
    """True when a rank stopped at an exercise stub (``raise NotImplementedError(STUB)``): a TODO left,
    not an error (a NotImplementedError of torch's own is an error like any other)."""
    from ddp_course.postmortem import errors

    states = errors(job.postmortem)
    if states:
        return any(STUB in s.error for s in states)
    return STUB in job.output


# A learner's hang is answered within seconds, whichever of these fires first, on any machine: a
# graded job's collectives wait at most COLLECTIVE_TIMEOUT_S for a rank that does not come (then the
# rank that timed out asks the others where they are), and a job none of whose processes has used
# the CPU for IDLE_S is stopped with every rank's stack. A correct graded job never waits that long.
COLLECTIVE_TIMEOUT_S = 20.0
IDLE_S = 30.0


def graded_job(env: dict[str, str] | None = None, **run_kwargs) -> dict:
    """``launch.run``'s options for a job that runs a learner's code: the short collective timeout
    (unless this process's environment sets a shorter one, as the tests do), the stall watch."""
    from ddp_course.dist import COLLECTIVE_TIMEOUT_VAR

    given = float(os.environ.get(COLLECTIVE_TIMEOUT_VAR) or COLLECTIVE_TIMEOUT_S)
    env = {COLLECTIVE_TIMEOUT_VAR: f"{min(given, COLLECTIVE_TIMEOUT_S):g}", **(env or {})}
    return {"idle_s": IDLE_S, **run_kwargs, "env": env}


def stopped_verdict(exc, path: str | Path | None, timeout: float, hint: Callable[[str], str] = lambda output: "",
                    tail: Callable[[str], str] = last_lines, what: str = "the script") -> Verdict:
    """The verdict on a job that was stopped (``launch.LaunchTimeout``): at the deadline, or because
    every rank had been waiting (``LaunchStalled``), with where each rank was."""
    from ddp_course.launch import LaunchStalled

    if isinstance(exc, LaunchStalled):
        head = (f"{what} stopped making progress: no process used the CPU for {IDLE_S:.0f}s (every rank "
                f"waiting), so it was stopped.")
    else:
        head = f"{what} did not finish within {timeout:.0f}s and was stopped."
    return Verdict(False, f"{head}{hint(exc.run.output)}{hang_report(exc.run, path, tail)}")


def run_exercise(path: str | Path, nproc: int, what: str, timeout: float, *,
                 hint: Callable[[str], str] = lambda output: "", tail: Callable[[str], str] = last_lines,
                 **run_kwargs) -> list[dict] | Verdict:
    """Run exercise script ``path`` on ``nproc`` processes: its ``RESULT`` lines, one per rank.

    Or, when there are not that many, the failing verdict that says why: a syntax error (before any
    process starts), a TODO left (``what`` names it), a job stopped at ``timeout`` (where each rank
    was waiting), or a rank that failed (its exception, in the frames of ``path``). ``hint(output)``
    may add a likely cause; ``tail(output)`` shows the end of the output when no rank left more. The
    graders share this first step.
    """
    from ddp_course.launch import LaunchTimeout, run

    bad = syntax_verdict(path)
    if bad is not None:
        return bad
    try:
        r = run(str(path), nproc=nproc, echo="none", progress=False, timeout=timeout, check=False,
                **graded_job(**run_kwargs))
    except LaunchTimeout as exc:
        return stopped_verdict(exc, path, timeout, hint, tail)
    if stub_left(r):
        return not_complete(what, path)
    found = results(r.output)
    if len(found) != nproc:
        if r.returncode != 0:
            return Verdict(False, f"with {nproc} processes the script failed (exit code {r.returncode}):"
                                  f"{crash_report(r, path, tail)}{hint(r.output)}")
        return Verdict(False, f"with {nproc} processes the script ended without a result from every rank "
                              f"({len(found)} RESULT line(s)).{hint(r.output)}{tail(r.output)}")
    return found
