"""The lessons as a learner first opens them, exercises unanswered.

Every lesson with an exercise (a TODO cell, or a cell that grades a script in ``exercises/``) is
executed as shipped in ``lessons/``, in a copy of that folder. Only two kinds of cell may fail:

- a grading cell (``assert verdict.ok, ...``), with a message that tells the learner what to do
  ("exercise not complete: ... Fill in the TODO in ..., then re-run this cell.");
- a TODO cell whose stub runs at the top level, with the stub's own NotImplementedError.

Nothing else: in particular no NameError (or other failure) in a later cell because a TODO cell did
not define something.

To stay cheap, not every cell runs. The plan of each lesson (``plan``) executes, in order,

- every cell from the first TODO through the last one that a TODO can affect: the TODO cells, their
  checks, and every later cell that uses a name a TODO cell binds (found by parsing the cells);
- after that, only the cells that grade or read the learner's scripts (``exercises/``);
- before the first TODO, only the cells that bind a name those cells read before binding it
  themselves (and, in turn, the earlier cells these read from).

A skipped cell uses nothing a TODO defines and does not touch the exercise scripts, so it runs the
same whether the exercises are done or not; ``make test`` executes every cell of every lesson in
their answered form (``python tools/make_lessons.py --answered build/learner``), before ``tests/``.
A script that a grading cell grades as it would be graded answered (a one-mistake copy the cell
writes from the learner's script, e.g. lesson 06's) is byte for byte the file that run graded: the
kernel gets that verdict (``notebook_runs.kernel_preamble``) instead of grading it again. Lesson
12's exercises are answers about jobs that run the same answered or not: there only the answer
cells and their checks run, after the lesson's import (``ANSWERS_ONLY``).
"""

from __future__ import annotations

import ast
import re
import shutil
import time
import warnings
from pathlib import Path

import nbformat
import notebook_runs
import pytest
from harness import ROOT

from ddp_course.check import NOT_COMPLETE, STUB, is_stub

LESSONS = ROOT / "lessons"
GRADING_RE = re.compile(r"^assert verdict\.ok\b", re.M)
# Lessons whose exercises are answers about jobs that run the same whether or not the answers are
# there: the unanswered run executes only the answer cells and their checks, after the lesson's
# imports (the answered run in `make test` executes every cell, jobs included).
ANSWERS_ONLY = {"12_debugging_lab.ipynb": "from ddp_course.course.l12_debugging_lab import broken"}


