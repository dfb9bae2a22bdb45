"""The lesson generator (ddp_course.check.rewrite, tools/make_lessons.py its command line) and the check that lessons/ matches solutions/."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from harness import ROOT
from nbformat import v4

from ddp_course.check import rewrite as ml  # noqa: E402 -- the rewrite; tools/make_lessons.py is its command line

_spec = importlib.util.spec_from_file_location("make_lessons", ROOT / "tools" / "make_lessons.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)
RAISE = 'raise NotImplementedError("exercise: complete this part")'


def test_region_replaced_with_hint_at_begin_indentation():
    src = ("def step(grad, world_size):\n"
           "    x = 1\n"
           "    # BEGIN SOLUTION hint: use dist.all_reduce\n"
           "    dist.all_reduce(grad)\n"
           "        # deeper lines inside the region go too\n"
           "    grad /= world_size\n"
           "    # END SOLUTION\n"
           "    return grad\n")
    assert ml.transform_source(src, "ex.py") == (
        "def step(grad, world_size):\n"
        "    x = 1\n"
        "    # TODO: use dist.all_reduce\n"
        f"    {RAISE}\n"
        "    return grad\n")


def test_region_without_hint_and_several_regions():
    src = "# BEGIN SOLUTION\na = 1\n# END SOLUTION\nb = 2\n\tif b:\n\t\t# BEGIN SOLUTION\n\t\tc = 3\n\t\t# END SOLUTION\n"
    out = ml.transform_source(src, "ex.py")
    assert out == (f"# TODO: your code here\n{RAISE}\nb = 2\n\tif b:\n"
                   f"\t\t# TODO: your code here\n\t\t{RAISE}\n")


def test_source_without_markers_is_unchanged():
    src = "import torch\n\nx = torch.ones(2)  # no answer here\n"
    assert ml.transform_source(src) == src


@pytest.mark.parametrize("src, line, words", [
    ("# BEGIN SOLUTION\na = 1\n# BEGIN SOLUTION\nb = 2\n# END SOLUTION\n# END SOLUTION\n", 3, "cannot nest"),
    ("a = 1\n# END SOLUTION\n", 2, "without a '# BEGIN SOLUTION'"),
    ("a = 1\n  # BEGIN SOLUTION hint: x\nb = 2\n", 2, "never closed"),
    ("# BEGIN SOLUTION\na = 1\n# END SOLUTION here\n", 3, "malformed"),
    ("a = 1\n# SOLUTION CELL\n", 2, "first line of a notebook code cell"),
])
def test_unbalanced_or_misplaced_markers_name_file_and_line(src, line, words):
    with pytest.raises(ml.MarkerError) as err:
        ml.transform_source(src, "solutions/exercises/ex1.py")
    assert f"solutions/exercises/ex1.py:{line}:" in str(err.value)
    assert words in str(err.value)


def _solution_notebook() -> nbformat.NotebookNode:
    nb = v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["widgets"] = {"state": {}}
    md = v4.new_markdown_cell("## All-reduce\n\n```python\n# BEGIN SOLUTION\n```")
    region = v4.new_code_cell("x = 1\nfor i in range(2):\n    # BEGIN SOLUTION hint: add i\n    x += i\n    # END SOLUTION\nx",
                              execution_count=3, outputs=[v4.new_output("execute_result", {"text/plain": "2"},
                                                                        execution_count=3)],
                              metadata={"tags": ["keep"], "execution": {"iopub.status.busy": "2024"}})
    whole = v4.new_code_cell("# SOLUTION CELL hint: build the optimizer\nopt = make()\nopt.step()", execution_count=4)
    only = v4.new_code_cell("assert x == 2", metadata={"tags": ["solution-only"]}, execution_count=5,
                            outputs=[v4.new_output("stream", text="ok\n")])
    plain = v4.new_code_cell("print('hello')", execution_count=6, outputs=[v4.new_output("stream", text="hello\n")])
    nb.cells = [md, region, whole, only, plain]
    return nb


def test_notebook_transform():
    sol = _solution_notebook()
    before = nbformat.writes(sol)
    nb = ml.transform_notebook(sol, "solutions/01.ipynb")
    assert nbformat.writes(sol) == before  # the solution object is not modified

    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "code", "code"]  # solution-only dropped
    assert all("solution-only" not in c.metadata.get("tags", []) for c in nb.cells)
    md, region, whole, plain = nb.cells
    assert md.source == sol.cells[0].source and md.metadata == sol.cells[0].metadata  # unchanged, marker text too
    assert region.source == f"x = 1\nfor i in range(2):\n    # TODO: add i\n    {RAISE}\nx"
    assert whole.source == f"# TODO: build the optimizer\n{RAISE}"
    assert plain.source == "print('hello')"
    for cell in (region, whole, plain):
        assert cell.outputs == [] and cell.execution_count is None
    assert region.metadata == {"tags": ["keep"]}  # author metadata kept, run timestamps dropped
    assert nb.metadata == {"kernelspec": sol.metadata["kernelspec"]}  # run state (widgets) dropped
    nbformat.validate(nb)


def test_whole_cell_marker_without_hint():
    nb = v4.new_notebook()
    nb.cells = [v4.new_code_cell("# SOLUTION CELL\nanswer = 42")]
    assert ml.transform_notebook(nb).cells[0].source == f"# TODO: your code here\n{RAISE}"


def test_notebook_marker_error_names_cell():
    nb = v4.new_notebook()
    nb.cells = [v4.new_markdown_cell("intro"), v4.new_code_cell("a = 1\n# BEGIN SOLUTION\nb = 2")]
    with pytest.raises(ml.MarkerError, match=r"solutions/02\.ipynb cell 1:2: .*never closed"):
        ml.transform_notebook(nb, "solutions/02.ipynb")


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "solutions" / "exercises").mkdir(parents=True)
    (tmp_path / "lessons" / "exercises").mkdir(parents=True)
    nbformat.write(_solution_notebook(), tmp_path / "solutions" / "01_allreduce.ipynb")
    (tmp_path / "solutions" / "exercises" / "ex1.py").write_text(
        "def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n", encoding="utf-8")
    return tmp_path


def run_tool(root: Path, *args: str) -> subprocess.CompletedProcess:
    """The command line, run in this process (the real-repository check below runs it as a subprocess)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([f"--root={root}", *args])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def test_generate_then_check_is_byte_stable(tmp_path):
    root = _repo(tmp_path)
    assert ml.check(root)[0] == [f"missing: {p} (run `{ml.FIX}`)" for p in
                                 ("lessons/01_allreduce.ipynb", "lessons/exercises/ex1.py")]
    written, _, _ = ml.generate(root)
    assert len(written) == 2
    lesson = root / "lessons" / "01_allreduce.ipynb"
    first = lesson.read_bytes()
    assert first.endswith(b"}\n")
    assert ml.check(root) == ([], 2)
    assert ml.generate(root)[0] == []  # nothing to rewrite
    assert lesson.read_bytes() == first
    assert (root / "lessons" / "exercises" / "ex1.py").read_text() == f"def f():\n    # TODO: your code here\n    {RAISE}\n"
    nb = nbformat.read(lesson, as_version=4)
    assert len(nb.cells) == 4 and all(c.get("outputs", []) == [] for c in nb.cells)


