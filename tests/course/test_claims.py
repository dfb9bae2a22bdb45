"""Factors and magnitudes the lessons state are printed by a cell, or cited to where they come from.

A *magnitude claim* is a factor ("~65536x", "1.5× DDP's bytes", "a factor of ~8", "a thousand times
faster"), a bound ("moves the loss by 1e-2 or more"), or a size word ("lr-sized", "orders of
magnitude"), in a markdown cell or a code comment of a solution notebook. Each one must be

- **printed**: a number within a factor of 1.5 of the claim's (for a bound: at or beyond it, within
  a factor of 10) appears in the saved output of the cell itself or of a code cell at most two cells
  away; or
- **cited**: its paragraph (its comment, for a code comment) names where it comes from — a line of
  PyTorch's source (``torch/....py``), an issue (``pytorch/pytorch#N``), a paper ("(Author et al.,
  YYYY)"), or the lesson and section that measures it ("lesson 04, section 6"); or
- **explained here**, in ``ARITHMETIC``: a claim that is a definition or arithmetic on the line itself
  ("8 × 32 = 256"), each with its reason. An entry that no longer matches any claim fails the test,
  so the list cannot go stale.

The claim finder and the backing rules are tested on made-up sentences at the bottom.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from harness import ROOT

NUM = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
WORD_NUMBERS = {"ten": 10, "a hundred": 100, "hundred": 100, "a thousand": 1e3, "thousand": 1e3,
                "a million": 1e6, "million": 1e6, "a billion": 1e9, "billion": 1e9}
COMPARATIVE = r"(?:larger|smaller|more|less|faster|slower|bigger|fewer|higher|lower|too)"
CLAIM = re.compile("|".join([
    # a factor: 65536x, ~8×, 1.5x DDP's bytes (not "8 × 32" or "4 x 8 x 2": products and shapes)
    rf"(?P<fx>(?<![\w.×x*^/(-])(?<!(?-i:[A-Z]{{2}})\s)(?:[~≈]\s?)?(?P<f>{NUM})\s?[x×](?!\s*[\d(])(?![\w-]))",
    rf"(?P<ft>(?:about|roughly|nearly|some|~|≈|over|almost|up to)\s+(?P<t>{NUM})\s+times\b)",
    rf"(?P<fc>\ba factor of\s+(?:about\s+|~|≈|roughly\s+)?(?P<c>{NUM}))",
    rf"(?P<fw>\b(?P<w>{'|'.join(sorted(WORD_NUMBERS, key=len, reverse=True))})\s+times\s+{COMPARATIVE}\b)",
    # a bound: 1e-2 or more
    rf"(?P<bd>(?P<b>{NUM})\s+or\s+(?P<dir>more|less|larger|smaller)\b)",
    # a size word
    r"(?P<sz>\blr[- ]sized\b|\borders? of magnitude\b|\b\d+-fold\b|\b(?:ten|hundred|thousand)fold\b)",
]), re.IGNORECASE)
CITED = re.compile(r"torch/[\w/.]+\.py|pytorch/pytorch#\d+|\b[A-Z][a-z]+ et al\.,? \d{4}|"
                   r"\blessons? \d\d,? (?:section|§) ?\d|\bsection \d+\b", re.IGNORECASE)
NUMBER_IN_OUTPUT = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)", re.IGNORECASE)

# Claims that are arithmetic or a definition on their own line, with the reason each needs no cell.
ARITHMETIC: dict[tuple[str, str], str] = {
    ("03_data_parallel.ipynb", "orders of magnitude"):
        "a GPU's forward+backward against a CPU's: the lesson measures the CPU side only and says so",
    ("10_scaling.ipynb", "orders of magnitude"):
        "published link speeds, tabulated by multinode.LINKS in the cell that follows",
}


def _value(m: re.Match) -> tuple[float | None, str]:
    """The number a claim states and its kind: factor, bound_up, bound_down or size."""
    for group in ("f", "t", "c"):
        if m.group(group):
            return float(m.group(group).replace(",", "")), "factor"
    if m.group("w"):
        return WORD_NUMBERS[m.group("w").lower()], "factor"
    if m.group("b"):
        return float(m.group("b").replace(",", "")), "bound_up" if m.group("dir").lower() in ("more", "larger") \
            else "bound_down"
    return None, "size"


def claims_of(text: str) -> list[tuple[re.Match, str]]:
    """Every claim in ``text``, with the paragraph it sits in (markdown: blank-line blocks)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        out += [(m, para) for m in CLAIM.finditer(para)]
    return out


def comments_of(source: str) -> list[str]:
    """A code cell's comments, consecutive comment lines joined into one paragraph."""
    paras, current = [], []
    for line in source.splitlines():
        if "#" in line and not line.lstrip().startswith(("%", "!")):
            current.append(line.split("#", 1)[1].strip())
        elif current:
            paras.append(" ".join(current))
            current = []
    if current:
        paras.append(" ".join(current))
    return paras