def _read(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nbformat.read(path, as_version=4)


def _tree(source: str) -> ast.Module:
    from IPython.core.inputtransformer2 import TransformerManager  # %magics and !commands, as the kernel sees them

    return ast.parse(TransformerManager().transform_cell(source))


def _bound(stmts: list[ast.stmt]) -> set[str]:
    """Names the statements bind at the top level (assignments, loops, with, imports, defs, classes)."""
    names: set[str] = set()
    for stmt in stmts:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
            continue
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _used(source: str) -> set[str]:
    return {n.id for n in ast.walk(_tree(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _read_first(source: str) -> set[str]:
    """The names a cell reads that an earlier statement of the same cell has not bound: what it needs
    from the cells above (a name bound inside a statement that also reads it counts as read)."""
    bound: set[str] = set()
    found: set[str] = set()
    for stmt in _tree(source).body:
        found |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound
        bound |= _bound([stmt])
    return found


def affected_names(cell_source: str) -> set[str]:
    """What a TODO cell leaves undefined or broken: every name it binds, except those bound before
    a top-level stub by statements that do not raise (a function holding a stub raises when called)."""
    body = _tree(cell_source).body
    top_stub = next((i for i, s in enumerate(body) if is_stub(s)), len(body))
    raising = {s.name for s in body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
               and any(is_stub(n) for n in ast.walk(s))}
    return (_bound(body) - _bound(body[:top_stub])) | raising


def plan(nb) -> dict:
    """Which code cells to execute, and the TODO and grading cells among them (indices into nb.cells)."""
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    todo = [i for i in code if STUB in nb.cells[i].source]
    grading = [i for i in code if GRADING_RE.search(nb.cells[i].source)]
    last = max(todo, default=-1)
    for t in todo:
        names = affected_names(nb.cells[t].source)
        later = [i for i in code if i > t and _used(nb.cells[i].source) & names]
        checks = [i for i in code if i > t][:1]  # the check right after an in-notebook exercise
        checks = [i for i in checks if i in grading]
        last = max([last, *later, *checks])
    scripts = [i for i in code if i > last and (i in grading or "exercises/" in nb.cells[i].source)]
    first = min(todo, default=last + 1)
    run = {i for i in code if first <= i <= last} | set(scripts)
    binds = {i: _bound(_tree(nb.cells[i].source).body) for i in code if i < first}
    pending = sorted(run)
    while pending:  # the cells above the first TODO that what runs reads from, transitively
        i = pending.pop()
        needs = _read_first(nb.cells[i].source)
        for j, names in binds.items():
            if j < i and j not in run and names & needs:
                run.add(j)
                pending.append(j)
    return {"run": sorted(run), "todo": todo, "grading": grading, "through": last}


def exercise_lessons() -> list[str]:
    found = []
    for path in sorted(LESSONS.glob("*.ipynb")):
        nb = _read(path)
        if any(c.cell_type == "code" and (STUB in c.source or GRADING_RE.search(c.source)) for c in nb.cells):
            found.append(path.name)
    return found


def execute(path: Path, cells: list[int], timeout: int = 600, preamble: str | None = None) -> dict[int, dict]:
    """Execute the code cells ``cells`` of notebook ``path`` in order (after ``preamble``, if given), in
    one kernel of this Python, with the notebook's folder as working directory, going on after errors.
    {index: {"error", "text"}}."""
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

    nb = _read(path)
    sub = nbformat.v4.new_notebook(metadata=nb.metadata)
    sub.cells = ([nbformat.v4.new_code_cell(preamble)] if preamble else []) + [nb.cells[i] for i in cells]
    km = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager())
    try:
        NotebookClient(sub, km=km, timeout=timeout, allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=False)  # the client leaves a kernel it was given running
    if preamble:
        err = next((o for o in sub.cells[0].outputs if o.output_type == "error"), None)
        assert err is None, f"the preamble failed: {err.ename}: {err.evalue}\n{preamble}"
    out = {}
    for i, cell in zip(cells, sub.cells[1:] if preamble else sub.cells):
        err = next((o for o in cell.outputs if o.output_type == "error"), None)
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        out[i] = {"error": (err.ename, err.evalue) if err else None, "text": text}
    return out


# --------------------------------------------------------------------------------------------------
# the plan itself, on small notebooks (fast)

def _nb(*sources: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_plan_follows_what_a_todo_leaves_undefined():
    raise_line = f'raise NotImplementedError("{STUB}")'
    nb = _nb("import torch\nslow = 1",
             f"answer = None\n# TODO: x\n{raise_line}",            # 1: top-level stub; binds answer first
             "verdict = check(answer)\nassert verdict.ok, verdict.message",  # 2: its check
             f"def f(x):\n    # TODO: y\n    {raise_line}",          # 3: a function that raises
             "print(slow)",                                          # 4: nothing from a TODO
             "y = f(2)",                                             # 5: calls the raising function
             "print(slow * 2)",                                      # 6: skipped
             'verdict = grade("01", "exercises/01_x.py")\nassert verdict.ok, verdict.message',  # 7: a script grader
             "print('the end')")                                     # 8: skipped
    assert affected_names(nb.cells[1].source) == set()  # answer exists (None) before the stub
    assert affected_names(nb.cells[3].source) == {"f"}
    p = plan(nb)
    assert p["todo"] == [1, 3] and p["grading"] == [2, 7] and p["through"] == 5
    assert p["run"] == [0, 1, 2, 3, 4, 5, 7]


def test_plan_runs_only_the_cells_above_the_first_todo_that_it_reads_from():
    raise_line = f'raise NotImplementedError("{STUB}")'
    nb = _nb("import json\na = 1",                                   # 0: read through cell 1
             "b = a + 1",                                           # 1: read by the TODO cell
             "job = launch_something()\nc = 2",                     # 2: read by nothing below: skipped
             "import os\nprint(os.getcwd(), json.dumps(b))",         # 3: reads, binds nothing read: skipped
             "a = 5",                                               # 4: after every reader of a: skipped
             f"def g():\n    return b\n\ndef h():\n    # TODO: x\n    {raise_line}",  # 5
             "c = 3\nverdict = check(h, c)\nassert verdict.ok, verdict.message")   # 6: binds its own c
    p = plan(nb)
    assert p["todo"] == [5] and p["grading"] == [6] and p["run"] == [0, 1, 5, 6]
    assert _read_first("x = 1\ny = x + z\nfor k in y:\n    print(k)") == {"z", "print", "k"}


def test_plan_of_a_top_level_todo():
    nb = _nb(f"x = 1\n# TODO\nraise NotImplementedError(\"{STUB}\")\ny = 2", "print(y)", "print(x)")
    assert affected_names(nb.cells[0].source) == {"y"}
    assert plan(nb)["run"] == [0, 1]


def test_replace_function_body_on_learner_and_solution_files():
    from ddp_course.check import replace_function_body

    body = "    return 42\n"
    learner = (LESSONS / "exercises" / "06_no_sync.py").read_text()
    solution = (ROOT / "solutions" / "exercises" / "06_no_sync.py").read_text()
    a, b = replace_function_body(learner, "accumulate", body), replace_function_body(solution, "accumulate", body)
    assert a == b  # the same script, whatever the body held (a TODO, or the answer with its markers)
    assert "return 42" in a and STUB not in a and "SOLUTION" not in a
    assert '"""Forward and backward over every micro-batch' in a  # the docstring stays
    with pytest.raises(ValueError, match="no top-level function"):
        replace_function_body(learner, "nope", body)


def test_a_stub_left_in_a_script_is_reported_before_any_job_starts(monkeypatch):
    from ddp_course import check, launch

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("the grader started a job"))
    for number, name, what in (("06", "06_no_sync.py", "accumulate() still raises"),
                               ("08", "08_save_load.py", "save_checkpoint() and load_checkpoint() still raise")):
        verdict = check.grade(number, LESSONS / "exercises" / name)
        assert not verdict.ok and verdict.message.startswith(f"{NOT_COMPLETE}: {what} NotImplementedError"), verdict
    assert check.unfinished(f'x = 1\nraise NotImplementedError("{STUB}")\n') == ["the script"]
    assert check.unfinished('def f():\n    raise NotImplementedError("not yet")\n') == []  # not the course's stub
    assert check.unfinished("def f(:\n") == []  # a syntax error is left to the grader's run to show


def test_not_complete_says_what_to_do():
    from ddp_course.check import not_complete

    v = not_complete("accumulate()", "exercises/06_no_sync.py")
    assert not v.ok and v.message == ("exercise not complete: accumulate() still raises NotImplementedError. Fill in "
                                      "the TODO in exercises/06_no_sync.py and save the file, then re-run this cell.")
    assert "exercise cell above" in not_complete("amp_step()").message


# --------------------------------------------------------------------------------------------------
# the lessons, executed

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", exercise_lessons())
def test_unanswered_lesson(name, tmp_path):
    """Run the lesson as shipped: only its checks fail, each saying what to do; no cascade."""
    work = tmp_path / "lessons"
    work.mkdir()
    shutil.copy2(LESSONS / name, work / name)
    shutil.copytree(LESSONS / "exercises", work / "exercises")
    nb = _read(work / name)
    p = plan(nb)
    cells = sorted({*p["todo"], *p["grading"]}) if name in ANSWERS_ONLY else p["run"]
    t0 = time.perf_counter()
    got = execute(work / name, cells, preamble=notebook_runs.kernel_preamble() + ANSWERS_ONLY.get(name, ""))
    print(f"{name}: {len(cells)} of {sum(c.cell_type == 'code' for c in nb.cells)} code cells in "
          f"{time.perf_counter() - t0:.0f} s")

    def where(i: int) -> str:
        return f"{name} cell {i}:\n{nb.cells[i].source}\n--> {got[i]['error']}\n{got[i]['text'][-2000:]}"

    for i, r in got.items():
        if r["error"] is not None:
            print(f"cell {i}: {r['error'][0]}: {r['error'][1][:300]}")
        if r["error"] is None:
            continue
        ename, evalue = r["error"]
        assert ename != "NameError", "a NameError: a TODO left something undefined\n" + where(i)
        if i in p["grading"]:
            text = got[i]["text"]
            assert NOT_COMPLETE in text and "TODO" in text and "re-run this cell" in text, \
                "a check failed without telling the learner what to do\n" + where(i)
            assert NOT_COMPLETE not in evalue, "the verdict is shown twice (printed, then in the error)\n" + where(i)
        elif i in p["todo"]:
            assert (ename, evalue) == ("NotImplementedError", STUB), where(i)
        else:
            pytest.fail("a cell that is neither a check nor a TODO failed\n" + where(i))
    # every check of an unanswered exercise ran, and said so
    for i in p["grading"]:
        assert got[i]["error"] is not None and NOT_COMPLETE in got[i]["text"], \
            "a check passed (or did not run) on an unanswered exercise\n" + where(i)


def test_a_stub_in_a_method_is_named_by_its_class():
    from ddp_course import check
    from ddp_course.check import STUB

    stub = f'raise NotImplementedError("{STUB}")'
    src = f"class F:\n    def forward(self):\n        {stub}\n\n    def ok(self):\n        return 1\n\n\ndef g():\n    {stub}\n"
    assert check.unfinished(src) == ["F.forward()", "g()"]
