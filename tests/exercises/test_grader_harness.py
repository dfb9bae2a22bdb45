"""A script grader cannot be fooled by editing the harness below the exercise's TODO.

``check.grade`` compares the learner's file with the shipped exercise (outside the answer regions,
by syntax tree) before the lesson's grader runs. Here every exercise's answered solution (what
``tools/make_lessons.py --answered`` writes) passes that check, and doctored copies -- a constant
changed, the script's own verdict or reference forced, the RESULT line edited -- are refused with a
verdict that names what differs and where. No job starts: each grader is replaced by a stand-in
that fails the test if the check lets a doctored script through.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest
from harness import ROOT, make_lessons

from ddp_course import check
from ddp_course.check import harness_check, reference

ml = make_lessons()

EXERCISES = {p.stem: p.name for p in sorted((ROOT / "solutions" / "exercises").glob("*.py"))}  # by exercise name
GRADED = "graded by the lesson's grader"


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> dict:
    """{exercise name: path} of each exercise as a learner who completed it has it (answers in, markers out)."""
    out = tmp_path_factory.mktemp("learner")
    written = {}
    for path, text in ml.targets(ROOT, out, answered=True).items():
        if path.suffix == ".py":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written[path.stem] = path
    return written


@pytest.fixture
def graders(monkeypatch) -> list[str]:
    """Replace every lesson grader's ``grade`` by a stand-in that starts nothing; the calls it got."""
    calls = []
    for number, module in check.graders().items():
        grader = importlib.import_module(module)
        monkeypatch.setattr(grader, "grade", lambda path, _n=number, **kw: calls.append(_n) or check.Verdict(True, GRADED))
    return calls


def doctored(answered: dict, tmp_path, number: str, old: str, new: str):
    """The answered exercise ``number`` with ``old`` replaced by ``new`` once; (path, line of the change)."""
    src = answered[number].read_text(encoding="utf-8")
    assert src.count(old) == 1, (number, old)
    path = tmp_path / EXERCISES[number]
    path.write_text(src.replace(old, new), encoding="utf-8")
    return path, src[:src.index(old)].count("\n") + 1


@pytest.mark.parametrize("number", sorted(EXERCISES))
def test_answered_solution_keeps_the_harness_and_reaches_its_grader(number, answered, graders):
    editable = getattr(importlib.import_module(check.graders()[number]), "EDITABLE", ())
    assert check.harness_differences(answered[number].read_text(), check.exercise_reference(number).source,
                                     editable) == []
    verdict = check.grade(number, answered[number])
    assert verdict.ok and verdict.message == GRADED, verdict
    assert graders == [number]
    # the solution file itself (markers are comments) and the shipped learner copy have the same harness
    for path in (ROOT / "solutions" / "exercises" / EXERCISES[number], ROOT / "lessons" / "exercises" / EXERCISES[number]):
        assert check.check_harness(number, path, editable) == check.Verdict(True, ""), path


# (exercise, text of the answered copy, what replaces it, what the verdict must name)
DOCTORED = [
    pytest.param("09_fsdp", "MICRO_BATCH_SIZE, STEPS, LR, SEED = 4, 4, 1e-3, 0", "MICRO_BATCH_SIZE, STEPS, LR, SEED = 4, 0, 1e-3, 0",
                 "MICRO_BATCH_SIZE, STEPS, LR, SEED", id="09-no-training-steps"),
    pytest.param("01_global_val_loss", "ok = abs(result - ref.item()) < 1e-6", "ok = True", "main()", id="01-own-ok-forced"),
    pytest.param("01_global_val_loss", '"reference": ref.item(),', '"reference": result,', "main()", id="01-own-reference-forced"),
    pytest.param("04_ddp_convert", 'sys.stdout.write(f"RESULT {result}\\n")',
                 'sys.stdout.write(f"RESULT {result}\\n".replace(\'"world_size": 1\', \'"world_size": 2\'))',
                 "main()", id="04-result-line-edited"),
    pytest.param("02_ring_allreduce", "SIZES = (1, 3, 4, 10, 1000, 4099)", "SIZES = (4,)", "SIZES", id="02-only-easy-sizes"),
    pytest.param("02_ring_allreduce", "        self.messages += 1\n", "        self.messages = 2 * (self.world_size - 1)\n",
                 "class Ring", id="02-message-count-forged"),
    pytest.param("06_no_sync", '"cases": cases, "ok": ok}', '"cases": cases, "ok": True}', "main()", id="06-result-ok-forced"),
    pytest.param("08_save_load", '"reference": reference})', '"reference": run})', "main()", id="08-reference-is-the-run"),
]


