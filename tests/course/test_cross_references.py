"""Every "lesson NN" the course writes points at the lesson that teaches what the sentence is about.

The lessons are read from the notebook file names (``solutions/NN_<topic>.ipynb``). Each lesson has a
few topic words of its own (``TOPICS``: words that one lesson teaches and no other one owns). For
every mention of "lesson NN" / "Lesson NN" / "lessons NN and MM" in the notebooks (markdown and code
comments), the exercise scripts, the README, docs/ and the package's docstrings and comments, the test
finds the topic word nearest to the mention, within ``WINDOW`` characters on either side in the same
paragraph. The mention is wrong when that word belongs to another lesson ("mixed precision (lesson
08)": mixed precision is lesson 07's), or when NN is no lesson at all. A mention with no topic word
nearby is not judged (it cannot be, from the text alone).

The examples at the bottom are the wrong mentions this test was written against: it must keep
rejecting them.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from harness import ROOT

LESSONS = {p.name[:2]: p.stem[3:] for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))}

# Topic words per lesson: each teaches one thing that no other lesson teaches. Matching is
# case-insensitive and prefers the longest word at a place ("activation checkpointing", lesson 01's,
# before "checkpointing", lesson 08's). A word used across many lessons (DDP, all-reduce, torchrun)
# is nobody's: it cannot tell lessons apart.
TOPICS: dict[str, tuple[str, ...]] = {
    "00": ("environment report", "env_report", "doctor", "what a launcher hands"),
    "01": ("MiniGPT on one device", "activation checkpointing", "causal attention"),
    "02": ("collectives", "collective", "point-to-point", "ring all-reduce", "mismatched collectives"),
    "03": ("DataParallel", "nn.DataParallel", "dp_mechanism", "dp_vs_ddp"),
    "04": ("DistributedDataParallel", "two_nodes", "static rendezvous", "torchrun agents", "set_epoch",
           "DistributedSampler", "recipe", "clean_exit"),
    "05": ("bucket", "buckets", "bucket-size", "bucket sizes", "communication hook", "communication hooks",
           "hooks", "overlap", "unused parameter", "unused parameters", "no gradient", "profiler trace",
           "static_graph", "find_unused_parameters", "DDP internals", "inside DDP", "DDP options"),
    "06": ("no_sync", "gradient accumulation", "accumulation", "micro-batches"),
    "07": ("mixed precision", "autocast", "GradScaler", "AMP", "bf16/fp16 communication", "table of formats"),
    "08": ("checkpoint", "checkpoints", "checkpointing", "torch.distributed.checkpoint", "DCP",
           "fault tolerance", "restart", "restarts", "restart count", "ckpt_format", "resume", "resumes"),
    "09": ("FSDP", "FSDP2", "fully_shard", "sharded", "ZeRO"),
    "10": ("scaling", "NCCL_DEBUG", "speedup", "multinode"),
    "11": ("beyond data parallelism", "tensor parallelism", "pipeline parallelism", "parallelize_module"),
    "12": ("debugging lab", "broken program", "classic DDP bug"),
    "13": ("two dimensions", "2-D mesh", "2-D plan", "sequence parallelism", "sequence parallel", "fsdp_tp",
           "loss_parallel", "vocabulary-sharded", "FSDP x tensor parallel"),
    "14": ("ring attention", "context parallelism", "zig-zag", "zigzag", "mixture of experts", "expert parallelism",
           "experts", "load-balancing loss", "all_to_all"),
}
WINDOW = 60  # characters each side: a few words, about one clause of a sentence

MENTION_RE = re.compile(r"\b[Ll]essons? (\d\d)((?:(?:, | and | or |/)\d\d)*)")
_WORDS = sorted({(w, nn) for nn, ws in TOPICS.items() for w in ws}, key=lambda t: -len(t[0]))
TOPIC_RE = re.compile("|".join(rf"(?<![\w.]){re.escape(w)}(?![\w])" for w, _ in _WORDS), re.IGNORECASE)
OWNER = {w.lower(): nn for w, nn in _WORDS}


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each on one line (markdown wraps sentences over lines)."""
    return [" ".join(ln.strip().lstrip("#").strip() for ln in block.splitlines())
            for block in re.split(r"\n\s*\n", text)]


_BOUNDARY_RE = re.compile(r"[.;:!?](?=\s)")  # the end of a sentence or a clause
REUSE_RE = re.compile(r"\b(?:used|reused|reuses|uses)(?: again)? (?:by|in)\s*$")  # "X, also used by lesson NN"


def _clause(para: str, lo: int, hi: int, at: int, end: int) -> tuple[int, int]:
    """The clause of ``para[lo:hi]`` that holds ``para[at:end]``: cut at sentence or clause punctuation."""
    starts = [m.end() for m in _BOUNDARY_RE.finditer(para, lo, at)]
    ends = [m.start() for m in _BOUNDARY_RE.finditer(para, end, hi)]
    return (starts[-1] if starts else lo), (ends[0] if ends else hi)


def _parentheses(para: str, at: int, end: int) -> tuple[int, int] | None:
    """The innermost ``(...)`` around ``para[at:end]`` as (index of '(', index of ')'), or None."""
    depth, open_ = 0, None
    for i in range(at - 1, -1, -1):
        if para[i] == ")":
            depth += 1
        elif para[i] == "(":
            if depth == 0:
                open_ = i
                break
            depth -= 1
    if open_ is None:
        return None
    depth = 0
    for i in range(end, len(para)):
        if para[i] == "(":
            depth += 1
        elif para[i] == ")":
            if depth == 0:
                return open_, i
            depth -= 1
    return None


