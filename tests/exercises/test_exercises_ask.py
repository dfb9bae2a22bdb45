"""An exercise asks before it tells: no answer is printed, stated or importable before its grading cell.

For every exercise of the course -- the scripts of ``exercises/`` and the exercises inside the notebooks:

1. **Nothing the exercise imports holds the course's version of an answer.** Each ``ddp_course`` module a
   script imports, and each course module such a module holds as an attribute (``ring_harness.R``), has
   no function or class with an answer function's qualified name and as many required arguments, and
   none of what the grader lists in ``DELEGATES`` (``check.delegation.same_contract``).
2. **The grader refuses an answer that hands its work to the course's version** (``check.delegation``),
   tried with each version the course has, reached the ways a learner would reach it.
3. **Nothing before the exercise states its answer.** What the learner sees before the grading cell --
   the lesson's prose and code, the outputs the solution's cells print, the exercise's own text up to
   its second hint, and the shipped script with its TODO comments -- holds no line of the answer (a
   line of the solution's ``BEGIN SOLUTION`` region, 30 characters or more, unless the grader's
   ``TAUGHT`` names it as what the lesson teaches on purpose before the exercise, with the reason) and
   none of the phrases that state it (each grader's ``GIVEAWAYS``; :data:`NOTEBOOK_GIVEAWAYS` for the
   exercises inside the notebooks).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import types

import pytest
from harness import ROOT

from ddp_course import check
from ddp_course.check import rewrite
from ddp_course.check.delegation import answer_arity, bindings, same_contract
from ddp_course.check.progress import notebook_exercises
from ddp_course.check.registry import parse_source

SCRIPTS = sorted(check.exercises())
# The phrases that state the answer of each exercise done inside a notebook (record name -> phrases).
NOTEBOOK_GIVEAWAYS: dict[str, tuple[str, ...]] = {
    "01_causal_attention": ("masked_fill(future", "triu(torch.ones(", "softmax(scores, dim=-1) @ v",
                            "q @ k.transpose(-2, -1) / math.sqrt"),
    "03_my_reduce": ("reduce_gradients(replicas)", "dpm.reduce_gradients"),
    "07_amp_step": ("unscale_ before clipping", "clip after `unscale_`", "unscale, then clip", "clip the true gradients",
                    "unscale_ first"),
    "12_answer_a": ("gave up in all_reduce", "gave up in barrier", "optype=allreduce", "optype=barrier", "in_collective"),
    "12_answer_b": ("written for a 4-gpu machine", "4-gpu", "world_size=4", "asked_world_size"),
    "12_answer_c": ("the same data seed on every rank", "same_seed", "first batch windows",
                    "of rank 1's windows were also rank 0's"),
}


def grader_of(name: str):
    return importlib.import_module(check.exercises()[name].module)


def shipped(name: str) -> str:
    return (ROOT / "lessons" / "exercises" / check.exercises()[name].script).read_text(encoding="utf-8")


def imported_modules(source: str) -> list[types.ModuleType]:
    """The course modules a script imports at its top, and the course modules they hold as attributes."""
    found: dict[str, types.ModuleType] = {}
    for dotted in bindings(parse_source(source).body).values():
        if not dotted.startswith("ddp_course"):
            continue
        try:
            module = importlib.import_module(dotted)
        except ImportError:
            module = importlib.import_module(dotted.rsplit(".", 1)[0])
        found[module.__name__] = module
    for module in list(found.values()):
        for value in vars(module).values():
            if isinstance(value, types.ModuleType) and value.__name__.startswith("ddp_course"):
                found.setdefault(value.__name__, value)
    return list(found.values())


def reachable(module: types.ModuleType):
    """(dotted name, object) of the functions and classes of ``module``, and of its classes' methods."""
    for attr, value in vars(module).items():
        if inspect.isfunction(value) or inspect.isclass(value):
            yield f"{module.__name__}.{attr}", value
            if inspect.isclass(value):
                for method in vars(value).values():
                    if inspect.isfunction(method):
                        yield f"{module.__name__}.{value.__qualname__}.{method.__name__}", method


@pytest.mark.parametrize("name", SCRIPTS)
def test_nothing_the_exercise_imports_holds_the_course_version_of_an_answer(name):
    source = shipped(name)
    answers = check.answer_functions(parse_source(source))
    arity = answer_arity(source)
    delegates = tuple(getattr(grader_of(name), "DELEGATES", ()))
    found = sorted({dotted for module in imported_modules(source) for dotted, obj in reachable(module)
                    if same_contract(obj, {a: arity[a] for a in answers}, delegates)})
    assert found == [], (f"exercise {name} imports modules that hold the course's own version of its answer: "
                         f"{found}. Move them where the exercise does not import them (the lesson's demonstrations "
                         "can import them from there).")


def delegating(name: str, function: str, body: str) -> str:
    """The exercise answered, but for ``function``, whose body is ``body`` (a learner's delegating answer)."""
    solution = (ROOT / "solutions" / "exercises" / check.exercises()[name].script).read_text(encoding="utf-8")
    return check.replace_function_body(rewrite.answer_source(solution), function, body)


# (exercise, answer function, a body that hands the work to the course's version)
DELEGATING = [
    ("06_no_sync", "accumulate",
     "    from ddp_course.course.l06_grad_accumulation import no_sync_lab\n"
     "    no_sync_lab.accumulate(model, micro_batches, 'no_sync' if use_no_sync else 'always_sync', len(micro_batches))\n"),
    ("14_ring_attention", "merge",
     "    from ddp_course.course.l14_sequences_and_experts import ring\n"
     "    return ring.merge(out, lse, out_blk, lse_blk)\n"),
    ("14_expert_dispatch", "dispatch",
     "    import ddp_course.course.l14_sequences_and_experts.experts as E\n"
     "    return E.dispatch(slots, counts, group)\n"),
    ("13_two_d_plan", "parallelize",
     "    from ddp_course.parallel._tp_plan import tensor_parallel\n"
     "    tensor_parallel(model, mesh['tp'])\n    return model\n"),
    ("04_ddp_convert", "mean_over_ranks",
     "    from ddp_course.course.l04_ddp.ddp_recipe import mean_over_ranks as m\n"
     "    return m(loss, world_size)\n"),
]


