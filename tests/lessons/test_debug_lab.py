"""The debugging lab's programs still demonstrate their bugs, within their timeouts; its jobs are judged by
the CPU they use; its exercises are graded from what the ranks did.

All eight programs start at once (``broken.launch_all``): the hanging ones spend most of their time
waiting for their 5 s process-group timeout, the others starting Python, so side by side they take
a fraction of the time. Lesson 12 runs the same nine jobs: under ``make test`` the tests check the
notebook's runs (``notebook_runs``) rather than launch them again. Each test then checks its program's characteristic symptom in what the
ranks recorded -- so the lab cannot silently stop showing the bug it is about.
"""

from __future__ import annotations

import json
import re

import notebook_runs
import pytest
import torch

from ddp_course.course.l12_debugging_lab import broken

PG_TIMEOUT = broken.PG_TIMEOUT_S


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _notebook_lab():
    """Lesson 12's runs of the same nine jobs, when the notebook made them in this session (else None)."""
    base = notebook_runs.folder("runs/12")
    if base is None:
        return None
    done = {}
    for key, bug in broken.BUGS.items():
        if bug.nodes == 2:  # two torchrun agents: the records its four ranks wrote
            ranks = sorted(base.joinpath(key).glob("rank*.json"))
            if len(ranks) != 4 or not all(notebook_runs.fresh(p) for p in ranks):
                return None
            done[key] = (None, base / key)
            continue
        run = notebook_runs.reuse(f"runs/12/{key}", bug.module, 2, **broken.job_flags(key))
        if run is None:
            return None
        done[key] = (run, run.out_dir)
    detail = notebook_runs.reuse("runs/12/detail", broken.BUGS["eval_loss"].module, 2, env=DETAIL,
                                 **broken.job_flags("eval_loss"))
    if detail is None:
        return None
    done["detail"] = (detail, detail.out_dir)
    return done


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    shared = _notebook_lab()
    if shared is not None:
        return shared
    base = tmp_path_factory.mktemp("broken")
    with ThreadPoolExecutor(max_workers=1) as pool:  # the DETAIL run of eval_loss alongside the rest
        detail = pool.submit(broken.launch, "eval_loss", base / "detail", env=DETAIL)
        futures = broken.launch_all(base)
        done = {key: (f.result(), base / key) for key, f in futures.items()}  # each job judged by its CPU use
        done["detail"] = (detail.result(), base / "detail")
    return done


def test_every_bug_has_a_program():
    import importlib

    for key, bug in broken.BUGS.items():
        mod = importlib.import_module(bug.module)
        assert "torchrun" in mod.__doc__ and hasattr(mod, "main"), key


# How a learner may spell each rank's collective, and the classic mistakes (reading the other rank's
# fingerprint, or rank 0's for both).
SPELLINGS = [{0: "all_reduce", 1: "barrier"}, {0: "ALLREDUCE", 1: "BARRIER"}, {"0": "AllReduce", "1": "Barrier"},
             {0: "dist.all_reduce", 1: "dist.barrier()"}, {"rank 0": "all-reduce", "rank 1": "barrier"}]
MISTAKES = [{0: "allreduce", 1: "gather"}, {0: "allreduce", 1: "allreduce"}, {0: "barrier", 1: "allreduce"},
            {0: "allreduce"}, {0: "all_gather", 1: "barrier"}]


