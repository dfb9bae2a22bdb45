"""A learner who is wrong in an ordinary way sees their own error, file and line, for every exercise.

Each case starts from the answered exercise and breaks it the way learners do, inside the first
answer (a TODO's body): a name that does not exist (on rank 1 only, so the other rank is a
bystander), a syntax error, a rank that never joins the next collective (a hang), a misspelled
import at the top, a collective called by one rank only. The verdict must name the exception (or,
for a hang, the line each rank waits at and the collective), in ``File "<the learner's file>", line N``
frames as Python prints them, and never torchrun's own report of the failure.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness import grade_in_pairs, make_lessons

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


def test_a_name_error_on_one_rank_names_the_learners_line_in_every_exercise(tmp_path):
    line = f"answer = undefined_answer_name if {ON_RANK_1} else None"
    attempts = {name: attempt(tmp_path, name, line) for name in EXERCISES}
    verdicts = grade_in_pairs(lambda p: check.grade(p.stem, p), {n: p for n, (p, _) in attempts.items()})
    for name, (path, n) in attempts.items():
        msg = str(verdicts[name])
        assert not verdicts[name].ok, name
        assert "rank 1 raised NameError: name 'undefined_answer_name' is not defined" in msg, f"{name}:\n{msg}"
        assert frame(path, n) in msg and line in msg, f"{name}: the learner's line {n} is not shown:\n{msg}"
        assert "rank 0 then lost its peer" in msg or "rank 0 was stopped" in msg, f"{name}:\n{msg}"
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


HANGS = ("05_my_ddp", "10_dataloader")


def test_a_rank_that_never_joins_shows_where_each_rank_waits(tmp_path):
    """Two exercises, each with rank 1 stuck in its TODO; graded side by side (both jobs mostly wait)."""
    attempts = {name: attempt(tmp_path, name, f'while {ON_RANK_1}: __import__("time").sleep(0.1)')
                for name in HANGS}
    verdicts = grade_in_pairs(lambda p: check.grade(p.stem, p, timeout=25), {n: p for n, (p, _) in attempts.items()})
    for name, (path, n) in attempts.items():
        verdict = verdicts[name]
        msg = verdict.message
        assert not verdict.ok and "did not finish within 25s" in msg, msg
        rank0, rank1 = msg.split("rank 0 was at")[1].split("rank 1 was at")
        assert frame(path, n) in rank1, f"{name}: rank 1's stuck line {n} is not shown:\n{msg}"
        assert re.search(r"\(waiting inside torch\.distributed\.distributed_c10d\.(broadcast|barrier|all_reduce)\)",
                         rank0), msg
        assert f'File "{show(path)}", line' in rank0, msg  # rank 0's own line in the learner's file
        no_launcher(msg)
        left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if str(path).encode() in _cmdline(pid)] if Path("/proc").is_dir() else []
        assert not left, f"{name}: processes left after the timeout: {left}"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_an_import_error_at_the_top_and_a_collective_on_one_rank(tmp_path):
    imported, n_import = attempt(tmp_path / "a", "06_no_sync", "from torch.distributed import all_reducee", top=True)
    one_rank, n_one = attempt(tmp_path / "b", "01_global_val_loss",
                              'if __import__("os").environ.get("RANK") == "0": dist.all_reduce(torch.ones(1))')
    verdicts = grade_in_pairs(lambda p: check.grade(p.stem, p), {"import": imported, "one rank": one_rank})
    msg = verdicts["import"].message
    assert "ranks 0 and 1 raised ImportError: cannot import name 'all_reducee'" in msg, msg
    assert frame(imported, n_import) in msg, msg
    msg = verdicts["one rank"].message
    # gloo pairs rank 0's extra all-reduce with rank 1's next one, of another size, and aborts (or fails)
    assert frame(one_rank, n_one) in msg and "all_reduce" in msg, msg
    for v in verdicts.values():
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