def output_numbers(cell: dict) -> list[float]:
    found = []
    for out in cell.get("outputs", []):
        texts = [out.get("text", "")] + [v for k, v in out.get("data", {}).items() if k.startswith("text/plain")]
        for text in texts:
            text = "".join(text) if isinstance(text, list) else text
            for m in NUMBER_IN_OUTPUT.finditer(text):
                try:
                    found.append(abs(float(m.group(1).replace(",", ""))))
                except ValueError:
                    pass
            found += [abs(float(p)) / 100 for p in re.findall(r"(\d+(?:\.\d+)?)%", text)]  # 17.7% -> 0.177
    return found


def printed(value: float, kind: str, numbers: list[float]) -> bool:
    for u in numbers:
        if u <= 0:
            continue
        if kind == "factor" and max(u / value, value / u) <= 1.5:
            return True
        if kind == "bound_up" and value <= u < 10 * value:
            return True
        if kind == "bound_down" and value / 10 < u <= value:
            return True
    return False


def unbacked(nb: dict, name: str) -> list[str]:
    """Every claim of the notebook that is neither printed nearby, nor cited, nor in ARITHMETIC."""
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    found = []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        paras = [source] if cell["cell_type"] == "markdown" else comments_of(source)
        near = [j for j in code if abs(code.index(j) - min(range(len(code)), key=lambda k: abs(code[k] - i))) <= 2]
        numbers = [x for j in {i, *near} for x in output_numbers(cells[j])]
        for para in paras:
            for m, block in claims_of(para):
                phrase = m.group(0).strip()
                if (name, phrase) in ARITHMETIC or CITED.search(block):
                    continue
                value, kind = _value(m)
                if value is not None and printed(value, kind, numbers):
                    continue
                found.append(f"{name} cell {i}: {phrase!r} in: {block.strip()[:160]!r}")
    return found


NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_magnitude_is_printed_or_cited(path: Path):
    found = unbacked(json.loads(path.read_text(encoding="utf-8")), path.name)
    assert not found, ("a factor or magnitude that no cell prints and nothing cites; print it from the cell "
                       "that measures it, cite its source, or reword:\n" + "\n".join(found))


def test_arithmetic_entries_still_match_a_claim():
    left = dict(ARITHMETIC)
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"])
            for para in [source] if cell["cell_type"] == "markdown" else comments_of(source):
                for m, _ in claims_of(para):
                    left.pop((path.name, m.group(0).strip()), None)
    assert not left, f"entries of ARITHMETIC that match no claim any more (delete them): {sorted(left)}"


# --- the rules on made-up sentences --------------------------------------------------------------------

def _nb(markdown: str, printed_text: str = "", comment: str = "") -> dict:
    return {"cells": [
        {"cell_type": "markdown", "source": markdown},
        {"cell_type": "code", "source": f"x = 1{'  # ' + comment if comment else ''}\nprint(x)",
         "outputs": [{"output_type": "stream", "text": printed_text}]}]}


def test_a_made_up_factor_is_caught_and_a_printed_one_is_not():
    assert unbacked(_nb("Sharding makes it about 1000x faster."), "x.ipynb")
    assert unbacked(_nb("Sharding makes it about 1000x faster.", "speed-up 3.2x"), "x.ipynb")
    assert not unbacked(_nb("Sharding makes it about 1000x faster.", "speed-up 1,130.5x"), "x.ipynb")
    assert unbacked(_nb("The bug leaves updates a thousand times smaller."), "x.ipynb")
    assert not unbacked(_nb("The bug leaves updates a thousand times smaller.", "ratio 8.1e+02"), "x.ipynb")


def test_a_made_up_bound_or_size_word_is_caught_unless_cited():
    assert unbacked(_nb("", comment="a bug moves the loss by 1e-2 or more"), "x.ipynb")
    assert not unbacked(_nb("", "loss moved by 0.031", comment="a bug moves the loss by 1e-2 or more"), "x.ipynb")
    assert unbacked(_nb("AdamW gives noise lr-sized steps."), "x.ipynb")
    assert not unbacked(_nb("AdamW gives noise small steps (lesson 04, section 6), orders of magnitude more than SGD's."),
                        "x.ipynb")
    assert not unbacked(_nb("FSDP moves 1.5x DDP's bytes (Rajbhandari et al., 2020)."), "x.ipynb")
    assert not unbacked(_nb("The op is AVG (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`): 2x less."),
                        "x.ipynb")


def test_products_and_shapes_are_not_factors():
    for text in ("a batch of 8 × 64 tokens", "4 x 8 x 2 = 64", "√(2 × time)", "TP 8 × PP 2", "a 2×2 mesh",
                 "x = 3", "the 0x1F byte"):
        assert not [m for m, _ in claims_of(text) if _value(m)[1] == "factor"], text
    for text in ("about 1.5× DDP's bytes", "~65536x too small", "a factor of ~8", "ten times faster"):
        (m, _), = claims_of(text)
        assert _value(m)[1] == "factor" and math.isfinite(_value(m)[0]), text
