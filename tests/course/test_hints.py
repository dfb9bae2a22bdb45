"""Every exercise has two staged hints, and no hint hands out the answer.

An exercise is a notebook code cell with an answer region (``# BEGIN SOLUTION`` .. ``# END SOLUTION``
or ``# SOLUTION CELL``) or a script ``solutions/exercises/NN_<name>.py``. What a learner sees as help
is read from ``lessons/`` (the generated copies):

- the ``# TODO:`` lines that replace the answer regions, which say what to do;
- in the markdown cell before the exercise (for a script: the notebook cell that introduces it),
  ``<details><summary>Hint 1</summary>`` (names the API) and ``<details><summary>Hint 2</summary>``
  (the shape of the code).

"The full answer", decided line by line: each line of an answer region, comments dropped and all
whitespace removed, is a piece of the answer; so is the right-hand side of an assignment, the value
of a ``return`` and the context of a ``with`` (a hint that writes ``run = broken.launch(...)`` where
the answer has ``detail = broken.launch(...)`` gives the same line away). A hint gives the answer
away when one of those pieces, not trivial (under ``MIN_PIECE`` characters, like ``return model``,
``n = len(x)`` or ``continue``), appears in the hint text with its whitespace and backticks removed.
Naming a function (``dist.all_reduce``) or showing a line with its arguments left out
(``DistributedSampler(ds, num_replicas=..., ...)``) is allowed; writing a line of the answer is not.
"""

from __future__ import annotations

import io
import re
import textwrap
import tokenize
from dataclasses import dataclass

import nbformat
import pytest
from harness import ROOT

SOLUTIONS, LESSONS = ROOT / "solutions", ROOT / "lessons"
BEGIN_RE = re.compile(r"^[ \t]*#\s*BEGIN SOLUTION\b")
END_RE = re.compile(r"^[ \t]*#\s*END SOLUTION\b")
CELL_RE = re.compile(r"^[ \t]*#\s*SOLUTION CELL\b")
TODO_RE = re.compile(r"#\s*TODO:\s*(.*)$")
RAISE = 'raise NotImplementedError("exercise'
DETAILS_RE = re.compile(r"<details>\s*<summary>\s*(Hint \d)\s*</summary>(.*?)</details>", re.S)
# Shorter pieces are not an answer: `return model`, `n = len(x)`, `answer_a = {}`, `continue`.
MIN_PIECE = 12
_PLAIN = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER}


@dataclass
class Exercise:
    name: str
    answers: list[str]  # the solution's answer regions (code, without the marker lines)
    todos: list[str]  # the learner's TODO texts
    hint_cell: str | None  # the markdown a learner reads before the exercise (learner copy)
    where: str  # where to add the hints, for messages


def regions(text: str) -> list[str]:
    """The answer regions of a solution file or cell: the lines between BEGIN and END (or a whole
    ``# SOLUTION CELL``)."""
    lines = text.splitlines()
    if lines and CELL_RE.match(lines[0]):
        return ["\n".join(lines[1:])]
    out, cur = [], None
    for line in lines:
        if BEGIN_RE.match(line):
            cur = []
        elif END_RE.match(line):
            out.append("\n".join(cur or []))
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text).replace("`", "")


def pieces(region: str) -> list[str]:
    """The non-trivial pieces of an answer region, whitespace removed (see the module docstring)."""
    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(region) + "\n").readline):
        if tok.type not in _PLAIN:
            for row in range(tok.start[0], tok.end[0] + 1):  # a multi-line string belongs to each line
                lines.setdefault(row, [])
            lines[tok.start[0]].append(tok.string)
    out = []
    for row in sorted(lines):
        code = _squash("".join(lines[row]))
        found = [code]
        assign = re.match(r"^[\w.,\[\]\"'*]+?(?<![=!<>+\-*/%&|^])=(?!=)(.+)$", code)
        if assign:
            found.append(assign.group(1))
        for keyword in ("return", "with", "yield"):
            if code.startswith(keyword) and len(code) > len(keyword):
                found.append(code[len(keyword):].rstrip(":"))
        out += [p for p in found if len(p) >= MIN_PIECE]
    return sorted(set(out), key=len, reverse=True)


def given_away(answers: list[str], hint_texts: list[str]) -> list[str]:
    """The answer pieces that appear in any of ``hint_texts``."""
    squashed = [_squash(h) for h in hint_texts]
    return [p for region in answers for p in pieces(region) if any(p in h for h in squashed)]


def _todos(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := TODO_RE.search(line))]


