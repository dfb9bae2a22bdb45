"""Grader of exercise 08 (``lessons/exercises/08_save_load.py``): a save/load pair that resumes exactly.

Runs the script once with ``torchrun --max-restarts=1`` on 2 processes: attempt 0 saves at step
``CKPT_STEP`` and rank 1 kills itself (SIGKILL) after step ``FAIL_AT_STEP``; torchrun restarts both
ranks; attempt 1 loads the checkpoint and finishes, then trains the same model again from step 0
without interruption and without checkpoints -- the reference, which does not depend on the
functions being graded.

Per rank, it compares the state right after loading with the reference's at the checkpoint step
(model, AdamW state, RNG state), then the losses of the remaining steps and the final parameters,
all bit for bit -- CPU runs are deterministic, so anything short of equality is a real difference --
and names the part that was not restored.

That crash comes long after the save, so it cannot tell an atomic save from one that writes straight
onto ``path``. A second, one-process job (this module run with ``-m``: ``main`` below, started by
the grader, not by hand) kills the process *during* a save, the way lesson 08's
``ckpt_kill`` does for the course's own checkpoints: the learner's ``save_checkpoint`` saves step 1
completely, then ``torch.save`` is made to write half of step 2's bytes and SIGKILL the process.
torchrun restarts it, and the learner's ``load_checkpoint`` must find at ``path`` the complete
checkpoint of step 1 (``diagnose_kill``) -- never a truncated file, never nothing.

The two jobs are independent, so they run at the same time (each waits on process start-ups and
rendezvous the other can use); the verdict is the same as if the second ran after the first: its
result counts only once the resume is exact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddp_course.check import (
    Verdict,
    crash_report,
    graded_job,
    not_complete,
    results,
    stopped_verdict,
    stub_left,
    syntax_verdict,
)
from ddp_course.cli import command, parse_flags

EXERCISE = "08_save_load.py"  # the script this grades: lessons/exercises/08_save_load.py
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): the gather of
# every rank's RNG state, the atomic rename, the restore of this rank's own state.
GIVEAWAYS = ("gather_object(torch.get_rng_state()", "set_rng_state(state[\"rng\"][info.rank])")
# Lines of the answer the lesson teaches on purpose before the exercise: section 2 shows the course's own
# atomic save (a temporary name, then os.replace), which the exercise then applies to a DDP script.
TAUGHT = ('tmp = path.with_name(path.name + ".tmp")', "os.replace(tmp, path)")

NPROC = 2
MAX_STEPS, CKPT_STEP, FAIL_AT_STEP = 12, 6, 9
# torch 2.x: restarted workers would find the first attempt's addresses in torchrun's shared store
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def diagnose(found: list[dict]) -> Verdict:
    """The verdict from the RESULT lines of the restarted job (each carries its rank's reference run)."""
    got = {r["rank"]: r for r in found}
    ref = {k: r["reference"] for k, r in got.items()}
    if sorted(got) != list(range(NPROC)):
        return Verdict(False, f"after the restart only ranks {sorted(got)} finished; every rank must run to the end.")
    for rank in range(NPROC):
        g, r = got[rank], ref[rank]
        if g["attempt"] < 1:
            return Verdict(False, f"rank {rank} finished on torchrun's first attempt: the crash after step "
                                  f"{FAIL_AT_STEP} did not happen. Did the harness below the exercise change?")
        if g["start"] == 0:
            return Verdict(False, f"after the restart, rank {rank} started again from step 0: there was no checkpoint "
                                  "file to load. save_checkpoint must leave the file at exactly `path` (rank 0 writes "
                                  "it, e.g. to a temporary name that it then os.replace()s onto path).")
        if g["start"] != CKPT_STEP:
            return Verdict(False, f"load_checkpoint returned step {g['start']} on rank {rank}, but the checkpoint was "
                                  f"saved after step {CKPT_STEP}: save the step and return it.")
    for part, fix in (("model", "save model.module.state_dict() (the unwrapped model) and load it into model.module"),
                      ("optimizer", "save optimizer.state_dict() and load it with optimizer.load_state_dict(): "
                                    "without it AdamW restarts its moments and step counts from zero")):
        bad = [k for k in range(NPROC) if got[k]["loaded"][part] != ref[k]["at_ckpt"][part]]
        if bad:
            return Verdict(False, f"right after loading, the {part} state on rank(s) {bad} differs from the "
                                  f"uninterrupted run's at step {CKPT_STEP}: {fix}.")
    bad = [k for k in range(NPROC) if got[k]["loaded"]["rng"] != ref[k]["at_ckpt"]["rng"]]
    if bad:
        same_as_0 = [k for k in bad if got[k]["loaded"]["rng"] == ref[0]["at_ckpt"]["rng"]]
        if same_as_0:
            why = (f"rank(s) {same_as_0} got rank 0's RNG state: the ranks' states differ (dropout is seeded per "
                   "rank), so gather every rank's torch.get_rng_state() and let each rank restore its own entry.")
        else:
            why = ("restore it with torch.set_rng_state(): otherwise every dropout mask after the resume differs "
                   "from the uninterrupted run's.")
        return Verdict(False, f"right after loading, the RNG state on rank(s) {bad} is not the state it had at step "
                              f"{CKPT_STEP}; {why}")
    for rank in range(NPROC):
        g, r = got[rank], ref[rank]
        diff = [int(s) for s in r["losses"] if int(s) > CKPT_STEP and g["losses"].get(s) != r["losses"][s]]
        if diff or g["final"] != r["final"]:
            where = f"from step {min(diff)}" if diff else "in the final parameters"
            return Verdict(False, f"the state after loading matches, but rank {rank}'s resumed run differs from the "
                                  f"uninterrupted one {where}. Does load_checkpoint change anything after restoring?")
    return Verdict(True, f"killed after step {FAIL_AT_STEP} and restarted by torchrun, both ranks resumed at step "
                         f"{CKPT_STEP} with the model, AdamW state and their own RNG state as they were, and finished "
                         "with losses and parameters identical to the last bit to a run that never crashed.")


KILL_MODULE = "ddp_course.course.l08_checkpointing.grader"
KILL_DEFAULTS: dict[str, Any] = {"script": "", "out_dir": "runs/g08_kill"}
ATOMIC = ("Write the checkpoint to a temporary file in the same folder (e.g. path.with_name(path.name + '.tmp')), "
          "then os.replace(tmp, path): the rename swaps the old file for the complete new one in one step, so "
          "path always holds one whole checkpoint, the old or the new.")


def diagnose_kill(r: dict) -> Verdict:
    """The verdict from the RESULT line of the kill-during-a-save job (see ``main``)."""
    if not r.get("killed"):
        return Verdict(False, "save_checkpoint completed a save that the grader had set to stop halfway: it never "
                              "called torch.save (the grader interrupts torch.save's write to try a crash in the "
                              "middle of a save). Save the checkpoint with torch.save, load it with torch.load.")
    writing = r.get("writing")
    where = (" torch.save was writing straight onto path." if writing == r["path"] else
             f" torch.save was writing {writing}." if writing else "")
    if not r["exists"]:
        return Verdict(False, "killed in the middle of saving step 2, the job was left with no checkpoint at path: "
                              f"the complete checkpoint of step 1 was removed before the new one was written.{where} "
                              f"{ATOMIC}")
    if "error" in r:
        return Verdict(False, "killed in the middle of saving step 2 (SIGKILL after half of torch.save's bytes), "
                              "the job was left with a truncated file at path, which load_checkpoint cannot read "
                              f"({r['error']}): a crash while saving loses the checkpoint of step 1 too.{where} "
                              f"{ATOMIC}")
    if r["step"] != 1 or r["loaded"] != r["previous"]:
        return Verdict(False, f"killed in the middle of saving step 2, path then loaded as step {r['step']} with a "
                              "state that is not the complete checkpoint of step 1 saved before it. " + ATOMIC)
    return Verdict(True, "a process killed halfway through writing the next checkpoint left the previous one at "
                         "path, complete and loadable")


def _kill_during_save(path: Path, scratch: Path, timeout: float) -> Verdict:
    """Run ``main`` on the learner's script: a kill during the second save, a restart, a load."""
    from ddp_course.launch import LaunchTimeout, run

    try:
        job = run(KILL_MODULE, nproc=1, use_torchrun=True, out_dir=scratch / "kill", echo="none", progress=False,
                  timeout=timeout, check=False, script=str(path.resolve()),
                  **graded_job(env=RESTART_ENV, torchrun_args=["--max-restarts=1"]))
    except LaunchTimeout as exc:
        return stopped_verdict(exc, path, timeout, what="the job that kills a save halfway")
    found = results(job.output)
    if not found:
        return Verdict(False, "the job that kills a save halfway (one process: save step 1, SIGKILL during the save of "
                              "step 2, restart, load_checkpoint) did not finish (exit code "
                              f"{job.returncode}).{crash_report(job, path)}")
    return diagnose_kill(found[-1])


def _exercise(script: str):
    """The learner's script as a module (``main`` does not run: it is guarded by ``__name__``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("exercise_08", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arm_kill(exercise, out_dir: Path) -> None:
    """Make the next ``torch.save`` that writes the checkpoint, however ``save_checkpoint`` reaches it,
    write half of its bytes and SIGKILL this process: lesson 08's ``ckpt_kill`` armed on a file named
    by its path, an open file, or a buffer of the learner's (torch's own ``torch.save`` into a buffer,
    e.g. in ``gather_object``, runs as usual). Notes in ``killed.json`` what was being written."""
    import torch

    from ddp_course.course.l08_checkpointing import ckpt_kill
    from ddp_course.metrics import write_json

    real = torch.save
    ckpt_kill.arm_kill("full")  # torch.save(obj, open_file) now writes half of the bytes, then SIGKILL
    half_then_die = torch.save

    def save(obj, f, *args, **kwargs):
        named = isinstance(f, (str, os.PathLike))
        try:
            is_file = named or f.fileno() >= 0
        except (AttributeError, OSError):  # an in-memory buffer
            is_file = False
        if not is_file and sys._getframe(1).f_globals is not vars(exercise):
            return real(obj, f, *args, **kwargs)  # torch's own, e.g. gather_object serialising the RNG states
        write_json(out_dir / "killed.json", {"writing": Path(f).name if named else None})
        if not is_file:  # the learner's buffer: the process dies before its bytes reach any file
            os.kill(os.getpid(), signal.SIGKILL)
        if named:
            with open(f, "wb") as opened:
                half_then_die(obj, opened, *args, **kwargs)
        half_then_die(obj, f, *args, **kwargs)  # an open file: half of the bytes land in it

    torch.save = torch.serialization.save = save
    for name, value in list(vars(exercise).items()):  # `from torch import save` in the learner's script
        if value is real:
            setattr(exercise, name, save)


@command
def main(argv: list[str]) -> int:
    """The kill-during-a-save job: attempt 0 saves step 1, then dies halfway through saving step 2;
    attempt 1 (torchrun's restart) loads what is at path and prints one ``RESULT {json}`` line."""
    from ddp_course.data import prepare
    from ddp_course.dist import setup
    from ddp_course.metrics import write_json

    opts = parse_flags(argv, KILL_DEFAULTS, f"python -m {KILL_MODULE}")
    exercise = _exercise(opts["script"])
    out = Path(opts["out_dir"])
    path = out / "checkpoint.pt"
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with setup(device="cpu", timeout_s=30, threads=1,
               because="the exercise's script runs on the CPU, and this job runs its functions as the script does"
               ) as info:
        data = prepare("tinyshakespeare", block_size=32, val_fraction=0.1, announce=lambda msg: None)
        model, optimizer = exercise.fresh_start(data, info)
        if attempt == 0:
            steps = {"max_steps": 1, "ckpt_step": 1, "fail_at_step": -1}
            first = exercise.train(data, model, optimizer, info, 0, steps, path, crash=False)  # saves step 1
            write_json(out / "previous.json", first["at_ckpt"])
            _arm_kill(exercise, out)
            steps = {"max_steps": 2, "ckpt_step": 2, "fail_at_step": -1}
            exercise.train(data, model, optimizer, info, 1, steps, path, crash=False)  # saves step 2: killed
            result: dict[str, Any] = {"attempt": 0, "killed": False}
        else:
            killed = out / "killed.json"
            result = {"attempt": attempt, "killed": True, "path": path.name, "exists": path.exists(),
                      "writing": json.loads(killed.read_text())["writing"] if killed.is_file() else None,
                      "previous": json.loads((out / "previous.json").read_text())}
            if path.exists():
                try:
                    result["step"] = int(exercise.load_checkpoint(path, model, optimizer, info))
                    result["loaded"] = exercise.probe(model, optimizer)
                except Exception as exc:  # what a truncated file does to the learner's load
                    first = str(exc).split(". ")[0].splitlines()[0][:200] if str(exc).strip() else ""
                    result["error"] = f"{type(exc).__name__}: {first}"
        sys.stdout.write(f"RESULT {json.dumps(result)}\n")
        sys.stdout.flush()
    return 0


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """One crash-and-restart job on 2 ranks (the reference runs inside it), compared bit for bit; then
    the job killed in the middle of a save, which ran meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    scratch = Path(tempfile.mkdtemp(prefix="ddp_course_g08_"))
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:  # leaving the block waits for the kill job
            kill_job = pool.submit(_kill_during_save, Path(path), scratch, timeout)
            verdict = _crash_and_restart(path, scratch / "crash", timeout)
            if not verdict.ok:
                return verdict
            killed = kill_job.result()
        if not killed.ok:
            return Verdict(False, f"the resume is exact, but {killed.message}")
        return Verdict(True, f"{verdict.message} And {killed.message}: the save is atomic.")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _crash_and_restart(path: str | Path, out_dir: Path, timeout: float) -> Verdict:
    """The crash-and-restart job on the learner's script, and ``diagnose`` of its RESULT lines."""
    from ddp_course.launch import LaunchTimeout, run

    bad = syntax_verdict(path)
    if bad is not None:
        return bad
    try:
        job = run(str(path), nproc=NPROC, out_dir=out_dir, echo="none", progress=False, timeout=timeout,
                  check=False, max_steps=MAX_STEPS, ckpt_step=CKPT_STEP, fail_at_step=FAIL_AT_STEP,
                  **graded_job(env=RESTART_ENV, torchrun_args=["--max-restarts=1"]))
    except LaunchTimeout as exc:  # the job was stopped
        return stopped_verdict(exc, path, timeout, what="the job",
                               hint=lambda output: " A save that waits forever is usually a collective that only some "
                               "ranks call: dist.barrier() or dist.gather_object() inside `if rank == 0:` waits for "
                               "ranks that never come.")
    if stub_left(job):
        return not_complete("save_checkpoint() or load_checkpoint()", path)
    found = results(job.output)
    if len(found) != NPROC:
        hint = (" A rank waited until the process group's timeout: a collective that only some ranks call, such as "
                "dist.barrier() or dist.gather_object() inside `if rank == 0:`, waits for ranks that never come."
                if any(s in job.output for s in ("timed out", "Timeout", "timeout")) else "")
        return Verdict(False, f"after the crash and the restart, the job did not finish on every rank (exit code "
                              f"{job.returncode}).{hint}{crash_report(job, path)}")
    return diagnose(found)


if __name__ == "__main__":
    sys.exit(main())