@pytest.mark.parametrize("number, old, new, names", DOCTORED)
def test_a_changed_harness_is_refused_before_the_grader_runs(number, old, new, names, answered, graders, tmp_path):
    path, line = doctored(answered, tmp_path, number, old, new)
    verdict = check.grade(number, path)
    assert not verdict.ok and graders == [], verdict
    message = verdict.message
    assert f"{names} differs at line {line} of your file" in message, message
    assert new.strip()[:40] in message, message  # quotes the changed line
    assert "Restore the part of the file outside the TODO (copy it again from " \
           f"lessons/exercises/{EXERCISES[number]})" in message, message


def test_formatting_comments_and_docstrings_may_differ(answered, graders, tmp_path):
    src = answered["06_no_sync"].read_text()
    tree = ast.parse(src)
    tree.body[0].value.value = "My notes on exercise 06."  # the module docstring
    path = tmp_path / "06_no_sync.py"
    path.write_text("# my copy\n\n" + ast.unparse(tree).replace("\n", "\n\n"))  # no comments, other layout
    assert check.grade("06_no_sync", path).message == GRADED


def test_imports_and_helpers_may_be_added_but_not_rebind_what_the_harness_uses(answered, graders, tmp_path):
    extra = ("import contextlib\nimport torch.distributed as dist\nimport torch.nn\nfrom ddp_course.dist import log\n"
             "import math\n\n\ndef _scale(loss, n):\n    return loss / n\n")
    path, _ = doctored(answered, tmp_path, "06_no_sync", "import contextlib\n", extra)
    assert check.grade("06_no_sync", path).message == GRADED
    graders.clear()
    for added, why in (("from json import loads as lab", "it rebinds lab, which the harness uses"),
                       ("from os import *", "a `*` import may rebind any name"),
                       ("def main():\n    pass", "it redefines main, which the harness uses"),
                       ("SEED = 1", "`SEED = 1`, is not in the course's copy"),
                       ("torch.manual_seed(1)", "only imports and helper functions may be added outside the TODO")):
        path, line = doctored(answered, tmp_path, "06_no_sync", "\n\ndef accumulate(", f"\n\n{added}\n\n\ndef accumulate(")
        verdict = check.grade("06_no_sync", path)
        assert not verdict.ok and graders == [] and why in verdict.message, (added, verdict)


def test_a_missing_statement_is_named_with_the_course_line(answered, graders, tmp_path):
    path, _ = doctored(answered, tmp_path, "08_save_load", "import hashlib\n", "")
    verdict = check.grade("08_save_load", path)
    assert not verdict.ok and "import hashlib (line " in verdict.message and "is missing" in verdict.message, verdict
    path, _ = doctored(answered, tmp_path, "02_ring_allreduce", "def ring_all_reduce(x: torch.Tensor, ring: Ring) -> None:",
                       "def ring_all_reduce(x: torch.Tensor, ring: Ring, check=None) -> None:")
    verdict = check.grade("02_ring_allreduce", path)  # the answer's body is free, not its signature
    assert not verdict.ok and "ring_all_reduce() differs at line" in verdict.message, verdict