def _notebook_exercises() -> list[Exercise]:
    out = []
    for sol_path in sorted(SOLUTIONS.glob("[0-9][0-9]_*.ipynb")):
        sol = nbformat.read(sol_path, as_version=4)
        learner = nbformat.read(LESSONS / sol_path.name, as_version=4)
        answered = [c for c in sol.cells if c.cell_type == "code" and regions(c.source)]
        asked = [i for i, c in enumerate(learner.cells) if c.cell_type == "code" and RAISE in c.source]
        assert len(answered) == len(asked), (f"{sol_path.name}: {len(answered)} answer cells but {len(asked)} "
                                             "TODO cells in lessons/; run python tools/make_lessons.py")
        for k, (cell, at) in enumerate(zip(answered, asked), start=1):
            md = next((learner.cells[j].source for j in range(at - 1, -1, -1)
                       if learner.cells[j].cell_type == "markdown"), None)
            out.append(Exercise(f"{sol_path.stem}#{k}", regions(cell.source), _todos(learner.cells[at].source), md,
                                f"the markdown cell before exercise cell {k} of {sol_path.name}"))
    return out


def _script_exercises() -> list[Exercise]:
    out = []
    for sol_path in sorted((SOLUTIONS / "exercises").glob("[0-9][0-9]_*.py")):
        learner = (LESSONS / "exercises" / sol_path.name).read_text(encoding="utf-8")
        notebooks = sorted(LESSONS.glob(f"{sol_path.name[:2]}_*.ipynb"))
        cells = [c.source for nb in notebooks for c in nbformat.read(nb, as_version=4).cells
                 if c.cell_type == "markdown" and f"exercises/{sol_path.name}" in c.source]
        md = next((c for c in cells if DETAILS_RE.search(c)), cells[-1] if cells else None)
        out.append(Exercise(f"exercises/{sol_path.name}", regions(sol_path.read_text(encoding="utf-8")),
                            _todos(learner), md,
                            f"the markdown cell of lesson {sol_path.name[:2]} that introduces exercises/{sol_path.name}"))
    return out


EXERCISES = _notebook_exercises() + _script_exercises()


def test_the_course_has_its_exercises():
    assert len(EXERCISES) >= 12
    assert all(e.answers for e in EXERCISES)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_every_exercise_has_two_staged_hints(ex: Exercise):
    assert ex.hint_cell is not None, f"{ex.name}: no markdown cell introduces it; hints go in {ex.where}."
    hints = DETAILS_RE.findall(ex.hint_cell)
    labels = [label for label, _ in hints]
    assert labels == ["Hint 1", "Hint 2"], (
        f"{ex.name}: {ex.where} has {labels or 'no hints'}; it needs exactly two collapsed hints, in order: "
        "<details><summary>Hint 1</summary> (names the API) and <details><summary>Hint 2</summary> "
        "(the shape of the code).")
    assert all(len(body.strip()) > 40 for _, body in hints), f"{ex.name}: a hint is (nearly) empty"
    assert len(ex.todos) == len(ex.answers), f"{ex.name}: every answer region needs its TODO line"
    assert all(len(t) > 15 for t in ex.todos), f"{ex.name}: a TODO line must say what to do: {ex.todos}"


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e.name)
def test_no_hint_contains_a_line_of_the_answer(ex: Exercise):
    texts = ex.todos + [body for _, body in DETAILS_RE.findall(ex.hint_cell or "")]
    leaked = given_away(ex.answers, texts)
    assert not leaked, (f"{ex.name}: the hints (TODO lines and <details> blocks) write out lines of the answer: "
                        f"{leaked}. Name the API (Hint 1) and show the shape with '...' in place of the "
                        "arguments (Hint 2), never the line itself.")


# The detector against the hints this course used to have (they each gave lines of the answer away).
OLD = {
    "03_data_parallel#1": "zip(replicas[0].parameters(), other.parameters()); p0.grad.add_(p.grad); p.grad = None",
    "12_debugging_lab#2": ('broken.error_files(run_b)[0] has "message" and "traceback"; the program is '
                           'ddp_course/course/l12_debugging_lab/broken/world_size.py; records hold env["WORLD_SIZE"]'),
    "exercises/04_ddp_convert.py": "dist.destroy_process_group()",
    "exercises/02_ring_allreduce.py": "chunks = x.tensor_split(n) (views into x); n - 1 reduce-scatter steps",
}


@pytest.mark.parametrize("name", sorted(OLD))
def test_old_hints_that_spelled_out_the_answer_are_caught(name):
    ex = next(e for e in EXERCISES if e.name == name)
    assert given_away(ex.answers, [OLD[name]])


def test_naming_the_api_is_not_giving_the_answer():
    answer = "    t = loss.detach().clone()\n    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n    return (t / n).item()\n"
    assert not given_away([answer], ["`dist.all_reduce` with `dist.ReduceOp.SUM`, then `.item()`"])
    assert given_away([answer], ["x = loss.detach().clone()"])  # another name, the same line
