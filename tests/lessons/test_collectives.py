"""Lesson 02: the collectives lab, the mismatch lab and the all-reduce benchmark -- each launched for
real with torchrun on gloo, each launch bounded by a timeout (the ring exercise's grader:
tests/exercises/test_exercise_02.py).

The 4-rank collectives lab is lesson 02's run of the same job (``notebook_runs.reuse``).
"""

from __future__ import annotations

import json
from pathlib import Path

import notebook_runs
import pytest

from ddp_course.launch import run

LAB = "ddp_course.course.l02_collectives.collectives"


def _per_rank(out_dir: Path, pattern: str) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in Path(out_dir).glob(pattern)), key=lambda d: d["rank"])


def _rec(result: dict, name: str) -> dict:
    return next(c for c in result["collectives"] if c["name"] == name)


def _check_collectives(ranks: list[dict], n: int) -> None:
    """Recompute every 'after' from the seeded inputs (not from the lab's own 'expected')."""
    from ddp_course.course.l02_collectives.collectives import K, chunk_inputs, reduce_inputs

    R, C, RS = reduce_inputs(n), chunk_inputs(n), reduce_inputs(n, n * K, seed=1)
    assert [d["rank"] for d in ranks] == list(range(n))
    for r, d in enumerate(ranks):
        assert d["world_size"] == n and d["backend"] == "gloo" and d["destroyed_after"]
        assert _rec(d, "all_reduce_sum")["before"] == R[r].tolist()
        # small integers, their sums and their averages over 2 or 4 ranks are exact in float32: compare exactly
        want = {"all_reduce_sum": R.sum(0).tolist(), "all_reduce_avg": R.mean(0).tolist(),
                "all_reduce_max": R.max(0).values.tolist(), "broadcast": R[0].tolist(),
                "all_gather": C.reshape(-1).tolist(), "scatter": [100.0 * (r * K + j + 1) for j in range(K)],
                "reduce_scatter": RS.sum(0)[r * K:(r + 1) * K].tolist(),
                "subgroup_all_reduce": R[r % 2::2].sum(0).tolist()}
        if r == 0:
            want |= {"reduce": R.sum(0).tolist(), "gather": C.reshape(-1).tolist()}
        for name, value in want.items():
            assert _rec(d, name)["after"] == value, (n, r, name)
            assert _rec(d, name)["ok"], (n, r, name)
        if r != 0:
            assert _rec(d, "gather")["after"] is None and not _rec(d, "reduce")["after_defined"]
            assert _rec(d, "scatter")["before"] is None
    arrivals = [_rec(d, "barrier")["arrive"] for d in ranks]
    assert all(_rec(d, "barrier")["leave"] >= max(arrivals) - 1e-3 for d in ranks), "left a barrier early"


def test_collectives_lab_4_ranks(tmp_path):
    job = notebook_runs.reuse("runs/02_collectives_4", LAB, 4) or \
        run(LAB, nproc=4, out_dir=tmp_path, timeout=120, echo="none", progress=False)  # lesson 02's job
    ranks = _per_rank(job.out_dir, "collectives_rank*.json")
    _check_collectives(ranks, 4)
    assert all(_rec(d, "all_reduce_avg")["native"] for d in ranks)  # gloo has AVG in the torch this course pins
    for d in ranks:  # the API takes reduce_scatter; what gloo runs under it is an all-reduce of the whole buffer
        rs = _rec(d, "reduce_scatter")
        assert rs["executed"] == ["gloo:all_reduce"] and rs["native"] is False, rs
        assert "no reduce-scatter of its own" in rs["note"] and "all-reduce's traffic" in rs["note"]


def test_native_means_the_backend_ran_a_reduce_scatter():
    """``native`` of the reduce_scatter record is what the backend ran, not whether the API call raised: lesson
    02 once printed "native reduce_scatter: True" on gloo, which ran the call as gloo:all_reduce (lesson 09's
    trace of FSDP shows it). No backend operation seen: no verdict."""
    from ddp_course.course.l02_collectives.collectives import runs_reduce_scatter

    assert runs_reduce_scatter(["gloo:all_reduce"]) is False
    assert runs_reduce_scatter(["nccl:_reduce_scatter_base"]) is True
    assert runs_reduce_scatter([]) is None


FALLBACK = '''
import sys

import torch.distributed as dist

from ddp_course.course.l02_collectives import collectives

real_all_reduce = dist.all_reduce


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op == dist.ReduceOp.AVG:
        raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")  # what older gloo builds say
    return real_all_reduce(tensor, op=op, group=group, async_op=async_op)


def no_reduce_scatter(*args, **kwargs):
    raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")


dist.all_reduce = all_reduce
dist.reduce_scatter_single = dist.reduce_scatter_tensor = dist.reduce_scatter = no_reduce_scatter
sys.exit(collectives.main(sys.argv[1:]))
'''


