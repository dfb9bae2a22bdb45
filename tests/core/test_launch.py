"""The launcher: failures surface the failing rank's traceback, bad input fails before any process
starts, and neither a timeout nor an interrupt leaves a process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from harness import ROOT, TINY, python_module

from ddp_course import launch, postmortem
from ddp_course.config import ConfigError
from ddp_course.launch import LaunchError, LaunchStalled, LaunchTimeout, run


def tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries DDP_TEST_TAG=tag."""
    needle = f"DDP_TEST_TAG={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="process checks read /proc (Linux)")


def test_failing_rank_traceback_is_in_the_error(tmp_path):
    with pytest.raises(LaunchError) as err:
        run("ddp_course.train", nproc=2, strategy="ddp", max_steps=20, fail_at_step=3, fail_rank=1,
            out_dir=tmp_path / "crash", echo="none", progress=False, timeout=120, **TINY)
    msg = str(err.value)
    # the root cause, not the other rank's "connection closed" consequence, in the frames as Python shows them
    assert "rank 1 raised RuntimeError: injected failure on rank 1 at step 3" in msg
    assert 'File "ddp_course/train.py", line' in msg and "rank 0 then lost its peer" in msg
    assert "ChildFailedError" not in msg and "error_file" not in msg  # never torchrun's own report
    assert err.value.run.returncode != 0


# Rank 0 dies of a segmentation fault inside torch's @record, as ddp_course.train's ranks run; rank 1 then
# waits for it in a barrier
SEGFAULT_ON_RANK_0 = """
import ctypes

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        ctypes.string_at(0)
    dist.barrier()


main()
"""


def test_a_rank_that_died_of_a_segmentation_fault_is_named_as_the_cause(tmp_path):
    """torch's @record enables faulthandler again, to stderr, in every rank it wraps: the crash must still
    reach the rank's own file (the start-up hook keeps it there), and the report name the crashed rank as
    the cause, not as one torchrun stopped."""
    script = tmp_path / "segfault.py"
    script.write_text(SEGFAULT_ON_RANK_0)
    r = run(str(script), nproc=2, out_dir=tmp_path / "job", echo="none", progress=False, timeout=120, check=False)
    msg = r.failure() or ""
    assert r.returncode != 0
    assert "rank 0 ended with no Python exception" in msg and "Segmentation fault" in msg, msg
    # rank 1 either sees its peer go (then lost its peer) or is stopped by torchrun first: never rank 0
    for line in msg.splitlines():
        if "stopped by torchrun" in line:
            assert line.startswith("rank 1 "), msg


def test_bad_input_fails_before_any_process_starts(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="Did you mean --max_steps"):
        run("ddp_course.train", nproc=2, strategy="ddp", max_step=3, out_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="does not divide"):
        run("ddp_course.train", nproc=2, strategy="ddp", global_batch_size=30, micro_batch_size=4,
            out_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match="runs in one process, but this job has 2 ranks"):
        run("ddp_course.train", nproc=2, strategy="single", out_dir=tmp_path / "c")
    assert time.monotonic() - t0 < 5, "validation must not launch torchrun"


def test_timeout_stops_every_process(tmp_path):
    tag = uuid.uuid4().hex
    raised: list[BaseException] = []

    def job() -> None:
        try:
            run("ddp_course.train", nproc=2, strategy="ddp", max_steps=10**6, out_dir=tmp_path / "t",
                echo="none", progress=False, timeout=8, env={"DDP_TEST_TAG": tag}, **{**TINY, "log_interval": 50})
        except BaseException as exc:  # checked below, in the test's thread
            raised.append(exc)

    launcher = threading.Thread(target=job)
    launcher.start()
    # 8 s: torchrun starts its 2 workers once it has imported torch; all 3 processes were alive 1.4-1.5 s
    # after the launch on a 2-core machine, well before the timeout stops them
    most = 0  # the job's processes seen at once while it ran: without them, "none left" proves nothing
    while launcher.is_alive():
        most = max(most, len(tagged_processes(tag)))
        time.sleep(0.2)
    launcher.join()
    assert most >= 3, f"expected torchrun and 2 workers carrying the tag while the job ran, saw at most {most}"
    assert len(raised) == 1 and isinstance(raised[0], LaunchTimeout), raised
    assert "ran past its timeout" in str(raised[0])
    assert tagged_processes(tag) == []


