"""``train_step`` as lesson 01 prints it: the course's own source, less two parts later lessons ask for.

Lesson 06's exercise asks which micro-steps a DDP ``no_sync()`` context must enclose, and lesson 07's in
which order a step calls the fp16 gradient scaler and the clip; ``train_step``'s source answers both. So
lesson 01 prints it without its docstring, without the ``with`` line of the synchronisation context (its
body kept, one level less indented), and without the scaler's branches (the plain ``optimizer.step()``
of its ``else`` kept), each gap marked by a comment. Every line printed is a line of
``ddp_course/train.py``, up to its indentation, or such a comment (``tests/lessons/test_minigpt.py``
checks it).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

SYNC = "with plan.sync_context("  # the line opening the no_sync context (lesson 06)
MARK_SYNC = "    # (under DDP, a context decides which micro-steps all-reduce: lesson 06)"
MARK_SCALER = "    # (with fp16, a gradient scaler's calls go around the clip and the step: lesson 07)"


def train_step_outline() -> str:
    """The outline, as printed."""
    from ddp_course import train

    source = textwrap.dedent(inspect.getsource(train.train_step))
    doc = ast.parse(source).body[0].body[0]
    lines = source.splitlines()
    lines = lines[:doc.lineno - 1] + lines[doc.end_lineno:]
    out, inner = [], None  # inner: the indentation of the context's body, printed one level less
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if inner is not None and line.strip() and indent < inner:
            inner = None
        if SYNC in line:
            out.insert(next(i for i, ln in enumerate(out) if ln.lstrip().startswith("for ")), MARK_SYNC)
            inner = indent + 4
        elif indent == 4 and line.strip() in ("if scaler is not None:", "else:") or line.lstrip().startswith("scaler."):
            if MARK_SCALER not in out:
                out.append(MARK_SCALER)
        elif inner is not None:
            out.append(line[4:])
        elif indent == 8 and line.strip() == "optimizer.step()":
            out.append(line[4:])  # the else branch's step, now that the scaler's branch is left out
        else:
            out.append(line)
    return "\n".join(out)
