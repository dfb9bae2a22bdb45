"""A learner who is wrong in an ordinary way sees their own error, file and line, in every exercise.

Each case starts from the answered exercise and breaks it the way learners do, inside the first
answer (a TODO's body): a name that does not exist (on rank 1 only, so the other rank is a
bystander), a syntax error, a rank that never joins the next collective (a hang), a misspelled
import at the top, a collective called by one rank only. A syntax error is tried on every exercise
(it costs no process); the errors that need a job, on one exercise for each way a job is started and
graded (``WAYS``): every other exercise is started and graded as 01 is, which a test reads from its
script and grader. The verdict must name the exception (or,
for a hang, the line each rank waits at and the collective), in ``File "<the learner's file>", line N``
frames as Python prints them, and never torchrun's own report of the failure.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness import exercise_attempt, grade_in_pairs, make_lessons

from ddp_course import check, postmortem
from ddp_course.check import exercises
from ddp_course.paths import show

EXERCISES = list(exercises())
# torchrun's own report of a failed job: none of it may reach a verdict
LAUNCHER = ("ChildFailedError", "error_file", "elastic/errors.html", "Root Cause", "torch/distributed/run.py")
BEGIN = re.compile(r"^([ \t]*)#\s*BEGIN SOLUTION\b")
ON_RANK_1 = '__import__("os").environ.get("RANK") == "1"'


def attempt(tmp_path: Path, name: str, line: str, *, top: bool = False) -> tuple[Path, int]:
    """The answered exercise ``name`` with ``line`` as the first statement of its first answer (or the
    first line of the file, ``top``), as ``tmp_path/<name>/<its script>``; and that line's number."""
    ex = exercises()[name]
    src = (Path(check.__file__).parents[2] / "solutions" / "exercises" / ex.script).read_text(encoding="utf-8")
    lines = src.splitlines(keepends=True)
    if top:
        lines.insert(0, line + "\n")
    else:
        i = next(i for i, ln in enumerate(lines) if BEGIN.match(ln))
        body = lines[i + 1]
        lines.insert(i + 1, body[: len(body) - len(body.lstrip())] + line + "\n")
    answered = make_lessons().answer_source("".join(lines), ex.script)
    path = tmp_path / name / ex.script
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(answered, encoding="utf-8")
    return path, answered.splitlines().index(next(ln for ln in answered.splitlines() if ln.strip() == line)) + 1


def frame(path: Path, line: int) -> str:
    return f'File "{show(path)}", line {line}'


def no_launcher(message: str) -> None:
    found = [s for s in LAUNCHER if s in message]
    assert not found, f"torchrun's report in the verdict ({found}):\n{message}"


NAME_ERROR = f"answer = undefined_answer_name if {ON_RANK_1} else None"
HANG_LINE = f'while {ON_RANK_1}: __import__("time").sleep(0.1)'
IMPORT_ERROR = "from torch.distributed import all_reducee"
ONE_RANK_ONLY = 'if __import__("os").environ.get("RANK") == "0": dist.all_reduce(torch.ones(1))'
# The hang attempts' collectives wait this long for rank 1 (the graders allow 20 s; the ranks of a job
# reach their first collective within a few seconds of each other, even with six jobs side by side)
COLLECTIVE_S = 15
# ... and the grader stops a job none of whose processes works for this long (it allows 30 s): later
# than the collective timeout, so that a "hang" is answered by the timeout
STALL_S = 22
# exercise 14's ring step with the blocking calls, every rank sending first (lesson 14, section 8), and every
# rank receiving first
SEND_FIRST = ("    received = torch.empty_like(t)\n    dist.send(t.contiguous(), send_to)\n"
              "    dist.recv(received, recv_from)\n    return received\n")
RECV_FIRST = ("    received = torch.empty_like(t)\n    dist.recv(received, recv_from)\n"
              "    dist.send(t.contiguous(), send_to)\n    return received\n")