def test_collectives_lab_2_ranks_without_avg_and_reduce_scatter(tmp_path):
    """Where a backend lacks ReduceOp.AVG and reduce_scatter the lab shows the same results another way."""
    script = tmp_path / "old_gloo.py"
    script.write_text(FALLBACK)
    run(str(script), nproc=2, out_dir=tmp_path / "out", timeout=120, echo="none", progress=False,
        barrier_delay_s=0.1)
    ranks = _per_rank(tmp_path / "out", "collectives_rank*.json")
    _check_collectives(ranks, 2)
    for d in ranks:
        avg, rs = _rec(d, "all_reduce_avg"), _rec(d, "reduce_scatter")
        assert not avg["native"] and "no ReduceOp.AVG" in avg["note"] and "/= world_size" in avg["call"]
        assert not rs["native"] and "no reduce_scatter" in rs["note"] and "all_reduce" in rs["call"]
        assert rs["executed"] == ["gloo:all_reduce"]


def test_labs_refuse_bad_options(capsys, monkeypatch):
    from ddp_course.cli import FlagError, parse_flags
    from ddp_course.course.l02_collectives import collectives, mismatch

    assert collectives.main(["--out-dirr=x"]) == 2
    assert "unknown option --out_dirr" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    assert collectives.main([]) == 2
    assert "launch it with torchrun" in capsys.readouterr().err
    assert mismatch.main(["--case=sometimes"]) == 2
    assert "--case must be one of skip, order" in capsys.readouterr().err
    assert parse_flags(["--timeout_s=3", "--device=cpu"], {"timeout_s": 1.0, "device": "auto"}, "p") == \
        {"timeout_s": 3.0, "device": "cpu"}
    with pytest.raises(FlagError, match="expects a number"):
        parse_flags(["--timeout_s=soon"], {"timeout_s": 1.0}, "p")


def test_mismatch_ends_with_timeout_error_within_bound(tmp_path):
    timeout_s = 3.0
    r = run("ddp_course.course.l02_collectives.mismatch", nproc=2, out_dir=tmp_path, case="order", timeout_s=timeout_s, timeout=90,
            echo="none", progress=False, check=False)
    assert r.returncode != 0, "a mismatched job must fail"
    reports = _per_rank(tmp_path, "mismatch_rank*.json")
    assert len(reports) == 2, r.output[-2000:]
    for rep in reports:
        assert not rep["swap"]["correct"]  # swapped same-size all_reduces: wrong sums, no error
        err = rep["error"]
        assert err is not None and err["type"] == "RuntimeError"
        # The stuck call fails after the process-group timeout: not sooner (~0.1 s of timer slack), and not
        # much later (a loaded machine delays the wake-up by seconds at most).
        assert timeout_s - 0.5 <= err["waited_s"] <= timeout_s + 10, err
    # Both ranks' timers run out together; one may instead see its peer close the connection a moment later.
    assert any("timed out" in rep["error"]["message"].lower() for rep in reports), [x["error"] for x in reports]
    assert [rep["error"]["in_call"] for rep in reports] == ["all_reduce(loss)", "broadcast(params, src=0)"]
    assert r.elapsed_s < 90  # the launcher's timeout never had to act


def test_allreduce_bench_tiny(tmp_path):
    from ddp_course.course.l02_collectives import bench_allreduce

    res = bench_allreduce.bench(world_sizes="2", min_bytes=256, max_bytes=4096, repeats=2, block_s=0.002, warmup=1,
                          out=tmp_path)
    on_disk = json.loads((tmp_path / "allreduce.json").read_text())
    assert on_disk["jobs"][0]["world_size"] == 2 and on_disk["jobs"][0]["backend"] == "gloo"
    rows = on_disk["jobs"][0]["rows"]
    assert [row["bytes"] for row in rows] == [256, 1024, 4096]
    for row in rows:
        assert row["time_s"] > 0 and len(row["times_s"]) == 2 and row["iters"] >= 1
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert res["jobs"][0]["rows"] == rows
    assert bench_allreduce.main(["--world_sizes=1", f"--out={tmp_path / 'x'}"]) == 2  # refused before any launch
    assert bench_allreduce.main(["--max_bytes=lots"]) == 2
    assert not (tmp_path / "x").exists()
    assert bench_allreduce.bus_factor(4) == 1.5 and bench_allreduce.message_sizes(1, 64, 4) == [4, 16, 64]