@pytest.mark.parametrize("name, function, body", DELEGATING, ids=[d[0] for d in DELEGATING])
def test_an_answer_that_hands_its_work_to_the_course_version_is_refused(name, function, body, tmp_path):
    path = tmp_path / check.exercises()[name].script
    path.write_text(delegating(name, function, body), encoding="utf-8")
    verdict = check.grade(name, path)
    assert not verdict.ok and f"{function}() hands its work to the course's own version" in verdict.message, verdict
    assert "exercise asks you to write" in verdict.message


def test_an_answer_of_its_own_is_not_taken_for_a_delegation():
    """The solutions' answers use the course's helpers (tiny models, loggers), never its versions of them."""
    from ddp_course.check.delegation import delegation

    for name in SCRIPTS:
        answers = check.answer_functions(parse_source(shipped(name)))
        solution = (ROOT / "solutions" / "exercises" / check.exercises()[name].script).read_text(encoding="utf-8")
        assert delegation(solution, shipped(name), answers, tuple(getattr(grader_of(name), "DELEGATES", ()))) is None


# --- 3. nothing before the exercise states its answer -----------------------------------------------------

def _seen(text: str) -> str:
    """Text as compared: lower case, whitespace runs as one space, backquotes gone."""
    return re.sub(r"\s+", " ", text.replace("`", "")).strip().lower()


def before_grading(notebook: str, grading: re.Pattern) -> str:
    """What a learner sees in ``solutions/<notebook>`` before the grading cell (matched by ``grading``):
    prose up to a second hint, code without the answers, the outputs the solution's cells print."""
    cells = json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))["cells"]
    seen = []
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and grading.search(text):
            break
        if rewrite.SOLUTION_ONLY_TAG in (cell.get("metadata", {}).get("tags") or []):
            continue
        if cell["cell_type"] == "markdown":  # the second and later hints are the learner's to open, later
            seen.append(re.sub(r"<details>\s*<summary>\s*Hint [2-9].*?</details>", " ", text, flags=re.S))
        else:
            seen.append(rewrite.transform_cell_source(text, f"{notebook} cell {i}"))
            for out in cell.get("outputs", []):
                seen.append("".join(out.get("text", [])) + "".join(out.get("data", {}).get("text/plain", [])))
    else:
        raise AssertionError(f"no grading cell in {notebook} matching {grading.pattern}")
    return _seen("\n".join(seen))


def answer_lines(source: str) -> list[str]:
    """The lines of the solution's answer regions, 30 characters or more, as compared."""
    lines, inside = [], False
    for line in source.splitlines():
        if rewrite.BEGIN_RE.match(line) or rewrite.CELL_RE.match(line):
            inside = True
        elif rewrite.END_RE.match(line):
            inside = False
        elif inside and len(_seen(line)) >= 30 and not line.strip().startswith("#"):
            lines.append(_seen(line))
    return lines


def exercise_places() -> list[tuple[str, str, re.Pattern, str, tuple[str, ...]]]:
    """(exercise, notebook, its grading cell, the answer's source, the phrases that state it) for all;
    the answer's source leaves out the lines its grader's ``TAUGHT`` names."""
    notebooks = {p.name[:2]: p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")}
    found = []
    for name in SCRIPTS:
        ex = check.exercises()[name]
        answer = (ROOT / "solutions" / "exercises" / ex.script).read_text(encoding="utf-8")
        taught = {_seen(line) for line in getattr(grader_of(name), "TAUGHT", ())}
        answer = "\n".join(line for line in answer.splitlines() if _seen(line) not in taught)
        found.append((name, notebooks[ex.lesson], re.compile(rf"grade\([^)]*exercises/{re.escape(ex.script)}"), answer,
                      tuple(getattr(grader_of(name), "GIVEAWAYS", ()))))
    for ex in {e.answer: e for e in notebook_exercises(ROOT / "lessons")}.values():
        record = f"{ex.lesson}_{ex.answer}"
        cells = json.loads((ROOT / "solutions" / ex.notebook).read_text(encoding="utf-8"))["cells"]
        answer = next("".join(c["source"]) for c in cells if c["cell_type"] == "code"
                      and re.search(rf"^\s*(def {ex.answer}\b|{ex.answer}\s*=)", "".join(c["source"]), re.M))
        found.append((record, ex.notebook, re.compile(rf"\({re.escape(ex.answer)}\b|, {re.escape(ex.answer)}\b"),
                      answer, NOTEBOOK_GIVEAWAYS.get(record, ())))
    return found


PLACES = exercise_places()


@pytest.mark.parametrize("name, notebook, grading, answer, giveaways", PLACES, ids=[p[0] for p in PLACES])
def test_nothing_before_the_exercise_states_its_answer(name, notebook, grading, answer, giveaways):
    assert giveaways, f"exercise {name} names no GIVEAWAYS: the phrases that would state its answer"
    seen = before_grading(notebook, grading)
    if name in SCRIPTS:
        seen += " " + _seen(shipped(name))
    stated = [p for p in giveaways if _seen(p) in seen] + [line for line in answer_lines(answer) if line in seen]
    assert stated == [], f"before exercise {name} is graded, the learner is shown its answer: {stated}"