def test_a_job_whose_processes_all_wait_is_stopped_with_where_they_were(tmp_path, capsys, monkeypatch):
    """``idle_s``: no process of the job used the CPU for that long (here one rank sleeps, the other
    waits for it in an all-reduce whose timeout is far away), so the job is stopped with both lines,
    and the wait is announced while it lasts."""
    if not Path("/proc").is_dir():
        pytest.skip("the stall watch reads /proc (Linux)")
    script = tmp_path / "stall.py"
    script.write_text("import time\nimport torch\nimport torch.distributed as dist\n"
                      "from ddp_course.dist import setup\n"
                      "with setup(device='cpu', timeout_s=300) as info:\n"
                      "    if info.rank == 1:\n"
                      "        time.sleep(300)\n"
                      "    dist.all_reduce(torch.ones(1))\n", encoding="utf-8")
    monkeypatch.setattr(launch._Stall, "SAY_AFTER_S", 2.0)
    with pytest.raises(LaunchStalled) as raised:
        run(str(script), nproc=2, echo="none", progress=False, timeout=120, idle_s=4, out_dir=tmp_path / "o")
    where = raised.value.run.hang(script)
    assert "rank 0 was at" in where and "dist.all_reduce(torch.ones(1))" in where, where
    assert "rank 1 was at" in where and "time.sleep(300)" in where, where
    assert "used the CPU for 4 s" in str(raised.value), raised.value
    assert "Waiting: no process of the job has used the CPU" in capsys.readouterr().out


def test_the_start_up_hook_and_the_launcher_name_the_job_alike():
    """A rank whose collective timed out finds the job's other ranks by the id the launcher gives them."""
    hook = (postmortem.SITE / "sitecustomize.py").read_text(encoding="utf-8")
    assert f'JOB_VAR = "{launch._JOB_VAR}"' in hook


def test_keyboard_interrupt_stops_every_process(tmp_path):
    tag = uuid.uuid4().hex
    out = tmp_path / "int"
    script = (
        # Ctrl-C raises KeyboardInterrupt, as in a notebook kernel, also when this test was started by a
        # shell that runs it in the background (the child would inherit SIGINT ignored and train on)
        "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from ddp_course.launch import run\n"
        f"run('ddp_course.train', nproc=2, strategy='ddp', max_steps=10**6, out_dir={str(out)!r}, progress=False,\n"
        f"    env={{'DDP_TEST_TAG': {tag!r}}}, **{dict(TINY)!r})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "training did not start within 90 s"
            time.sleep(0.2)
        workers = tagged_processes(tag)
        assert len(workers) >= 3, f"expected torchrun and 2 workers, found {workers}"
        proc.send_signal(signal.SIGINT)  # what the notebook's stop button sends to the kernel
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say what was still running, and what the launcher printed
            left = {pid: _cmdline(pid) for pid in tagged_processes(tag)}
            proc.kill()
            output, _ = proc.communicate()
            pytest.fail(f"the launcher did not exit within 60 s of SIGINT; job processes left: {left}\n"
                        f"its last output:\n{output[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Interrupted: stopped the job" in output
    time.sleep(0.5)
    assert tagged_processes(tag) == [], "processes of the interrupted job are still running"


def test_run_returns_metrics_and_rerun_starts_clean(tmp_path):
    kw = dict(nproc=1, strategy="single", max_steps=10, out_dir=tmp_path / "r", echo="none", progress=False,
              timeout=120, **TINY)
    first = run("ddp_course.train", **kw)
    assert [r["step"] for r in first.train_rows] == [5, 10]
    assert first.summary["steps"] == 10 and first.config["world_size"] == 1
    second = run("ddp_course.train", **{**kw, "max_steps": 5})
    # the folder is re-used: the second run's metrics must not be appended to the first's
    assert [r["step"] for r in second.train_rows] == [5]


def test_cli_run_reports_a_crash(tmp_path):
    proc = python_module("ddp_course", ["run", "--nproc=2", "--strategy=ddp", "--max_steps=20", "--fail_at_step=2",
                                        f"--out_dir={tmp_path / 'cli'}", "--n_layer=1", "--n_embd=32",
                                        "--block_size=32", "--micro_batch_size=4"], timeout=120, check=False)
    assert proc.returncode == 1
    assert "injected failure on rank 0" in proc.stderr