def test_collective_on_rank0_hangs_until_the_timeout(lab):
    """The plain run of exercise A's program: the evaluation that every rank runs completes, the one
    inside ``if rank == 0`` hangs until the short timeout -- and what the learner is shown of it (the
    symptom, the ranks' records) names no collective: which one each rank waited in is for the tools to
    find. The grader reads it from the traces the ranks left (their exceptions, the stack a rank dumped
    when the other's collective timed out), and accepts it however spelt."""
    run, out = lab["eval_loss"]
    recs = broken.records(out)
    assert run.returncode != 0
    assert all(r["fixed_completed"] for r in recs.values())  # the fixed evaluation completes first
    errors = [r["error"] for r in recs.values() if "error" in r]
    # the ranks waited for the timeout (not an instant crash), and one of them says it timed out
    assert any("Timed out" in e["message"] for e in errors)
    assert all(e["seconds"] >= 0.8 * PG_TIMEOUT for e in errors if "Timed out" in e["message"])
    shown = broken.symptom(run)
    assert "[rank0]: RuntimeError" in shown or "[rank1]: RuntimeError" in shown
    for said in (shown, json.dumps(recs)):  # the diagnosis is found, not read
        assert not re.search(r"all_?reduce|barrier", said, re.I), said
    assert broken._waited_in(out) == {0: "all_reduce", 1: "barrier"}
    for answer in SPELLINGS:
        assert broken.check_exercise(1, answer, out).ok, answer
    for answer in MISTAKES:
        assert not broken.check_exercise(1, answer, out).ok, answer


def test_collective_on_rank0_named_by_detail(lab):
    run, out = lab["detail"]
    recs = broken.records(out)
    assert run.returncode != 0
    msgs = {r: rec["error"]["message"] for r, rec in recs.items() if "error" in rec}
    assert any("Detected mismatch between collectives" in m for m in msgs.values()), msgs
    own = {r: re.search(rf"Rank {r} is running collective: CollectiveFingerPrint\(.*?OpType=(\w+)", m)
           for r, m in msgs.items()}  # each rank's message names its own collective
    answer = {r: m.group(1) for r, m in own.items() if m}
    assert answer == {0: "ALLREDUCE", 1: "BARRIER"}
    assert all(rec["error"]["seconds"] < PG_TIMEOUT for rec in recs.values())  # at once, no waiting
    for folder in (out, lab["eval_loss"][1]):  # the answer DETAIL gives grades against either run
        v = broken.check_exercise(1, answer, folder)
        assert v.ok, v
    for answer in MISTAKES:
        assert not broken.check_exercise(1, answer, out).ok, answer


def test_hard_coded_world_size_times_out_at_init(lab):
    """Exercise B's program: what it asked for is in its source (found through the error file's
    traceback), what torchrun started in each rank's environment; neither is printed or recorded as such."""
    run, out = lab["join_group"]
    recs = broken.records(out)
    assert run.returncode != 0 and sorted(recs) == [0, 1]
    for rec in recs.values():
        assert rec["env"]["WORLD_SIZE"] == "2" and "asked_world_size" not in rec
        assert rec["error"]["where"] == "init_process_group"
        # the store key it waited for ends in the number of a rank that was never started
        assert "wait timeout" in rec["error"]["message"]
        assert int(re.search(r"/(\d+)$", rec["error"]["message"]).group(1)) >= 2
    shown = broken.symptom(run)
    assert "DistStoreError: wait timeout" in shown and not re.search(r"4[- ]gpu|world_size\s*=\s*4|\b4 ranks", shown, re.I)
    files = broken.error_files(run)  # @record: torchrun's error file carries each rank's traceback
    assert files and all("init_process_group" in f["traceback"] for f in files)
    for answer in ({"asked": 4, "launched": 2}, {"asked": "4", "launched": 2.0}):
        assert broken.check_exercise(2, answer, out).ok
    for answer in ({"asked": 2, "launched": 4}, {"asked": 4, "launched": 4}, {"asked": 2, "launched": 2}):
        assert not broken.check_exercise(2, answer, out).ok


def test_missing_set_epoch_repeats_the_order(lab):
    run, out = lab["no_set_epoch"]
    recs = broken.records(out)
    assert run.returncode == 0
    for rec in recs.values():
        assert all(e == rec["broken"][0] for e in rec["broken"])  # every epoch the same order
        assert len({tuple(e) for e in rec["fixed"]}) == len(rec["fixed"])  # set_epoch: a new order each epoch
    for variant in ("broken", "fixed"):  # the sampler still shards: the ranks never share a sample
        for e in range(len(recs[0][variant])):
            assert not set(recs[0][variant][e]) & set(recs[1][variant][e])


