"""``python -m ddp_course progress``: where a learner stands, from their files and the grading records.

Each state is built the way a learner gets there -- a copy of ``lessons/`` as shipped, an exercise
graded through the harness's own record writer, a file edited after its verdict -- and the table is
read back. No job runs: a grader stub stands in for the real one (its verdict is what is recorded;
the graders themselves are tested in tests/exercises/). One test runs a notebook exercise in a real
kernel, so that the cell the kernel ran is the one recorded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import ROOT

from ddp_course.check import records
from ddp_course.check.progress import progress
from ddp_course.check.verdicts import Verdict

SCRIPT = "05_my_ddp"


@pytest.fixture
def lessons(tmp_path, monkeypatch) -> Path:
    """A fresh copy of lessons/ (notebooks and exercise scripts, as shipped), the working directory."""
    folder = tmp_path / "lessons"
    shutil.copytree(ROOT / "lessons", folder, ignore=shutil.ignore_patterns("runs", ".ipynb_checkpoints"))
    monkeypatch.chdir(folder)  # where a notebook's kernel runs, and so where a grading cell records
    return folder


def _grade(path: Path, ok: bool, message: str) -> None:
    """Record a verdict on ``path`` exactly as ``check.grade`` does, with a stand-in grader."""
    grader = SimpleNamespace(__name__="stand_in", __file__=__file__, grade=lambda p, timeout=1: Verdict(ok, message))
    records.graded_and_recorded(SCRIPT, path, grader, {}, "")


def _row(table, what: str):
    return next(i for i in table.items if i.what == what)


def test_a_fresh_copy_has_nothing_started_and_next_is_the_first_exercise(lessons):
    t0 = time.perf_counter()
    table = progress(lessons)
    elapsed = time.perf_counter() - t0
    assert {i.state for i in table.items} == {"not started"} and not any(i.changed for i in table.items)
    scripts = sorted(p.name for p in (lessons / "exercises").glob("[0-9][0-9]_*.py"))
    assert sorted(i.what for i in table.items if i.what.startswith("exercises/")) == [f"exercises/{s}" for s in scripts]
    assert len(table.items) - len(scripts) >= 6  # and the exercises inside the notebooks (01, 03, 07, three in 12)
    assert table.next.lesson == "01" and "python -m ddp_course check 01" in table.next_line()
    assert elapsed < 1.0, f"progress took {elapsed:.2f}s: it reads files, it must not start anything"


def _answer(lessons: Path) -> Path:
    """The learner writes an answer in place of the script's stubs."""
    path = lessons / "exercises" / f"{SCRIPT}.py"
    path.write_text(path.read_text().replace('raise NotImplementedError("exercise: complete this part")', "pass"))
    return path


def test_one_exercise_failing_shows_the_verdicts_first_line(lessons):
    _grade(_answer(lessons), False, "the replicas differ after step 1\nmore detail")
    row = _row(progress(lessons), f"exercises/{SCRIPT}.py")
    assert (row.state, row.why, row.changed) == ("failing", "the replicas differ after step 1", False)
    assert row.status().startswith("failing ") and row.when is not None
    assert progress(lessons).next.lesson == "01"  # lesson 01 has work left before lesson 05


def test_one_exercise_passed(lessons):
    path = _answer(lessons)
    _grade(path, False, "the replicas differ after step 1")
    _grade(path, True, "every rank equals the reference")  # the same bytes graded again: the newer verdict
    row = _row(progress(lessons), f"exercises/{SCRIPT}.py")
    assert (row.state, row.changed, row.done) == ("passed", False, True)
    assert sum(i.done for i in progress(lessons).items) == 1


def test_one_exercise_edited_after_passing(lessons):
    path = _answer(lessons)
    _grade(path, True, "every rank equals the reference")
    path.write_text(path.read_text() + "\n# a comment: the bytes changed\n")
    row = _row(progress(lessons), f"exercises/{SCRIPT}.py")
    assert (row.state, row.changed, row.done) == ("passed", True, False)
    assert "changed since last graded" in str(progress(lessons))


def test_written_but_never_graded_is_not_checked(lessons):
    _answer(lessons)
    assert _row(progress(lessons), f"exercises/{SCRIPT}.py").state == "not checked"


