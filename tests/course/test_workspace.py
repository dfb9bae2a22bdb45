"""The learner's workspace (``ddp_course/check/workspace.py``, ``update.py``): where it is found, what an
update writes and what it never writes, what a reset keeps, and that ``check`` and ``progress`` find the
same workspace from any folder. No job runs: grading is tried on files that stop before any job (a stub
left), and a course is played by a dict of files where the rules need one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import ROOT

from ddp_course import check
from ddp_course.check import update as updates
from ddp_course.check import workspace
from ddp_course.check.progress import progress


def notebook(*sources: str, outputs: bool = False) -> str:
    cells = [{"cell_type": "code", "execution_count": 1 if outputs else None, "metadata": {}, "source": [s],
              "outputs": [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}] if outputs else []}
             for s in sources]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1) + "\n"


COURSE = {"01_a.ipynb": notebook("x = 1"), "02_b.ipynb": notebook("y = 2"), "exercises/01_a.py": "def f():\n    pass\n"}


@pytest.fixture
def folder(tmp_path) -> Path:
    return tmp_path / "work"


def test_an_update_copies_everything_once_then_finds_nothing_to_do(folder):
    first = updates.update(folder, dict(COURSE))
    assert first.made and sorted(first.new) == sorted(COURSE)
    assert all((folder / rel).read_text() == text for rel, text in COURSE.items())
    assert "up to date" in str(updates.update(folder, dict(COURSE)))


def test_the_course_changes_what_the_learner_did_not_touch_and_only_lists_what_they_changed(folder):
    updates.update(folder, dict(COURSE))
    (folder / "exercises/01_a.py").write_text("def f():\n    return 42  # mine\n")
    (folder / "02_b.ipynb").write_text(notebook("y = 2", outputs=True))  # only run: sources as copied
    later = {**COURSE, "01_a.ipynb": notebook("x = 10"), "02_b.ipynb": notebook("y = 20"),
             "exercises/01_a.py": "def f():\n    pass\n# the course's fix\n", "03_c.ipynb": notebook("z = 3")}
    report = updates.update(folder, later)
    assert report.new == ["03_c.ipynb"] and report.updated == ["01_a.ipynb"] and report.kept == ["exercises/01_a.py"]
    assert (folder / "exercises/01_a.py").read_text() == "def f():\n    return 42  # mine\n"  # never written over
    assert (folder / "01_a.ipynb").read_text() == later["01_a.ipynb"]
    [(rel, kept)] = report.ran  # the run notebook: updated, the run kept with its outputs
    assert rel == "02_b.ipynb" and (folder / "02_b.ipynb").read_text() == later["02_b.ipynb"]
    assert (folder / kept).read_text() == notebook("y = 2", outputs=True) and kept.startswith("backups/")
    text = str(report)
    assert "exercises/01_a.py" in text and "update --diff NAME" in text and "reset NAME" in text
    diff = updates.diff(folder, "exercises/01_a.py", later)
    assert "+# the course's fix" in diff and "return 42" not in diff  # the course's change, not the learner's
    assert updates.update(folder, later).kept == ["exercises/01_a.py"]  # listed again until taken


def test_a_file_there_before_the_course_brought_it_is_kept_and_a_deleted_one_comes_back(folder):
    updates.update(folder, dict(COURSE))
    (folder / "exercises/01_a.py").unlink()
    (folder / "04_d.ipynb").write_text("my own notes")
    report = updates.update(folder, {**COURSE, "04_d.ipynb": notebook("w = 4")})
    assert report.restored == ["exercises/01_a.py"] and report.theirs == ["04_d.ipynb"]
    assert (folder / "04_d.ipynb").read_text() == "my own notes"
    gone = updates.update(folder, {k: v for k, v in {**COURSE, "04_d.ipynb": ""}.items() if k != "02_b.ipynb"})
    assert gone.gone == ["02_b.ipynb"] and (folder / "02_b.ipynb").is_file()


def test_a_reset_moves_the_learners_file_and_its_records_to_a_backup(folder):
    updates.update(folder, dict(COURSE))
    (folder / "exercises/01_a.py").write_text("mine")
    records = folder / check.RECORDS
    records.mkdir(parents=True)
    (records / "01_a.json").write_text("{}")
    (records / "02_other.json").write_text("{}")
    said = updates.reset(folder, ["exercises/01_a.py"], dict(COURSE))
    kept = next((folder / workspace.BACKUPS).iterdir())
    assert (kept / "exercises/01_a.py").read_text() == "mine" and (kept / check.RECORDS / "01_a.json").is_file()
    assert (folder / "exercises/01_a.py").read_text() == COURSE["exercises/01_a.py"]
    assert (records / "02_other.json").is_file() and not (records / "01_a.json").exists()
    assert f"moved to {workspace.BACKUPS}/" in said and "exercises/01_a.py" in said


def test_names_a_reset_takes_and_a_name_that_fits_several(folder, monkeypatch):
    course = {"05_inside_ddp.ipynb": "", "exercises/05_my_ddp.py": "", "exercises/09_zero1.py": ""}
    monkeypatch.chdir(folder.parent)
    for name in ("exercises/05_my_ddp.py", "05_my_ddp", "05_my_ddp.py", "work/exercises/05_my_ddp.py"):
        assert updates.resolve(name, course, folder) == ["exercises/05_my_ddp.py"], name
    assert updates.resolve("05_inside_ddp", course, folder) == ["05_inside_ddp.ipynb"]
    with pytest.raises(ValueError, match="could be any of 05_inside_ddp.ipynb, exercises/05_my_ddp.py"):
        updates.resolve("05", course, folder)
    with pytest.raises(ValueError, match="not a notebook or an exercise"):
        updates.resolve("nothing", course, folder)


def test_the_course_own_folders_are_never_made_into_a_workspace(monkeypatch, capsys):
    for folder in (ROOT, ROOT / "solutions", ROOT / "lessons", ROOT / "build" / "learner"):
        assert workspace.refusal(folder) is not None, folder
    assert workspace.refusal(ROOT / "work") is None
    monkeypatch.chdir(ROOT / "solutions")
    assert updates.main("update", []) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: solutions/ is a folder of the course itself") and err.count("\n") == 1


def test_edits_made_in_lessons_before_there_were_workspaces_move_into_the_new_one(folder, monkeypatch, tmp_path):
    root = tmp_path / "checkout"
    (root / "lessons").mkdir(parents=True)
    (root / "lessons" / "01_a.ipynb").write_text(notebook("x = 1  # edited in lessons/"))
    monkeypatch.setattr(updates, "ROOT", root)
    report = updates.update(folder, dict(COURSE))
    assert report.moved_in == ["01_a.ipynb"] and "git checkout lessons/" in str(report)
    assert "edited in lessons/" in (folder / "01_a.ipynb").read_text()
    later = {**COURSE, "01_a.ipynb": notebook("x = 100")}
    assert updates.update(folder, later).kept == ["01_a.ipynb"]  # the learner's, and so never written over


def test_grades_kept_before_there_were_workspaces_are_copied_in(tmp_path, monkeypatch):
    root, folder = tmp_path / "checkout", tmp_path / "work"
    old = {"exercise": "01_a", "verdicts": [{"file": "lessons/exercises/01_a.py", "sha256": "x", "ok": True,
                                             "started": 1.0, "message": "PASS"}]}
    for place in (root / "lessons" / check.RECORDS, root / check.RECORDS):
        place.mkdir(parents=True)
        (place / "01_a.json").write_text(json.dumps(old))
    monkeypatch.setattr(updates, "ROOT", root)
    report = updates.update(folder, dict(COURSE))
    assert report.grades == 1 and "earlier grades (1 verdict," in str(report)  # the same verdict, once
    [entry] = json.loads((folder / check.RECORDS / "01_a.json").read_text())["verdicts"]
    assert entry["file"] == "exercises/01_a.py" and entry["ok"]
    assert updates.update(folder, dict(COURSE)).grades == 0  # only when the workspace is made


# --- one workspace, from any folder ------------------------------------------------------------------------

@pytest.fixture
def learner(tmp_path, monkeypatch) -> Path:
    """A workspace made from this course, named by $DDP_COURSE_WORK (as `make lab` names it)."""
    folder = tmp_path / "my work"
    updates.update(folder)
    monkeypatch.setenv(workspace.VAR, str(folder))
    return folder


def test_check_and_progress_find_the_same_workspace_from_every_folder(learner, tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for here in (ROOT, learner, learner / "exercises", ROOT / "lessons", ROOT / "lessons" / "exercises", elsewhere):
        monkeypatch.chdir(here)
        assert workspace.home() == learner.resolve(), here
        assert progress().folder == learner.resolve()
        assert check.main(["01"]) == 1, here  # the workspace's copy, still a stub: graded, no job started
        assert str(learner / "exercises" / "01_global_val_loss.py") in capsys.readouterr().out


def test_every_command_progress_prints_runs_as_printed_from_the_notebooks_folder(learner, monkeypatch, capsys):
    monkeypatch.chdir(learner)
    commands = [i.todo for i in progress().items if i.todo.startswith("python -m ddp_course ")]
    assert len(commands) == len(check.exercises())
    for command in commands:
        assert check.main(command.split()[4:]) == 1, command  # not complete: the stub is still there
        assert "exercise not complete" in capsys.readouterr().out, command


def test_a_wrong_path_names_the_learners_copy_and_a_command_that_works(learner, monkeypatch, capsys):
    monkeypatch.chdir(learner)
    assert check.main(["01", "lessons/exercises/01_global_val_loss.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`python -m ddp_course check 01` grades it from any folder" in err
    assert "exercises/01_global_val_loss.py" in err


def test_no_workspace_yet_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(workspace.VAR, str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)
    assert check.main(["01"]) == 2 and "python -m ddp_course update" in capsys.readouterr().err
    from ddp_course.check.progress import main as progress_main

    assert progress_main([]) == 2 and "no workspace yet" in capsys.readouterr().err


def test_the_suite_has_a_workspace_of_its_own():
    """conftest names an empty folder of this session's: nothing the suite grades lands in the learner's."""
    named = Path(os.environ[workspace.VAR])
    assert named != ROOT / "work" and ROOT not in named.parents