def test_same_seed_gives_every_rank_the_same_data(lab):
    """Exercise C's program: the ranks trained on the same windows in one run, on disjoint ones in the
    other -- in their records; what the terminal shows is rank 0's loss, as a training script prints it."""
    run, out = lab["train_windows"]
    recs = broken.records(out)
    assert run.returncode == 0
    assert recs[0]["broken"]["indices"] == recs[1]["broken"]["indices"]
    assert recs[0]["broken"]["local_losses"] == recs[1]["broken"]["local_losses"]  # bit for bit
    seen0 = {i for b in recs[0]["fixed"]["indices"] for i in b}
    assert not seen0 & {i for b in recs[1]["fixed"]["indices"] for i in b}
    assert recs[0]["fixed"]["local_losses"] != recs[1]["fixed"]["local_losses"]
    shown = broken.symptom(run)
    assert "loss" in shown and "window" not in shown and "[rank 1]" not in shown, shown
    for answer in ({"broken": 1.0, "fixed": 0.0}, {"broken": 1, "fixed": 0}, {"broken": "100%", "fixed": "0%"},
                   {"broken": 100, "fixed": 0}):
        assert broken.check_exercise(3, answer, out).ok, answer
    for answer in ({"broken": 0.5, "fixed": 0.0}, {"broken": 0.0, "fixed": 1.0}, {"broken": 1.0, "fixed": 0.5}):
        assert not broken.check_exercise(3, answer, out).ok, answer


def test_uneven_batches_hang_and_the_fixes_do_not(lab):
    run, out = lab["uneven_batches"]
    recs = broken.records(out)
    assert run.returncode != 0
    assert recs[0]["broken"]["batches"] == recs[1]["broken"]["batches"] + 1  # the per-rank data shows it
    assert recs[0]["fixed"]["batches"] == recs[1]["fixed"]["batches"]
    assert all(r["fixed_completed"] and r["join_completed"] for r in recs.values())
    assert recs[0]["join_batches_done"] == recs[1]["join_batches_done"] + 1  # Join covered the extra batch
    assert all("broken_completed" not in r for r in recs.values())
    assert any("Timed out" in r["error"]["message"] for r in recs.values() if "error" in r)


def test_no_sync_placement_counts(lab):
    run, out = lab["no_sync_placement"]
    rec = broken.records(out)[0]
    assert run.returncode == 0
    k = rec["right"]["k"]
    assert [s["bucket_all_reduces"] for s in rec["right"]["per_step"]] == [1, 1]
    assert [s["bucket_all_reduces"] for s in rec["backward_only"]["per_step"]] == [k, k]  # no saving at all
    assert [s["bucket_all_reduces"] for s in rec["all_inside"]["per_step"]] == [0, 0]
    assert rec["right"]["replica_max_diff"] == 0.0 and rec["backward_only"]["replica_max_diff"] == 0.0
    assert rec["all_inside"]["replica_max_diff"] > 1e-4  # never synchronised: the replicas drifted


def test_every_rank_saving_writes_the_file_twice(lab):
    run, out = lab["save_every_rank"]
    recs = broken.records(out)
    assert run.returncode == 0
    assert all(r["broken"]["wrote"] for r in recs.values())  # two writers, one path
    assert len({r["broken"]["found_saved_by"] for r in recs.values()}) == 1  # one of them won the race
    assert [r["fixed"]["wrote"] for _, r in sorted(recs.items())] == [True, False]
    assert all(r["fixed"]["found_saved_by"] == 0 for r in recs.values())


