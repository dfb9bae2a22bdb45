"""The benchmark harness (``ddp_course.bench``): its command line lists every benchmark and refuses bad
options before any launch, and a timed-out command is stopped with its whole process group.

Each benchmark is run end to end, on a tiny model, by the tests of its lesson (lesson 01's ``overhead``
in ``tests/lessons/test_minigpt.py``, lesson 10's ``ddp_vs_threads`` in ``tests/lessons/test_scaling.py``).
Speed targets are not asserted in tests (a loaded test machine would make them flaky): they belong to
``python -m ddp_course.bench``.
"""

from __future__ import annotations

import os
import time

import pytest

from ddp_course import bench


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