# exercise 04's learner joins the process group with a timeout of their own: the hang attempt sets it
OWN_TIMEOUT = ("timedelta(seconds=60)", f"timedelta(seconds={COLLECTIVE_S})")
# A NameError and a hang are tried on one exercise for each way a job is started and graded: the
# harness joining the process group through dist.setup and graded by check.run_exercise (01); the
# learner's own process group (04); a device mesh (13, on 4 ranks); the grader's own launch, a crash
# and a restart (08); DataLoader worker processes beside the ranks (10); and a hang in point-to-point
# sends on 4 ranks (exercise 14's ring, every rank sending first: below). Every other exercise joins
# and is graded as 01 is (test_every_exercise_not_in_ways_is_started_and_graded_as_one_is checks it),
# so its error takes the path 01's takes: each attempt costs a job of two or four processes.
WAYS = ["01_global_val_loss", "04_ddp_convert", "08_save_load", "10_dataloader", "13_two_d_plan"]


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    """The verdicts on the exercises of ``WAYS`` with a NameError on rank 1 and with rank 1 stuck
    in its first answer, on a misspelled import and on a collective called by rank 0 only:
    {("name error" | "hang" | "stall" | "import" | "one rank", exercise): ((path, line), verdict, seconds)}.

    In a "hang" the process group's own timeout fires (``COLLECTIVE_S``, set the way a grader sets
    its own); in the "stall" (exercise 04 as answered, whose process group waits 60 s) no timeout
    fires first, and the grader stops the job when no process has used the CPU for ``STALL_S``. A
    hanging job spends its time waiting, so the hangs are graded all at once in the background
    while the NameError attempts are graded two at a time beside them.
    """
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ddp_course.dist import COLLECTIVE_TIMEOUT_VAR

    def timed(name: str, path: Path) -> tuple[object, float]:
        start = time.monotonic()
        verdict = check.grade(name, path)
        return verdict, time.monotonic() - start

    tmp = tmp_path_factory.mktemp("wrong")
    hangs = {("hang", name): attempt(tmp / "hang", name, HANG_LINE) for name in WAYS}
    path04 = hangs["hang", "04_ddp_convert"][0]
    hangs["stall", "04_ddp_convert"] = attempt(tmp / "stall", "04_ddp_convert", HANG_LINE)
    (tmp / "send_first").mkdir()
    hangs["send first", "14_ring_attention"] = (exercise_attempt(tmp / "send_first", "14_ring_attention.py",
                                                                 "pass_on", SEND_FIRST), 0)
    (tmp / "recv_first").mkdir()
    hangs["recv first", "14_ring_attention"] = (exercise_attempt(tmp / "recv_first", "14_ring_attention.py",
                                                                 "pass_on", RECV_FIRST), 0)
    path04.write_text(path04.read_text(encoding="utf-8").replace(*OWN_TIMEOUT), encoding="utf-8")
    saved, idle_s = os.environ.get(COLLECTIVE_TIMEOUT_VAR), check.verdicts.IDLE_S
    os.environ[COLLECTIVE_TIMEOUT_VAR] = str(COLLECTIVE_S)
    check.verdicts.IDLE_S = STALL_S
    try:
        with ThreadPoolExecutor(max_workers=len(hangs)) as background:
            waiting = {key: background.submit(timed, key[1], path) for key, (path, _) in hangs.items()}
            errors = {("name error", name): attempt(tmp / "name_error", name, NAME_ERROR) for name in WAYS}
            errors["import", "06_no_sync"] = attempt(tmp / "import", "06_no_sync", IMPORT_ERROR, top=True)
            errors["one rank", "01_global_val_loss"] = attempt(tmp / "one_rank", "01_global_val_loss", ONE_RANK_ONLY)
            verdicts = grade_in_pairs(lambda p: check.grade(p.stem, p), {k: p for k, (p, _) in errors.items()})
            found = {key: (errors[key], verdicts[key], None) for key in errors}
            found.update({key: (hangs[key], *future.result()) for key, future in waiting.items()})
    finally:
        check.verdicts.IDLE_S = idle_s
        if saved is None:
            os.environ.pop(COLLECTIVE_TIMEOUT_VAR, None)
        else:
            os.environ[COLLECTIVE_TIMEOUT_VAR] = saved
    return found


def test_a_name_error_on_one_rank_names_the_learners_line_in_each_way_a_job_is_graded(graded):
    for name in WAYS:
        (path, n), verdict, _ = graded["name error", name]
        msg = str(verdict)
        assert not verdict.ok, name
        assert "rank 1 raised NameError: name 'undefined_answer_name' is not defined" in msg, f"{name}:\n{msg}"
        assert frame(path, n) in msg and NAME_ERROR in msg, f"{name}: the learner's line {n} is not shown:\n{msg}"
        # what became of the other ranks: on 2 ranks "rank 0 ...", on 4 "ranks 0, 2 and 3 were stopped ..."
        assert re.search(r"rank 0 then lost its peer|ranks 0(, \d)* and \d then lost their peer|rank 0 was stopped|ranks 0(, \d)* and \d were stopped", msg), \
            f"{name}:\n{msg}"
        no_launcher(msg)