def test_the_settings_exercise_04_invites_to_change_may_change_but_stay_plain_values(answered, graders, tmp_path):
    path, _ = doctored(answered, tmp_path, "04_ddp_convert", "STEPS = 18", "STEPS = 24")
    assert check.grade("04_ddp_convert", path).message == GRADED
    path, _ = doctored(answered, tmp_path, "04_ddp_convert", '"n_embd": 64}', '"n_embd": 32}')
    assert check.grade("04_ddp_convert", path).message == GRADED
    for old, new in (("STEPS = 18", 'STEPS = int("0")'), ("STEPS = 18", "STEPS = 18.0"),
                     ('"n_embd": 64}', '"n_embd": 64, "dropout": 0.5}')):
        path, line = doctored(answered, tmp_path, "04_ddp_convert", old, new)
        verdict = check.grade("04_ddp_convert", path)
        assert not verdict.ok and f"at line {line} of your file" in verdict.message and \
            "must stay a plain value of the same kind" in verdict.message, verdict
    # in exercise 09 the grader reads the settings from the file: they are part of the harness
    path, _ = doctored(answered, tmp_path, "09_fsdp", "SEED = 4, 4, 1e-3, 0", "SEED = 4, 8, 1e-3, 0")
    assert not check.grade("09_fsdp", path).ok


