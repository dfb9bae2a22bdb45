"""Lesson 01: what the notebook prints about MiniGPT adds up (its jobs are checked by the notebook run and
by tests/exercises/test_exercise_01.py), and its benchmark (``overhead``: the course's loop against one
written by hand) runs end to end on a tiny model, refusing two loops that do not do the same work."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from harness import ROOT, TINY_MODEL

from ddp_course import bench
from ddp_course.course.l01_minigpt import bench_overhead


def _output(notebook: str, marker: str) -> str:
    """The printed output of the one code cell of ``solutions/<notebook>`` that contains ``marker``."""
    cells = json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))["cells"]
    found = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of {notebook} contain {marker!r}"
    return "".join("".join(o.get("text", [])) for o in found[0]["outputs"])


def _number(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the cell's output:\n{text}"
    return int(m.group(1).replace(",", ""))


def test_the_flops_label_names_the_terms_of_the_printed_figure():
    """The FLOPs per token lesson 01 prints are the sum its label names, with figures: 6 x the weights it
    counts (the printed total less the position table, a lookup) + 12·L·T·C for attention. The label used
    to read "(6 per weight + attention)" beside the total of 413,312 parameters, and 6 x 413,312 + the
    attention term is 49,152 more than the figure printed (model.flops_per_token leaves the 8,192
    position-table weights out)."""
    out = _output("01_minigpt.ipynb", "model.flops_per_token()")
    flops = _number(r"training FLOPs per token ≈ ([\d,]+)", out)
    weights = _number(r"= 6 × ([\d,]+) weights", out)
    attention = _number(r"12·L·T·C = ([\d,]+)", out)
    total = _number(r"total \(tied matrix once\)\s+([\d,]+)", out)
    position = _number(r"position embedding\s+([\d,]+)", out)
    assert "all but the position table" in out
    assert weights == total - position
    assert flops == 6 * weights + attention


def test_the_train_step_lesson_01_prints_is_the_course_own_less_what_lessons_06_and_07_ask():
    """Lesson 01 prints train_step without the no_sync context (lesson 06's exercise: which micro-steps it
    must enclose) and without the fp16 scaler's calls (lesson 07's: their order with the clip). What it
    prints is train.py's own lines, up to indentation, and the comments that mark the gaps."""
    import ast
    import inspect

    from ddp_course import train
    from ddp_course.course.l01_minigpt.outline import MARK_SCALER, MARK_SYNC, train_step_outline

    shown = train_step_outline()
    ast.parse(shown)  # still Python
    source = {line.strip() for line in inspect.getsource(train.train_step).splitlines()}
    marks = {MARK_SYNC.strip(), MARK_SCALER.strip()}
    assert [line for line in shown.splitlines() if line.strip() not in source | marks] == []
    assert marks <= {line.strip() for line in shown.splitlines()}
    for answer in ("sync_context", "no_sync()", "unscale_", "scaler.step", '"""'):
        assert answer not in shown, answer
    assert "optimizer.step()" in shown and "clip_grad_norm_" in shown and "loss / k_total" in shown


# --- the overhead benchmark ----------------------------------------------------------------------------

@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_overhead_tiny(tmp_path, keep_threads):
    # one thread: a second process busy on the same cores cannot stall OpenMP barriers
    res = bench.run("overhead", **TINY_MODEL, micro_batch_size=4, rounds=3, steps=3, warmup=1, check_steps=3,
                    n_batches=4, threads=1, out=tmp_path)
    on_disk = json.loads((tmp_path / "overhead.json").read_text())
    for key in ("rounds", "course_tokens_per_s_median", "hand_tokens_per_s_median", "ratio", "ratio_paired_median",
                "target", "pass", "same_work_check", "noisy", "ratio_cpu_time", "options", "environment"):
        assert key in on_disk, key
    assert len(on_disk["rounds"]) == 3
    assert [r["first"] for r in on_disk["rounds"]] == ["course", "hand", "course"]
    for r in on_disk["rounds"]:
        assert r["course_tokens_per_s"] > 0 and r["hand_tokens_per_s"] > 0
    assert math.isfinite(on_disk["ratio"]) and on_disk["ratio"] > 0
    assert on_disk["ratio"] == pytest.approx(res["ratio"])
    check = on_disk["same_work_check"]
    assert check["ok"] and len(check["loss_course"]) == 3
    assert check["max_abs_loss_diff"] <= check["tolerance"]
    assert on_disk["options"]["n_embd"] == 32


def test_same_work_check_catches_a_different_loop(tmp_path, monkeypatch, keep_threads):
    """The bench refuses to time two loops that do not do the same work."""
    small = dict(TINY_MODEL, micro_batch_size=4, rounds=1, steps=1, warmup=0, check_steps=3, n_batches=2,
                 threads=1, out=tmp_path)

    def other_betas(model, cfg, device):
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999))

    with monkeypatch.context() as m:
        m.setattr(bench_overhead, "hand_optimizer", other_betas)
        with pytest.raises(bench.BenchError, match="optimizer"):
            bench.run("overhead", **small)

    def doubled_lr(model, optimizer, x, y, grad_clip, dtype=None):
        for g in optimizer.param_groups:
            g["lr"] = 2e-3
        return original(model, optimizer, x, y, grad_clip, dtype)

    original = bench_overhead.hand_step
    monkeypatch.setattr(bench_overhead, "hand_step", doubled_lr)
    with pytest.raises(bench.BenchError, match="do not do the same work"):
        bench.run("overhead", **small)
    assert not (tmp_path / "overhead.json").exists()
