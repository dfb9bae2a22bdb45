"""Lesson 07's ``precisions`` lab: the training loop once per precision in one process gives, run for
run, what ``ddp_course.train`` gives in a process of its own; bad input is one ``error:`` line, exit 2.

In-process and tiny (one block, three steps), so the test starts no process."""

from __future__ import annotations

import json

from ddp_course.config import TrainConfig
from ddp_course.course.l07_mixed_precision import precisions
from ddp_course.train import main as train_main

TINY = {"strategy": "single", "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "micro_batch_size": 4,
        "max_steps": 3, "warmup_steps": 1, "log_interval": 1, "eval_interval": 0, "eval_batches": 1, "threads": 1}


def _rows(folder) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: r.get(k) for k in ("step", "loss", "val_loss", "grad_norm")} for r in rows]


def test_each_run_equals_its_own_process_run(tmp_path, one_thread):
    flags = [f"--{k}={v}" for k, v in TINY.items()]
    assert precisions.main([*flags, "--precisions=fp32,bf16", f"--out_dir={tmp_path / 'together'}"]) == 0
    for p in ("fp32", "bf16"):
        train_main(TrainConfig(**TINY, precision=p, out_dir=str(tmp_path / "alone" / p)))
        # each run seeds itself and builds everything anew: the same numbers, bit for bit
        assert _rows(tmp_path / "together" / p) == _rows(tmp_path / "alone" / p), p
        assert json.loads((tmp_path / "together" / p / "config.json").read_text())["precision"] == p


def test_bad_input_is_one_error_line(capsys):
    assert precisions.main(["--precisions=fp32,fp8"]) == 2
    assert "--precisions must list each of fp32, bf16, fp16" in capsys.readouterr().err
    assert precisions.main(["--strategy=ddp"]) == 2
    assert "one-process strategies" in capsys.readouterr().err
    assert precisions.main(["--precision=bf16"]) == 2
    assert "--precisions=" in capsys.readouterr().err