@pytest.mark.parametrize("name", EXERCISES)
def test_a_syntax_error_is_reported_before_any_process_starts(tmp_path, monkeypatch, name):
    import ddp_course.launch

    def no_job(*args, **kwargs):
        raise AssertionError("a job was started for a file Python cannot compile")

    monkeypatch.setattr(ddp_course.launch, "run", no_job)
    path, n = attempt(tmp_path, name, "answer = (1 +")
    verdict = check.grade(name, path)
    assert not verdict.ok
    msg = verdict.message
    assert "syntax error" in msg and "SyntaxError: '(' was never closed" in msg, msg
    assert frame(path, n) in msg and "^" in msg, msg


def test_every_exercise_not_in_ways_is_started_and_graded_as_one_is():
    """What makes a crash show the learner's line and a hang end with every rank's line is shared: the
    start-up hook every rank gets, the grader's collective timeout, read by ``dist.setup``, and the crash
    report, stall watch and hang report of ``check.run_exercise``. An exercise left out of ``WAYS``
    must reach them the way 01 does: its script joins through ``setup(`` (never by
    ``init_process_group``), its answers build no group or mesh, and its grader launches it by ``run_exercise``."""
    import importlib
    import inspect

    root = Path(check.__file__).parents[2]
    assert set(WAYS) <= set(EXERCISES)
    for name, ex in exercises().items():
        if name in WAYS:
            continue
        script = (root / "solutions" / "exercises" / ex.script).read_text(encoding="utf-8")
        answers = "".join(re.findall(r"#\s*BEGIN SOLUTION\b(.*?)#\s*END SOLUTION\b", script, flags=re.S))
        assert answers and re.search(r"\bsetup\(", script) and "init_process_group" not in script, name
        assert "init_device_mesh" not in answers and "new_group" not in answers, name  # no group built in an answer
        grader = inspect.getsource(importlib.import_module(ex.module))
        assert "run_exercise(" in grader and not re.search(r"(?<![\w.])run\(", grader), name


def _no_process_left(path: Path) -> list[int]:
    return [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
            if str(path).encode() in _cmdline(pid)] if Path("/proc").is_dir() else []


# Exercise 13's first answer builds the device mesh: rank 1 stuck there leaves the others in
# init_device_mesh's new_group, which waits on the rendezvous store, not under the process group's
# timeout; the grader's stall watch answers that one.
STALLS_FIRST = {"13_two_d_plan"}


@pytest.mark.parametrize("name", [n for n in WAYS if n not in STALLS_FIRST])
def test_a_rank_that_never_arrives_when_the_collective_times_out_shows_every_ranks_line(graded, name):
    """Rank 1 never reaches the collective; the other ranks' process group gives up: the verdict shows
    the line each of them raised at, and rank 1's own line, taken before torchrun stopped it."""
    (path, n), verdict, seconds = graded["hang", name]
    msg = verdict.message
    print(f"{name}: answered in {seconds:.0f} s")
    # gloo's "Timed out waiting 15000ms for recv", or the store's "wait timeout" when rank 1 stops
    # before joining the process group (exercise 04's first answer is its setup)
    assert not verdict.ok and postmortem.TIMED_OUT.search(msg) and "did not finish within" not in msg, msg
    causes, rank1 = msg.split("rank 1 was here when")
    assert re.search(r"ranks? 0( and \d|, \d)*( and \d)? raised", causes), msg
    assert f'File "{show(path)}", line' in causes, msg  # where rank 0 waited, in the learner's file
    assert frame(path, n) in rank1, f"{name}: rank 1's stuck line {n} is not shown:\n{msg}"
    assert "times out when its peer never reaches the matching call" in msg, msg
    no_launcher(msg)
    assert not _no_process_left(path)


@pytest.mark.parametrize("key", [("stall", "04_ddp_convert"), *(("hang", n) for n in sorted(STALLS_FIRST))])
def test_a_rank_that_never_arrives_with_no_timeout_near_is_stopped_when_no_process_works(graded, key):
    """Exercise 04's process group waits 60 s (the learner's own timeout), and exercise 13's mesh waits
    on the store: the grader stops the job once no process has used the CPU for its IDLE_S, with
    where each rank was."""
    (path, n), verdict, seconds = graded[key]
    msg = verdict.message
    print(f"{key[1]} stalled: answered in {seconds:.0f} s")
    assert not verdict.ok and f"no process used the CPU for {STALL_S}s" in msg, msg
    rank0, rank1 = msg.split("rank 0 was at")[1].split("rank 1 was at")
    assert frame(path, n) in rank1, f"rank 1's stuck line {n} is not shown:\n{msg}"
    assert re.search(r"\(waiting inside torch\.distributed\.distributed_c10d\.\w+\)", rank0), msg
    assert f'File "{show(path)}", line' in rank0, msg
    no_launcher(msg)
    assert not _no_process_left(path)


