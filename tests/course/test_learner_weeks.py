"""A learner's weeks with the course, played end to end in a clone of it.

The course's repository is cloned twice into a temporary folder whose name has a space: ``upstream``
plays the course's own repository, and ``my course`` the learner's checkout of it. In the learner's:
set-up makes the workspace (``make workspace``, what ``make lab`` runs before JupyterLab opens there),
an exercise is answered and a notebook is saved with outputs, as JupyterLab saves it; the exercise is
graded from the notebook's folder, for real, and ``progress`` run from the checkout's top shows that
verdict. Then the course moves on: upstream gains a lesson and changes the very exercise the learner
answered. ``git pull`` must go through untouched by the learner's work, and ``python -m ddp_course
update`` must bring the new lesson in, leave the learner's answer as it is and list the changed
exercise. Last, the checks of ``make test`` that a learner's edits used to break pass in that clone,
and the workspace is byte for byte what the learner left.

The clone runs this Python, with the clone's own package first on its path (``python -m`` from the
clone's top, ``PYTHONPATH`` elsewhere): its ``ddp_course`` is the one of the clone, so the workspace
it finds is the clone's, never this checkout's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, course_env

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None,
                                reason="needs git and make, as the README's set-up does")


def run(cmd: list[str], cwd: Path, clone: Path, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    env = {**course_env(), "PYTHONPATH": str(clone), "GIT_AUTHOR_NAME": "course", "GIT_AUTHOR_EMAIL": "c@example.org",
           "GIT_COMMITTER_NAME": "course", "GIT_COMMITTER_EMAIL": "c@example.org"}
    env.pop("DDP_COURSE_WORK", None)  # the learner has not named a workspace: work/ of the checkout
    env.pop("DDP_COURSE_NOTEBOOK_RUNS", None)  # the clone's tests are not this session's
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} (in {cwd}) exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def saved_by_jupyterlab(path: Path) -> None:
    """The notebook as JupyterLab saves it once its first code cells have run: outputs, execution counts,
    the kernel's language_info, per-cell execution timestamps."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code[:3], start=1):
        cell["execution_count"] = n
        cell["outputs"] = [{"name": "stdout", "output_type": "stream", "text": [f"output of cell {n}\n"]}]
        cell["metadata"]["execution"] = {"iopub.status.idle": "2026-11-28T10:00:00.000Z"}
    nb["metadata"]["language_info"] = {"name": "python", "version": sys.version.split()[0]}
    path.write_text(json.dumps(nb, indent=1) + "\n", encoding="utf-8")


def test_a_learners_weeks(tmp_path):
    py = sys.executable
    upstream, mine = tmp_path / "upstream", tmp_path / "my course"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(upstream)], check=True, timeout=60)
    subprocess.run(["git", "clone", "--quiet", str(upstream), str(mine)], check=True, timeout=60)
    work = mine / "work"

    # set-up: `make lab`'s first step makes the workspace (set-up itself stands in: this Python)
    stamp = tmp_path / "installed"
    stamp.touch()
    made = run(["make", "--no-print-directory", "workspace", f"PY={py}", f"STAMP={stamp}"], mine, mine)
    assert "Made your workspace: work/" in made.stdout, made.stdout
    assert (work / "01_minigpt.ipynb").is_file() and (work / "exercises" / "01_global_val_loss.py").is_file()

    # the learner answers exercise 01 and runs lesson 01 in JupyterLab, which saves it with outputs
    script = work / "exercises" / "01_global_val_loss.py"
    answer = (mine / "solutions" / "exercises" / "01_global_val_loss.py").read_text(encoding="utf-8")
    script.write_text(answer.replace("# BEGIN SOLUTION", "# my answer").replace("# END SOLUTION", ""), encoding="utf-8")
    saved_by_jupyterlab(work / "01_minigpt.ipynb")
    graded = run([py, "-m", "ddp_course", "check", "01"], work, mine, timeout=300)  # from the notebook's folder
    assert graded.stdout.startswith("PASS"), graded.stdout
    table = run([py, "-m", "ddp_course", "progress"], mine, mine).stdout  # from the checkout's top
    assert "Exercises in work/: 1 of" in table, table
    row = next(line for line in table.splitlines() if "exercises/01_global_val_loss.py" in line)
    assert "passed" in row and "changed" not in row, table
    assert run(["git", "status", "--porcelain"], mine, mine).stdout == ""  # nothing of git's was touched
    left = snapshot(work)

    # the course moves on: a new lesson, and a change to the very exercise the learner answered
    new = json.loads((upstream / "solutions" / "00_setup.ipynb").read_text(encoding="utf-8"))
    new["cells"] = [{"cell_type": "markdown", "id": "new", "metadata": {}, "source": ["# 15. A new lesson\n"]},
                    {"cell_type": "code", "id": "table", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": ["from ddp_course.check.progress import progress\n", "\n", "progress()"]}]
    (upstream / "solutions" / "15_new_lesson.ipynb").write_text(json.dumps(new, indent=1) + "\n", encoding="utf-8")
    exercise = upstream / "solutions" / "exercises" / "01_global_val_loss.py"
    exercise.write_text(exercise.read_text(encoding="utf-8") + "\n# A line the course added later.\n", encoding="utf-8")
    run([py, "tools/make_lessons.py"], upstream, upstream)
    run(["git", "add", "-A"], upstream, upstream)
    run(["git", "commit", "--quiet", "-m", "A new lesson; exercise 01 changed"], upstream, upstream)

    pulled = run(["git", "pull", "--quiet", "--ff-only"], mine, mine)
    assert pulled.returncode == 0
    updated = run([py, "-m", "ddp_course", "update"], work / "exercises", mine).stdout  # from an exercise's folder
    assert "new from the course (1): 15_new_lesson.ipynb" in updated, updated
    assert (work / "15_new_lesson.ipynb").is_file()
    kept = updated.split("changed by the course since you copied them")[1]
    assert "exercises/01_global_val_loss.py" in kept and "--diff" in kept and "reset" in kept, updated
    assert script.read_text(encoding="utf-8") == left["exercises/01_global_val_loss.py"].decode()  # intact
    assert (work / "01_minigpt.ipynb").read_bytes() == left["01_minigpt.ipynb"]  # the course did not change it
    diff = run([py, "-m", "ddp_course", "update", "--diff", "01_global_val_loss"], mine, mine).stdout
    assert "+# A line the course added later." in diff, diff

    # what `make test` checks of a checkout the learner lives in: lessons/ in sync, git clean, and the suite's
    # own grading and progress tests leaving the workspace exactly as the learner left it
    before = snapshot(work)
    run([py, "tools/make_lessons.py", "--check"], mine, mine)
    assert run(["git", "status", "--porcelain"], mine, mine).stdout == ""
    suite = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                 "tests/course/test_lessons_tools.py::test_lessons_in_sync_with_solutions",
                 "tests/course/test_workspace.py"], mine, mine, timeout=300)
    assert " passed" in suite.stdout and "failed" not in suite.stdout, suite.stdout
    assert snapshot(work) == before