def _scopes(para: str, at: int, end: int) -> list[tuple[int, int]]:
    """Where the subject of a mention can be. In parentheses, "X (lesson NN)" or "(X, lesson NN)": the
    parentheses' clause, then the clause just before the '('. Elsewhere: the mention's own clause,
    bounded by punctuation and parentheses."""
    paren = _parentheses(para, at, end)
    if paren:
        open_, close = paren
        before_lo = max([para.rfind("(", 0, open_), para.rfind(")", 0, open_)]) + 1
        return [_clause(para, open_ + 1, close, at, end), _clause(para, before_lo, open_, open_, open_)]
    lo = max(para.rfind("(", 0, at), para.rfind(")", 0, at)) + 1
    his = [i for i in (para.find("(", end), para.find(")", end)) if i >= 0]
    return [_clause(para, lo, min(his) if his else len(para), at, end)]


def problems(text: str, lessons: dict[str, str] = LESSONS) -> list[str]:
    """What is wrong with the lesson mentions in ``text``: one sentence per wrong mention.

    For each mention: the topic words in its scope (``_scopes``), at most ``WINDOW`` characters away,
    with no other mention between (in "lesson 04 uses lesson 00's env_report" the word is lesson 00's);
    after "lesson NN's" only the words after it ("lesson 06's lab"). The nearest decides. "used by /
    used again in lesson NN" says on purpose that another lesson's tool comes back: not judged.
    """
    found = []
    for para in _paragraphs(text):
        topics = [(m.start(), m.end(), OWNER[m.group(0).lower()], m.group(0)) for m in TOPIC_RE.finditer(para)]
        mentions = list(MENTION_RE.finditer(para))
        for m in mentions:
            cited = [m.group(1), *re.findall(r"\d\d", m.group(2))]
            quote = para[max(0, m.start() - WINDOW):m.end() + WINDOW].strip()
            unknown = [nn for nn in cited if nn not in lessons]
            if unknown:
                found.append(f"'{m.group(0)}' names no lesson (the lessons are {', '.join(lessons)}): ...{quote}...")
                continue
            if REUSE_RE.search(para, 0, m.start()):
                continue
            possessive = para.startswith("'s", m.end())
            for lo, hi in _scopes(para, m.start(), m.end()):
                near = []
                for s, e, nn, word in topics:
                    if s < lo or e > hi or (possessive and s < m.end()) or m.start() < e and s < m.end():
                        continue
                    gap = (m.start() - e) if e <= m.start() else (s - m.end())
                    between = any(o is not m and min(e, m.end()) <= o.start() < max(s, m.start())
                                  for o in mentions)
                    if gap <= WINDOW and not between:
                        near.append((gap, nn, word))
                if near:
                    _, owner, word = min(near)
                    if owner not in cited:
                        found.append(f"'{m.group(0)}' is paired with '{word}', which lesson {owner} "
                                     f"({lessons.get(owner, '?')}) teaches, not "
                                     f"{' / '.join(lessons[c] for c in cited)}: ...{quote}...")
                    break
    return found


def _notebook_text(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(cell.source)
        elif cell.cell_type == "code":  # comments only: code cannot cite a lesson
            parts.append("\n".join(ln.split("#", 1)[1] for ln in cell.source.splitlines() if "#" in ln))
    return "\n\n".join(parts)


def _sources() -> list[Path]:
    files = sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "solutions" / "exercises").glob("*.py"))
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "ddp_course").rglob("*.py"))]
    return [p for p in files if p.exists()]


def _text(path: Path) -> str:
    return _notebook_text(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")


def test_lessons_are_read_from_the_notebooks():
    assert len(LESSONS) >= 12 and list(LESSONS) == sorted(LESSONS)
    assert set(TOPICS) == set(LESSONS), (
        "every lesson needs topic words in TOPICS (and only lessons that exist): "
        f"notebooks {sorted(LESSONS)}, TOPICS {sorted(TOPICS)}")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_lesson_mention_points_at_its_topic(path):
    wrong = problems(_text(path))
    assert not wrong, (f"{path.relative_to(ROOT)}: a cross-reference points at the wrong lesson. Correct the "
                       "number (or, if the sentence is right, add the topic word to TOPICS of its lesson):\n  "
                       + "\n  ".join(wrong))


def test_mentions_exist_in_the_course():
    """The test would be empty if the course stopped saying "lesson NN": it says it dozens of times."""
    assert sum(len(MENTION_RE.findall(_text(p))) for p in _sources()) > 30


# The wrong mentions of the base text (each was in a notebook) and correct ones beside them.
WRONG = [
    "you find the same bugs, diagnosed one by one, in the debugging lab\n(the debugging lab, lesson 10).",
    "the job restarts without a human (elastic training, with checkpoints from lesson 07).",
    "simplest to debug. Mixed precision (lesson 08) and activation checkpointing (lesson 01) postpone the",
    "its own part (`torch.distributed.checkpoint`, lesson 07).",
    "(for a sharded model, see lesson 12).",
]
RIGHT = [
    "(the debugging lab, lesson 12).",
    "the job restarts without a human (elastic training, with checkpoints from lesson 08).",
    "simplest to debug. Mixed precision (lesson 07) and activation checkpointing (lesson 01) postpone the",
    "its own part (`torch.distributed.checkpoint`, lesson 08).",
    "fewer all-reduces (`no_sync`, lesson 06) and more overlap (bucket sizes, lesson 05).",
    "`two_nodes` (lessons 04 and 10) gives each of its two nodes GPUs of its own",
]


@pytest.mark.parametrize("text", WRONG)
def test_wrong_mentions_are_caught(text):
    assert problems(text), f"not caught: {text!r}"


@pytest.mark.parametrize("text", RIGHT)
def test_right_mentions_pass(text):
    assert not problems(text)