def test_rebuilding_or_running_the_solution_leaves_the_lesson_alone(tmp_path):
    """New random cell ids (a rebuilt notebook), missing ids, or the metadata a kernel writes when the
    solution is executed do not make the learner copy stale; only content does."""
    root = _repo(tmp_path)
    path = root / "solutions" / "01_allreduce.ipynb"
    before = ml.targets(root)

    nbformat.write(_solution_notebook(), path)  # rebuilt: every cell has a new random id
    assert ml.targets(root) == before

    data = json.loads(path.read_text())
    for cell in data["cells"]:
        del cell["id"]
    data["metadata"]["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    path.write_text(json.dumps(data))
    assert ml.targets(root) == ml.targets(root)  # no random ids invented for the missing ones
    lesson = root / "lessons" / "01_allreduce.ipynb"
    with_lang = nbformat.reads(ml.targets(root)[lesson], as_version=4)
    assert with_lang.metadata["language_info"] == {"name": "python"}
    assert [c.id for c in with_lang.cells] == [c.id for c in nbformat.reads(before[lesson], as_version=4).cells]

    ml.generate(root)
    assert ml.check(root) == ([], 2)
    data["cells"][0]["source"] = "## All-reduce, edited"
    path.write_text(json.dumps(data))
    assert ml.check(root)[0] == [f"stale: lessons/01_allreduce.ipynb differs from its solution (run `{ml.FIX}`)"]


def test_check_cli_reports_stale_missing_orphaned(tmp_path):
    root = _repo(tmp_path)
    assert run_tool(root).returncode == 0
    ok = run_tool(root, "--check")
    assert ok.returncode == 0 and ok.stdout.startswith("OK") and "(2 file(s))" in ok.stdout

    (root / "lessons" / "exercises" / "ex1.py").write_text("edited by hand\n")
    (root / "lessons" / "01_allreduce.ipynb").unlink()
    (root / "lessons" / "exercises" / "old.py").write_text("x = 1\n")
    bad = run_tool(root, "--check")
    assert bad.returncode == 1
    assert "stale: lessons/exercises/ex1.py" in bad.stdout
    assert "missing: lessons/01_allreduce.ipynb" in bad.stdout
    assert "orphaned: lessons/exercises/old.py has no solutions/exercises/old.py" in bad.stdout
    assert "python tools/make_lessons.py" in bad.stdout

    assert run_tool(root, "--prune").returncode == 0
    assert not (root / "lessons" / "exercises" / "old.py").exists()
    assert run_tool(root, "--check").returncode == 0


def test_cli_marker_error_exit_code(tmp_path):
    root = _repo(tmp_path)
    (root / "solutions" / "exercises" / "ex2.py").write_text("# END SOLUTION\n")
    proc = run_tool(root)
    assert proc.returncode == 2
    assert "solutions/exercises/ex2.py:1:" in proc.stderr


def test_check_with_no_solutions(tmp_path):
    proc = run_tool(tmp_path, "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(0 file(s))" in proc.stdout


def test_lessons_in_sync_with_solutions():
    """lessons/ is generated from solutions/: after editing a solution, run `python tools/make_lessons.py`."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_lessons.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------------
# the answered copies: what a learner's completed work looks like (CI runs the notebooks there)

def _without_marker_lines(text: str) -> list[str]:
    """The solution's lines minus the marker lines, computed independently of the tool."""
    return [line for line in text.splitlines() if not ml.ANY_MARKER_RE.search(line)]


def test_answered_source_keeps_the_answer_and_drops_the_markers():
    src = ("def step(grad, world_size):\n"
           "    # BEGIN SOLUTION hint: use dist.all_reduce\n"
           "    dist.all_reduce(grad)\n"
           "    grad /= world_size\n"
           "    # END SOLUTION\n"
           "    return grad\n")
    assert ml.answer_source(src, "ex.py") == ("def step(grad, world_size):\n"
                                              "    dist.all_reduce(grad)\n"
                                              "    grad /= world_size\n"
                                              "    return grad\n")
    with pytest.raises(ml.MarkerError, match="never closed"):  # the same checks as the learner copy
        ml.answer_source("# BEGIN SOLUTION\na = 1\n", "ex.py")


def test_answered_notebook_has_the_lessons_cells_with_answers_and_solution_outputs():
    sol = _solution_notebook()
    before = nbformat.writes(sol)
    lesson = ml.transform_notebook(sol, "solutions/01.ipynb")
    done = ml.transform_notebook(sol, "solutions/01.ipynb", answered=True)
    assert nbformat.writes(sol) == before
    # the learner's cells (solution-only left out), same ids and metadata: only code and outputs differ
    assert [(c.cell_type, c.get("id"), c.metadata) for c in done.cells] == \
           [(c.cell_type, c.get("id"), c.metadata) for c in lesson.cells]
    assert done.metadata == lesson.metadata
    md, region, whole, plain = done.cells
    assert md.source == sol.cells[0].source  # markdown unchanged, as in lessons/
    assert region.source == "x = 1\nfor i in range(2):\n    x += i\nx"
    assert whole.source == "opt = make()\nopt.step()"
    assert plain.source == "print('hello')"
    assert region.outputs == sol.cells[1].outputs and region.execution_count == 3  # what nbval compares against
    assert plain.outputs == sol.cells[4].outputs
    nbformat.validate(done)


def test_write_answered_refuses_source_folders_and_deletes_stale_files(tmp_path):
    root = _repo(tmp_path)
    for bad in (root, root / "lessons", root / "solutions"):
        with pytest.raises(ml.MarkerError, match="refusing"):
            ml.write_answered(root, bad)
    out = root / "build" / "learner"
    (out / "exercises").mkdir(parents=True)
    (out / "exercises" / "gone.py").write_text("x = 1\n")
    (out / "runs").mkdir()
    (out / "runs" / "kept.json").write_text("{}")
    proc = run_tool(root, f"--answered={out}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (out / "exercises" / "gone.py").exists() and (out / "runs" / "kept.json").exists()
    assert (out / "exercises" / "ex1.py").read_text() == "def f():\n    return 1\n"
    assert sorted(p.name for p in out.glob("*.ipynb")) == ["01_allreduce.ipynb"]
    assert ml.check(root)[0][0].startswith("missing: lessons/")  # lessons/ itself is not touched


def test_answered_copy_of_this_course(tmp_path):
    """Every lesson and exercise script, completed: no marker anywhere, each answered code cell the
    solution's code minus its marker lines, the solution's outputs kept, and the lessons' layout (the
    notebooks find exercises/ beside them, as in lessons/)."""
    out = tmp_path / "learner"
    written, _ = ml.write_answered(ROOT, out)
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    scripts = sorted((ROOT / "solutions" / "exercises").glob("*.py"))
    assert sorted(written) == sorted([out / p.name for p in solutions] + [out / "exercises" / p.name for p in scripts])
    for path in written:
        assert not ml.ANY_MARKER_RE.search(path.read_text(encoding="utf-8")), f"{path.name} still has a marker"
    for src in scripts:
        answered = (out / "exercises" / src.name).read_text(encoding="utf-8")
        assert answered.splitlines() == _without_marker_lines(src.read_text(encoding="utf-8")), src.name
        compile(answered, src.name, "exec")
    n_regions = 0
    for src in solutions:
        sol = ml.load_notebook(src)
        lesson = nbformat.read(ROOT / "lessons" / src.name, as_version=4)
        done = nbformat.read(out / src.name, as_version=4)
        kept = [c for c in sol.cells if ml.SOLUTION_ONLY_TAG not in (c.metadata.get("tags") or [])]
        assert [c.get("id") for c in done.cells] == [c.get("id") for c in lesson.cells], src.name
        assert len(kept) == len(done.cells)
        for s, d, le in zip(kept, done.cells, lesson.cells):
            if s.cell_type != "code":
                assert d.source == s.source == le.source
                continue
            assert d.source.splitlines() == _without_marker_lines(s.source), f"{src.name}: {d.source[:60]!r}"
            assert d.outputs == s.outputs and d.execution_count == s.execution_count
            n_regions += le.source.count(RAISE)
    assert n_regions >= 6  # the in-notebook exercises of lessons 01, 03, 07 and 12 were answered
