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
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ddp_course.check import Verdict, last_lines, not_complete, results

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


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """One crash-and-restart job on 2 ranks (the reference runs inside it); compare bit for bit."""
    from ddp_course.launch import LaunchTimeout, run

    scratch = Path(tempfile.mkdtemp(prefix="ddp_course_g08_"))
    try:
        try:
            job = run(str(path), nproc=NPROC, out_dir=scratch, echo="none", progress=False, timeout=timeout,
                      check=False, torchrun_args=["--max-restarts=1"], env=RESTART_ENV, max_steps=MAX_STEPS,
                      ckpt_step=CKPT_STEP, fail_at_step=FAIL_AT_STEP)
        except LaunchTimeout as exc:  # the job was stopped
            return Verdict(False, f"the job did not finish within {timeout:.0f}s and was stopped. A save that waits "
                                  "forever is usually a collective that only some ranks call: dist.barrier() or "
                                  "dist.gather_object() inside `if rank == 0:` waits for ranks that never come. "
                                  f"{last_lines(exc.run.output).lstrip()}")
        if "NotImplementedError" in job.output:
            return not_complete("save_checkpoint() or load_checkpoint()", path)
        found = results(job.output)
        if len(found) != NPROC:
            hint = (" A rank waited until the process group's timeout: a collective that only some ranks call, such as "
                    "dist.barrier() or dist.gather_object() inside `if rank == 0:`, waits for ranks that never come."
                    if any(s in job.output for s in ("timed out", "Timeout", "timeout")) else "")
            return Verdict(False, f"after the crash and the restart, the job did not finish on every rank (exit code "
                                  f"{job.returncode}).{hint}{last_lines(job.output)}")
        return diagnose(found)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