def test_a_notebook_exercise_edited_after_passing(lessons):
    """The digest is of the cell's code: a new comment is not a change, a new statement is."""
    nb_path = lessons / "03_data_parallel.ipynb"
    nb = json.loads(nb_path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code" and "def my_reduce" in "".join(c["source"]))
    answer = "def my_reduce(replicas):\n    for r in replicas[1:]:\n        pass  # the answer\n"
    cell["source"] = answer
    nb_path.write_text(json.dumps(nb))
    heading = next(i.what for i in progress(lessons).items if i.name == "03_my_reduce")
    assert _row(progress(lessons), heading).state == "not checked"
    records.note_notebook_verdict("03", "my_reduce", Verdict(True, "equal to one device"), cell="# mine\n" + answer)
    assert (_row(progress(lessons), heading).state, _row(progress(lessons), heading).changed) == ("passed", False)
    cell["source"] = answer + "print('another statement')\n"
    nb_path.write_text(json.dumps(nb))
    assert _row(progress(lessons), heading).changed


def test_a_check_cell_in_a_kernel_records_the_cell_it_ran(lessons):
    """Lesson 03's exercise answered and its check cell run in a real kernel (nbclient, as JupyterLab
    runs a notebook): the record carries the digest of the cell the kernel ran, so the table shows it
    passed and unchanged once the notebook is saved with that cell. Under ``make test`` the learner's
    notebooks did exactly that in this session (build/learner): their record is read instead."""
    import nbformat
    import notebook_runs
    from nbclient import NotebookClient

    ran = notebook_runs.folder(".")
    if ran is not None and notebook_runs.fresh(ran / "runs" / "check" / "03_my_reduce.json"):
        row = next(i for i in progress(ran).items if i.name == "03_my_reduce")
        assert (row.state, row.changed) == ("passed", False), row
        return

    nb_path = lessons / "03_data_parallel.ipynb"
    nb = nbformat.read(nb_path, as_version=4)
    solved = nbformat.read(ROOT / "solutions" / "03_data_parallel.ipynb", as_version=4)
    from ddp_course.check import rewrite

    index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "def my_reduce" in c.source)
    answer = rewrite.transform_cell_source(next(c.source for c in solved.cells if "def my_reduce" in c.source),
                                           "03", answered=True)
    nb.cells[index].source = answer
    check = nb.cells[index + 1].source
    run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import torch.nn as nn\nfrom ddp_course.course.l03_data_parallel import dp_mechanism as dpm"),
        nbformat.v4.new_code_cell(answer), nbformat.v4.new_code_cell(check)])
    NotebookClient(run, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(lessons)}}).execute()
    nbformat.write(nb, nb_path)  # the learner saves the notebook
    row = next(i for i in progress(lessons).items if i.name == "03_my_reduce")
    assert (row.state, row.changed) == ("passed", False), row


def test_the_command_prints_the_table_and_refuses_a_folder_that_is_not_one(lessons, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "ddp_course", "progress", str(lessons)], capture_output=True, text=True)
    assert ok.returncode == 0 and "0 of" in ok.stdout and "next: lesson 01" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "ddp_course", "progress", str(tmp_path / "nowhere")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "workspace" in bad.stderr


def test_every_lesson_notebook_ends_with_the_table():
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        last = json.loads(path.read_text())["cells"][-1]
        assert last["cell_type"] == "code" and "progress()" in "".join(last["source"]), path.name


def test_the_learners_notebooks_run_by_make_test_leave_every_exercise_they_graded_passed():
    """``make test`` runs the learner's completed notebooks (build/learner) first; every exercise they
    graded in this session -- scripts through ``check.grade``, notebook exercises through their check
    cells in the kernel -- is passed and unchanged in the table of that folder. (Run alone, without the
    notebooks, nothing was graded in this session and there is nothing to compare.)"""
    import notebook_runs

    folder = notebook_runs.folder(".")
    if folder is None:
        return
    table = progress(folder)
    graded = [i for i in table.items if i.when is not None and i.when >= notebook_runs.SESSION_START]
    assert [(i.name, i.status()) for i in graded if not i.done] == []
    names = {i.name for i in graded}
    assert {"01_causal_attention", "03_my_reduce", "07_amp_step", "12_answer_a"} <= names, sorted(names)