def test_grader_04_refuses_fewer_than_two_epochs(monkeypatch, tmp_path):
    """STEPS may change in exercise 04, but the set_epoch check needs a second epoch."""
    import torch

    from ddp_course.course.l04_ddp import grader

    torch.save({}, tmp_path / "final.pt")
    cfg = {"steps": 6, "micro_batch_size": 8, "lr": 0.3, "seed": 1337, "train_windows": 96, "val_windows": 32,
           "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
    rows = [{"rank": r, "world_size": 2, "device": "cpu", "final": str(tmp_path / "final.pt"), "seen": [],
             "param_checksum": [0.0, 0.0], "config": cfg} for r in range(2)]
    monkeypatch.setattr(grader, "run_exercise", lambda *a, **k: rows)
    monkeypatch.setattr(grader, "_reference", lambda *a, **k: pytest.fail("trained a reference"))
    verdict = grader.grade(tmp_path / "04_ddp_convert.py")
    assert not verdict.ok and "less than two epochs" in verdict.message and "at least 12" in verdict.message


def test_a_top_level_todo_leaves_its_statements_free():
    stub = f'raise NotImplementedError("{check.STUB}")'
    reference = f"import json\nX = 1\n# TODO: build y\n{stub}\nprint(json.dumps(y))\n"
    assert check.harness_differences("import json\nX = 1\ny = [X]\ny.append(2)\nprint(json.dumps(y))\n", reference) == []
    found = check.harness_differences("import json\nX = 1\ny = [X]\nprint(json.dumps(y, indent=1))\n", reference)
    assert len(found) == 1 and "line 4 of your file" in found[0], found
    found = check.harness_differences("import json\nX = 2\ny = [X]\nprint(json.dumps(y))\n", reference)
    assert len(found) == 1 and found[0].startswith("X differs at line 2"), found


def test_without_a_shipped_copy_the_verdict_says_the_harness_was_not_compared(answered, graders, monkeypatch):
    monkeypatch.setattr(harness_check, "exercise_reference", lambda number, graded=None: None)
    verdict = check.grade("01_global_val_loss", answered["01_global_val_loss"])
    assert verdict.ok and verdict.message.startswith(GRADED) and "was not compared" in verdict.message, verdict


def test_the_reference_is_never_the_graded_file_itself(monkeypatch):
    lessons = ROOT / "lessons" / "exercises" / EXERCISES["01_global_val_loss"]
    ref = check.exercise_reference("01_global_val_loss", lessons)
    assert ref.shown == f"lessons/exercises/{EXERCISES['01_global_val_loss']}" and ref.source == lessons.read_text()
    monkeypatch.setattr(reference, "SOLUTIONS", ROOT / "no-solutions")  # no solutions/: the lessons/ copy is the reference...
    assert check.exercise_reference("01_global_val_loss", ROOT / "solutions" / "exercises" / EXERCISES["01_global_val_loss"]).source == lessons.read_text()
    assert check.exercise_reference("01_global_val_loss", lessons) is None  # ...except for itself (edited in place)


def test_every_exercise_script_has_one_grader_and_the_listing_gives_its_command(capsys):
    scripts = {p.name for p in (ROOT / "solutions" / "exercises").glob("[0-9][0-9]_*.py")}
    declared = [ex.script for ex in check.exercises().values()]
    assert sorted(declared) == sorted(scripts)  # one grader per script, none without a script
    assert check.main([]) == 0
    shown = capsys.readouterr().out
    for ex in check.exercises().values():
        assert (ROOT / "lessons" / "exercises" / ex.script).is_file(), ex
        assert ex.command in shown and ex.command == f"python -m ddp_course check {check.shortest_key(ex)}"
    for notebook, heading in check.notebook_exercises():  # and the exercises done inside a notebook
        assert heading in shown, (notebook, heading)


def test_a_lesson_number_names_its_exercise_and_a_bad_name_says_which_there_are(capsys, tmp_path):
    for ex in check.exercises().values():
        assert check.resolve(ex.lesson, f"lessons/exercises/{ex.script}") == ex  # the path tells a lesson's apart
        assert check.resolve(ex.name, tmp_path / "mine.py") == ex
    with pytest.raises(ValueError, match="no exercise '99'.*python -m ddp_course check"):
        check.resolve("99")
    assert check.main(["99", "x.py"]) == 2 and "error: no exercise '99'" in capsys.readouterr().err
    lessons = [ex.lesson for ex in check.exercises().values()]
    for lesson in {n for n in lessons if lessons.count(n) > 1}:  # several in one lesson: a file named otherwise
        with pytest.raises(ValueError, match=f"lesson {lesson} has .* exercises; name the one"):
            check.resolve(lesson, tmp_path / "mine.py")


def test_two_threads_parsing_at_once_do_not_break_each_other():
    """``check.registry.parse_source`` parses one thread at a time: CPython 3.11 keeps the AST
    constructor's recursion depth in interpreter-wide state (python/cpython#106905), so a thread that
    starts a parse while another is building its tree breaks the other's count, which then fails with
    ``SystemError: AST constructor recursion depth mismatch`` (seen in ``make test``, where hang attempts
    are graded in threads beside other gradings). Here a garbage-collection callback holds thread A in
    the middle of building its tree while thread B starts parsing: with a bare ``ast.parse`` A fails
    (measured on 3.11.7); with the lock B waits for A."""
    import gc
    import threading

    from ddp_course.check.registry import parse_source

    source = "\n".join(f"def f{i}(x):\n    return [x + {i} for _ in range(3)]" for i in range(300))
    a_building, b_started = threading.Event(), threading.Event()
    parsing: set[str] = set()
    errors: dict[str, str] = {}

    def hold_a_while_b_starts(phase: str, info: dict) -> None:
        me = threading.current_thread().name
        if phase == "start" and me == "A" and me in parsing and not a_building.is_set():
            a_building.set()
            b_started.wait(2)  # with the lock B cannot start: A goes on after 2 s

    def parse(name: str) -> None:
        if name == "B":
            a_building.wait(5)
            b_started.set()
        parsing.add(name)
        try:
            parse_source(source)
        except SystemError as exc:
            errors[name] = str(exc)
        finally:
            parsing.discard(name)

    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation: one comes while A builds its tree
    gc.callbacks.append(hold_a_while_b_starts)
    try:
        threads = [threading.Thread(target=parse, args=(n,), name=n) for n in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        gc.callbacks.remove(hold_a_while_b_starts)
        gc.set_threshold(*threshold)
    assert a_building.is_set(), "no collection came while thread A was parsing: the test did not set up the race"
    assert errors == {}, errors
