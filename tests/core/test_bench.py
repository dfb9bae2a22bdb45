"""The benchmarks run end to end on a tiny model and write their JSON.

Speed targets are not asserted here (a loaded test machine would make them flaky): they belong to
``python -m ddp_course.bench``. These tests check that the benchmarks run, that the same-work check
holds, and that their output is complete.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from harness import TINY_MODEL

from ddp_course import bench
from ddp_course.course.l01_minigpt import bench_overhead


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


def test_ddp_vs_threads_tiny(tmp_path):
    res = bench.run("ddp_vs_threads", **TINY_MODEL, steps=6, log_interval=3, batch=8, timeout_s=120.0, out=tmp_path)
    on_disk = json.loads((tmp_path / "ddp_vs_threads.json").read_text())
    assert on_disk["ddp_tokens_per_s"] > 0 and on_disk["threads_tokens_per_s"] > 0
    assert on_disk["ratio"] > 0 and on_disk["ratio"] == pytest.approx(res["ratio"])
    assert isinstance(on_disk["ddp_not_slower"], bool) and isinstance(on_disk["noisy"], bool)
    assert sorted(r["kind"] for r in on_disk["runs"]) == ["ddp", "threads"]
    for run in on_disk["runs"]:  # each run's own summary.json sits under the bench output folder
        summary = json.loads((tmp_path / "ddp_vs_threads" / f"{run['kind']}_1" / "summary.json").read_text())
        assert summary["steps"] == 6
        assert summary["world_size"] == (2 if run["kind"] == "ddp" else 1)


def test_cli_lists_benchmarks_and_refuses_unknown_keys(capsys, tmp_path):
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "overhead" in out and "ddp_vs_threads" in out
    for name in bench.module_benches():  # ddp_course/course/lNN_<topic>/bench_NAME.py run through the same command
        assert f"  {name} " in out
    assert bench.main(["overhead", "--help"]) == 0
    assert "--micro_batch_size=16" in capsys.readouterr().out
    assert bench.main(["overhead", "--nlayer=3", f"--out={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --nlayer" in err and "--n_layer" in err
    assert bench.main(["overhead", "--rounds=many"]) == 2
    assert "--rounds expects an integer" in capsys.readouterr().err
    assert bench.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert bench.main(["ddp_vs_threads", "--batch=7", f"--out={tmp_path}"]) == 1  # checked before any launch
    assert "divide evenly" in capsys.readouterr().err
    assert not (tmp_path / "ddp_vs_threads.json").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its new parent to reap it is not running
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups are POSIX")
def test_timeout_stops_the_whole_process_group(tmp_path):
    # a parent that starts a child and records its pid: both must be gone after the timeout
    pid_file = tmp_path / "child.pid"
    code = ("import pathlib, subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"pathlib.Path({str(pid_file)!r}).write_text(str(c.pid)); time.sleep(60)")
    script = tmp_path / "parent.py"
    script.write_text(code + "\n")
    with pytest.raises(bench.BenchError, match="did not finish"):
        bench.launch(str(script), 1, what="the parent", timeout=3.0, use_torchrun=False)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"child {child} of the timed-out command is still running"


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