def test_a_ring_step_in_which_every_rank_sends_first_is_named(graded):
    """Exercise 14 with the blocking send before the receive on every rank: no rank gets past its send;
    the verdict shows each rank's send in the learner's file and names the cause."""
    (path, _), verdict, seconds = graded["send first", "14_ring_attention"]
    msg = verdict.message
    print(f"14_ring_attention, every rank sending first: answered in {seconds:.0f} s")
    assert not verdict.ok and "for send operation" in msg and "every rank sent before it received" in msg, msg
    # the rings of 2 ranks come first: in each pair one rank's send times out, and its peer then loses it
    assert re.search(r"ranks? [0-3](, \d)*( and \d)? raised RuntimeError: Timed out waiting", msg), msg
    assert f'File "{show(path)}", line' in msg and "dist.send(t.contiguous(), send_to)" in msg, msg
    no_launcher(msg)
    assert not _no_process_left(path)


def test_a_ring_step_in_which_every_rank_receives_first_is_named(graded):
    """Exercise 14 with the blocking recv before the send on every rank: gloo says only "Timed out waiting ...
    for recv operation to complete"; the verdict says that every rank waited in recv before any rank sent."""
    (path, _), verdict, seconds = graded["recv first", "14_ring_attention"]
    msg = verdict.message
    print(f"14_ring_attention, every rank receiving first: answered in {seconds:.0f} s")
    assert not verdict.ok and "for recv operation" in msg, msg
    assert "every rank waited in recv before any rank sent" in msg and "deadlocks the ring" in msg, msg
    assert "every rank sent before it received" not in msg, msg
    assert f'File "{show(path)}", line' in msg and "dist.recv(received, recv_from)" in msg, msg
    no_launcher(msg)
    assert not _no_process_left(path)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_an_import_error_at_the_top_and_a_collective_on_one_rank(graded):
    (imported, n_import), verdict, _ = graded["import", "06_no_sync"]
    assert "ranks 0 and 1 raised ImportError: cannot import name 'all_reducee'" in verdict.message, verdict.message
    assert frame(imported, n_import) in verdict.message, verdict.message
    (one_rank, n_one), other, _ = graded["one rank", "01_global_val_loss"]
    # gloo pairs rank 0's extra all-reduce with rank 1's next one, of another size, and aborts (or fails)
    assert frame(one_rank, n_one) in other.message and "all_reduce" in other.message, other.message
    for v in (verdict, other):
        no_launcher(v.message)


def test_another_exercises_file_is_named():
    verdict = check.grade("06", "lessons/exercises/04_ddp_convert.py")
    assert not verdict.ok and "looks like the file of exercise 04_ddp_convert" in verdict.message, verdict
    assert "python -m ddp_course check 04 lessons/exercises/04_ddp_convert.py" in verdict.message
    verdict = check.grade("09_fsdp", "lessons/exercises/09_zero1.py")
    assert "looks like the file of exercise 09_zero1" in verdict.message and "check 09_zero1" in verdict.message
    root = Path(check.__file__).parents[2]
    for name, ex in exercises().items():  # every exercise's own file fits it, stub or answered
        for folder in ("lessons", "solutions"):
            assert check.looks_like(root / folder / "exercises" / ex.script, ex) is None, (name, folder)


# --------------------------------------------------------------------------------------------------
# the parts, on made-up input


def test_torchrun_footer_is_removed_and_the_programs_lines_kept():
    output = "\n".join([
        "*****************************************",
        "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid ...",
        "*****************************************",
        "[rank1]: ValueError: mine",
        "E1125 17:10:16.379000 1 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
        "api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 2) of binary: python",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "  error_file: <N/A>",
    ])
    assert postmortem.without_launcher(output) == "[rank1]: ValueError: mine"


def test_a_torch_not_implemented_error_is_an_error_not_a_todo_left(tmp_path):
    class Job:
        postmortem = tmp_path
        output = "NotImplementedError: aten::foo is not implemented for the Meta backend"

    (tmp_path / "attempt0").mkdir()
    (tmp_path / "attempt0" / "rank0.error.json").write_text(
        '{"rank": 0, "type": "NotImplementedError", "module": "builtins", "error": "NotImplementedError: aten::foo",'
        ' "frames": [], "text": ""}')
    assert not check.stub_left(Job())
    (tmp_path / "attempt0" / "rank0.error.json").write_text(
        '{"rank": 0, "type": "NotImplementedError", "module": "builtins", "error": "NotImplementedError: '
        + check.STUB + '", "frames": [], "text": ""}')
    assert check.stub_left(Job())
