"""Committed outputs show paths relative to the repository (or ~), never the authoring machine's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from harness import ROOT

from ddp_course.paths import REPO, shorten, show

MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(home|root|work|tmp|Users)/[^\s'\"]*")
# Notebooks whose committed outputs predate relative paths: re-execute each, then delete it here (the
# test fails while a notebook is listed and already clean, so the list cannot go stale).
PENDING: set[str] = set()


def output_texts(cell: dict) -> list[str]:
    """Every text an output of ``cell`` shows: streams, text and JSON data, error tracebacks."""
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append("".join(out["text"]) if isinstance(out["text"], list) else out["text"])
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/") or mime.endswith("json"):
                texts.append(value if isinstance(value, str) else
                             "".join(value) if isinstance(value, list) else json.dumps(value))
        if out.get("output_type") == "error":
            texts.append("\n".join(out.get("traceback", [])) + "\n" + out.get("evalue", ""))
    return texts


def machine_paths(path: Path) -> list[str]:
    found = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        for text in output_texts(cell):
            found += [f"cell {i}: {m.group(0)}" for m in MACHINE_PATH.finditer(text)]
    return found


@pytest.mark.parametrize("name", [p.name for p in sorted((ROOT / "solutions").glob("*.ipynb"))])
def test_no_absolute_paths_in_outputs(name):
    found = machine_paths(ROOT / "solutions" / name)
    if name in PENDING:
        if not found:
            pytest.fail(f"{name} has no absolute path in its outputs any more: delete it from PENDING")
        pytest.xfail(f"outputs predate relative paths (re-execute it): {found[0]}")
    assert not found, f"absolute paths in the outputs of solutions/{name}:\n" + "\n".join(found[:20])


def test_the_pattern_finds_machine_paths_only():
    assert MACHINE_PATH.search('File "/home/ann/ddp/ddp_course/train.py", line 3')
    assert MACHINE_PATH.search("wrote /work/main/solutions/runs/01/summary.json")
    assert MACHINE_PATH.search("[/tmp/x]")
    for fine in ("wrote solutions/runs/01/summary.json", "~/ddp/train.py", "$DDP_COURSE_DATA/tinyshakespeare.txt",
                 "tokens/s", "a/work/b", "https://example.org/root/x"):
        assert not MACHINE_PATH.search(fine), fine


def test_show_and_shorten(monkeypatch):
    monkeypatch.setenv("DDP_COURSE_DATA", "/somewhere/data")
    assert show(REPO / "solutions" / "runs" / "x.json") == "solutions/runs/x.json"
    assert show(REPO) == "."
    assert show("/somewhere/data/tinyshakespeare.txt") == "$DDP_COURSE_DATA/tinyshakespeare.txt"
    assert show(Path.home() / "notes.txt") == "~/notes.txt" or Path.home().resolve() == REPO
    assert show("https://example.org/t.txt") == "https://example.org/t.txt"
    assert show("/opt/elsewhere/x") == "/opt/elsewhere/x"
    cwd = os.getcwd()
    try:
        os.chdir(REPO / "solutions")
        assert show("runs/06_lab") == "solutions/runs/06_lab"  # relative to the current folder, printed from the repo
    finally:
        os.chdir(cwd)
    text = f'File "{REPO}/ddp_course/train.py", line 3; corpus /somewhere/data/t.txt; {REPO}/.venv/lib/x.py'
    assert shorten(text) == 'File "ddp_course/train.py", line 3; corpus $DDP_COURSE_DATA/t.txt; .venv/lib/x.py'


# --------------------------------------------------------------------------------------------------
# Verdicts: a committed output never reads a disturbed measurement, and a code cell never writes a
# winner or a mechanism by hand (noise.sentence / compare / ranking and the labs' verdict helpers do).

VERDICT_WORDS = re.compile(r"\b(fastest|faster|slower|side by side|hides|hidden|exposed)\b", re.I)


def disturbed_outputs(path: Path) -> list[str]:
    from ddp_course.course.noise import DISTURBED

    return [f"cell {i}: {line.strip()}" for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"])
            for text in output_texts(cell) for line in text.splitlines() if DISTURBED in line]


def handwritten_verdicts(source: str) -> list[str]:
    """String literals of a code cell that name a winner or a mechanism, outside assertions' messages
    and keyword names (``higher_is_faster=True``)."""
    import ast

    tree = ast.parse(source)
    # assertion messages, and a helper's verdict compared with a word (c["verdict"] == "faster")
    in_assert = {id(n) for a in ast.walk(tree) if isinstance(a, (ast.Assert, ast.Compare)) for n in ast.walk(a)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_assert:
            if VERDICT_WORDS.search(node.value):
                found.append(node.value.strip())
    return found


@pytest.mark.parametrize("name", [p.name for p in sorted((ROOT / "solutions").glob("*.ipynb"))])
def test_no_committed_output_reads_a_disturbed_run(name):
    found = disturbed_outputs(ROOT / "solutions" / name)
    assert not found, (f"solutions/{name} was executed on a busy machine; re-execute it on a quiet one "
                       "(uptime first):\n" + "\n".join(found))


@pytest.mark.parametrize("name", [p.name for p in sorted((ROOT / "solutions").glob("*.ipynb"))])
def test_verdicts_are_not_written_by_hand(name):
    nb = json.loads((ROOT / "solutions" / name).read_text(encoding="utf-8"))
    found = [f"cell {i}: {s!r}" for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             for s in handwritten_verdicts("".join(c["source"]).replace("%matplotlib inline", ""))]
    assert not found, (f"solutions/{name} prints a verdict from its own wording; let the course's noise helper "
                       "(ddp_course.course.noise) or the lab's verdict function decide it from the numbers:\n"
                       + "\n".join(found))


def test_the_guards_catch_what_they_guard(tmp_path):
    from ddp_course.course import noise

    line = noise.sentence("two", [40.0, 41.0], "one", [4.0, 30.0], higher_is_faster=True, workers=2)
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [{"output_type": "stream", "text": line}]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert disturbed_outputs(tmp_path / "x.ipynb")
    assert handwritten_verdicts('print("the kernels ran side by side")')
    assert handwritten_verdicts('v = "faster than" if r > 1.05 else "slower than"')
    assert not handwritten_verdicts('noise.sentence("a", a, "b", b, higher_is_faster=True)')
    assert not handwritten_verdicts('assert big > small, "moving 65536x more data cannot be faster"')
    assert not handwritten_verdicts('stands = c["verdict"] == "faster" and saved > floor')