def test_device_by_global_rank_points_past_the_local_gpus(lab):
    _, out = lab["device_global_rank"]
    recs = broken.records(out)
    assert sorted(recs) == [0, 1, 2, 3]
    for r, rec in recs.items():
        assert rec["node"] == r // 2 and rec["local_rank"] == r % 2
        assert rec["by_global_rank"] == r and rec["by_local_rank"] == r % 2
        assert rec["local_rank_exists"]
    assert not recs[2]["global_rank_exists"] and not recs[3]["global_rank_exists"]
    if torch.cuda.device_count() >= 2:
        assert recs[2]["set_device_global_rank"] != "ok"  # the real error, from the real call
    else:
        assert recs[2]["set_device_global_rank"].startswith("not called")  # computed, never faked


# --- exercise A's grader on the traces alone (no job) ---------------------------------------------------

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _traced_run(folder, traces: dict[int, tuple[str, str | None]]):
    """A finished run's folder as exercise A's grader reads it: each rank's record, and in the postmortem
    folder either the exception that ended the rank ("error") or the stack it dumped ("stack"), waiting
    in the given ``torch.distributed`` function (None: a trace without one)."""
    pm = folder / "torchrun_logs" / "abcd1234" / "postmortem" / "attempt0"
    pm.mkdir(parents=True)
    program = str(folder / "eval_loss.py")
    for rank, (kind, fn) in traces.items():
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank}))
        inner = [(C10D, 4000, fn)] if fn else []
        frames = [(program, 90, "main"), ("/x/c10d_logger.py", 80, "wrapper"), *inner]
        if kind == "error":
            (pm / f"rank{rank}.error.json").write_text(json.dumps({
                "rank": rank, "type": "RuntimeError", "module": "builtins", "error": "RuntimeError: Timed out",
                "frames": [{"file": f, "line": n, "function": name} for f, n, name in frames], "text": ""}))
        else:
            (pm / f"rank{rank}.stack").write_text("Thread 0x00007f (most recent call first):\n" + "".join(
                f'  File "{f}", line {n} in {name}\n' for f, n, name in [*reversed(frames), (program, 99, "<module>")]))


def test_exercise_a_is_graded_from_the_traces_the_ranks_left(tmp_path):
    """Whether the wait ended in an exception (the rank whose collective timed out, or both under DETAIL)
    or the rank was stopped and left only its stack, the grader reads the collective each rank was in
    from the innermost ``distributed_c10d`` frame; a rank that left no trace is said, not guessed."""
    for n, traces in enumerate(({0: ("error", "all_reduce"), 1: ("stack", "barrier")},
                                {0: ("stack", "all_reduce"), 1: ("error", "barrier")},
                                {0: ("error", "all_reduce"), 1: ("error", "barrier")})):
        folder = tmp_path / f"run{n}"
        _traced_run(folder, traces)
        assert broken._waited_in(folder) == {0: "all_reduce", 1: "barrier"}
        for answer in SPELLINGS:
            assert broken.check_exercise(1, answer, folder).ok, (traces, answer)
        for answer in MISTAKES:
            v = broken.check_exercise(1, answer, folder)
            assert not v.ok, (traces, answer)
    folder = tmp_path / "untraced"
    _traced_run(folder, {0: ("error", "all_reduce"), 1: ("stack", None)})
    v = broken.check_exercise(1, {0: "all_reduce", 1: "barrier"}, folder)
    assert not v.ok and "no trace" in v.message and "run the program again" in v.message, v


# --- the lab's jobs are judged by the CPU they use, not by a deadline --------------------------------------

# Chained after the course's start-up hook (``_postmortem/sitecustomize.py`` runs the next sitecustomize on
# the path): the rank named by SLOW_RANK spends SLOW_CPU_S seconds of CPU before anything else -- a start-up
# that a busy machine, or a slow one, makes long.
SLOW_START = """import os, time
if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("SLOW_RANK"):
    end = time.process_time() + float(os.environ["SLOW_CPU_S"])
    while time.process_time() < end:
        pass
"""


@pytest.fixture
def slow_start(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_START)
    return {"PYTHONPATH": str(hook), "SLOW_RANK": "1", "SLOW_CPU_S": "8"}


@pytest.fixture
def busy_machine():
    """Two busy loops beside the job for the length of one test (seconds), stopped whatever happens: the
    machine oversubscribed, as a laptop running a browser and a build is."""
    import subprocess
    import sys

    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()


def test_a_slow_start_is_not_taken_for_a_hang(tmp_path, monkeypatch, slow_start, busy_machine):
    """On an oversubscribed machine, one rank's start-up takes far longer than the stall window (here made
    3 s) while the other waits for it in the rendezvous: the job is slow, not idle, and runs to its end.
    A deadline of that length -- the lab had a 90 s one, which a busy machine overran while both ranks
    were still importing -- would have stopped it."""
    monkeypatch.setattr(broken, "IDLE_S", 3.0)
    run = broken.launch("no_set_epoch", tmp_path / "slow", env=slow_start)
    assert run.returncode == 0, run.output[-3000:]
    assert run.elapsed_s > 8 > broken.IDLE_S  # rank 1 alone spent 8 s of CPU starting
    assert sorted(broken.records(run)) == [0, 1]


def test_a_hang_is_still_stopped_by_its_cpu_use(tmp_path, monkeypatch, busy_machine):
    """The same watch stops a job that truly hangs -- exercise A's program with a process-group timeout
    too long to end it -- once no process of the job has used the CPU for the stall window, however busy
    the machine is with other work, and says where each rank was."""
    monkeypatch.setattr(broken, "IDLE_S", 3.0)
    with pytest.raises(broken.LabStalled) as caught:
        broken.launch("eval_loss", tmp_path / "hang", variant="broken", timeout_s=600)
    said = str(caught.value)
    assert "used the CPU for 3 s" in said and "all_reduce" in said and "barrier" in said, said
    assert caught.value.run.elapsed_s < 600  # the collectives' own timeout never came into it
    assert broken._waited_in(tmp_path / "hang") == {0: "all_reduce", 1: "barrier"}  # the stacks grade it


def test_the_ceiling_says_the_machine_is_too_busy(tmp_path, monkeypatch, slow_start):
    """Only a job still working at the wall-clock ceiling (here made 2 s) is stopped by time, and the
    error says what it means: the machine is too busy, nothing is wrong with the job."""
    monkeypatch.setattr(broken, "CEILING_S", 2.0)
    with pytest.raises(broken.LabTooBusy) as caught:
        broken.launch("no_set_epoch", tmp_path / "busy", env=slow_start)
    assert "too busy" in str(caught.value) and "kept using the CPU" in str(caught.value)


def test_the_two_node_watch_stops_idle_ranks_only(tmp_path):
    """The stall watch of the two-node job (which lesson 04's ``run_two_nodes`` starts, not ``launch.run``):
    a process of the job that sleeps is stopped after the window, one that computes is left alone."""
    import subprocess
    import sys
    import time

    def start(watch, code):
        env = {**__import__("os").environ, broken.LAB_JOB_VAR: watch.job, "RANK": "0"}
        return subprocess.Popen([sys.executable, "-c", code], env=env)

    with broken._CpuWatch(2.0) as watch:
        sleeper = start(watch, "import time; time.sleep(60)")
        try:
            sleeper.wait(timeout=30)
        finally:
            sleeper.kill()
    assert watch.stalled and sleeper.returncode != 0
    with broken._CpuWatch(2.0) as watch:
        worker = start(watch, "import time\nend = time.time() + 6\nwhile time.time() < end: pass")
        t0 = time.monotonic()
        worker.wait(timeout=60)
    assert not watch.stalled and worker.returncode == 0 and time.monotonic() - t0 >= 5
