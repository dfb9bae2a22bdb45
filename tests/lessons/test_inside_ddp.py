"""Lesson 05, inside DDP: communication hooks, uneven inputs with join(), buckets, buffers, overlap.

- Every communication hook of the course reduces the gradients to the mean over ranks, within the
  rounding its wire format allows, identically on every rank, and hands the network the bytes it
  promises (2-rank gloo, started with torch.multiprocessing.spawn).
- The ``ddp_internals`` lab (one torchrun launch): join() with uneven inputs completes and matches a
  one-process replay, while the same loop without join() fails with a timeout instead of hanging;
  buckets are rebuilt in reverse order; buffers agree only with broadcast_buffers; the unused-branch
  errors and their fixes.
- The ``ddp_profile`` lab writes Chrome traces in which small buckets start all-reducing during
  backward and one big bucket does not; the ``buckets`` benchmark writes its table.

Lesson 05 runs both labs: in ``make test`` these tests check the notebook's runs (``notebook_runs``),
with its settings; on their own they launch a smaller run of each.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import notebook_runs
import pytest
import torch
import torch.distributed as dist
from harness import free_port, spawn, torchrun

from ddp_course.cli import FlagError, parse_flags
from ddp_course.course.l05_inside_ddp import ddp_common
from ddp_course.dist import DistInfo, clean_exit
from ddp_course.launch import run
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.parallel import ddp as ddp_strategy

WORLD = 2
GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
PG_TIMEOUT_S = 30  # a collective waiting longer than this is a bug, not a slow machine
BUCKET_MB = 0.01  # ~10 kB buckets: the ~110 kB of gradients form several buckets


# --- unit checks: no processes ------------------------------------------------------------------------

def test_ring_bytes_and_flags():
    assert ddp_common.ring_bytes_sent("allreduce", 1000, 2) == 1000  # 2 (n-1)/n = 1 at n = 2
    assert ddp_common.ring_bytes_sent("allreduce", 1000, 4) == 1500
    assert ddp_common.ring_bytes_sent("allgather_base", 1000, 4) == 3000
    with pytest.raises(FlagError, match="Did you mean --steps"):
        parse_flags(["--stepz=3"], {"steps": 1}, prog="x")
    with pytest.raises(FlagError, match="expects an integer"):
        parse_flags(["--steps=many"], {"steps": 1}, prog="x")


# --- communication hooks under a real 2-rank process group --------------------------------------------

def _hooks_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with clean_exit():  # spawned workers end like torchrun's (ddp_course/dist.py)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
        tokens = torch.randint(GPT.vocab_size, (4, GPT.block_size + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        info = DistInfo(rank=rank, world_size=WORLD, local_world_size=WORLD, backend="gloo")
        torch.manual_seed(0)
        plain = MiniGPT(GPT)
        plain(x, y)[1].backward()
        local = torch.cat([p.grad.flatten() for p in plain.parameters()])
        per_rank = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(per_rank, local)
        results = {"per_rank_local": torch.stack(per_rank)}
        for name in ("none", "fp16", "bf16", "int8"):
            torch.manual_seed(0)
            model = MiniGPT(GPT)
            cfg = SimpleNamespace(bucket_cap_mb=BUCKET_MB, find_unused_parameters=False, static_graph=False,
                                  broadcast_buffers=True, comm_hook="none" if name == "int8" else name)
            ddp = ddp_strategy.wrap(model, info, cfg)  # the path `--comm_hook=...` takes in ddp_course.train
            if name == "int8":
                ddp.register_comm_hook(None, ddp_strategy.int8_hook)
            for _ in range(2):  # after the first backward DDP rebuilds its buckets: check both layouts
                model.zero_grad(set_to_none=True)
                loss = ddp(x, y)[1]  # (the second forward broadcasts the rebuilt bucket layout: not counted)
                with ddp_common.CollectiveCounter() as counter:
                    loss.backward()
            results[name] = {"grad": torch.cat([p.grad.flatten() for p in model.parameters()]),
                             "traffic": counter.summary(WORLD), "ops": counter.ops}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def hook_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hooks")
    spawn(_hooks_worker, (free_port(), str(out)), WORLD)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


# Per-element error bounds, from the arithmetic of each hook (g0, g1: the two ranks' local gradients):
# - none: float32 sum of g/2 terms, one rounding: 2^-24 relative; 2^-22 leaves room for gloo's order.
# - fp16/bf16: each rank rounds g/2 to the format (unit roundoff u = 2^-11 / 2^-8), the sum is rounded
#   again: |err| <= 2u (|g0| + |g1|) / 2; fp16 also flushes values below its subnormal spacing 2^-24,
#   at most 2^-25 per rounding, three of them.
# - int8: each rank's value is off by at most half a step, max|g_r| / 254 (max over its bucket, here
#   bounded by the max over the whole gradient), and the mean halves the sum of those.
# The 1.01 factors absorb the float32 arithmetic of decoding.
def _bound(name: str, g: torch.Tensor) -> torch.Tensor:
    mean_abs = g.abs().mean(dim=0)
    if name == "none":
        return 2.0 ** -22 * mean_abs + 1e-12
    if name == "fp16":
        return 1.01 * 2 * 2.0 ** -11 * mean_abs + 3 * 2.0 ** -25
    if name == "bf16":
        return 1.01 * 2 * 2.0 ** -8 * mean_abs + 1e-30
    if name == "int8":
        return torch.full_like(mean_abs, 1.01 * sum(float(gr.abs().max()) for gr in g) / (2 * 254))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16", "int8"])
def test_comm_hook_reduces_to_the_mean(hook_results, name):
    g = hook_results[0]["per_rank_local"].double()  # (world, n): every rank's own gradient
    exact = g.mean(dim=0)
    got = [r[name]["grad"].double() for r in hook_results]
    assert torch.equal(got[0], got[1]), f"{name}: the ranks hold different reduced gradients"
    err = (got[0] - exact).abs()
    bound = _bound(name, g)
    worst = int((err / bound).argmax())
    assert bool((err <= bound).all()), (f"{name}: reduced gradient off the exact mean by {float(err[worst]):.3g} "
                                        f"at element {worst}, above the bound {float(bound[worst]):.3g}")
    if name != "none":  # compression really happened: not the exact float32 result
        assert float(err.max()) > 0


@pytest.mark.parametrize("name,dtype,bytes_per_elem", [("none", "float32", 4), ("fp16", "float16", 2),
                                                       ("bf16", "bfloat16", 2), ("int8", "uint8", 1)])
def test_comm_hook_bytes_on_the_wire(hook_results, name, dtype, bytes_per_elem):
    n = hook_results[0]["per_rank_local"].shape[1]
    traffic = hook_results[0][name]["traffic"]
    assert traffic["dtypes"] == [dtype]
    n_buckets = sum(traffic["ops"].values())
    assert n_buckets > 2, "BUCKET_MB should split the gradient into several buckets"
    extra = 4 * n_buckets if name == "int8" else 0  # int8 sends each bucket's float32 scale
    assert traffic["payload_bytes"] == n * bytes_per_elem + extra


# --- the ddp_internals lab: join, buckets, buffers, unused parameters, static graph ------------------

INTERNALS = "ddp_course.course.l05_inside_ddp.ddp_internals"
# Without lesson 05's run (every part, the lab's defaults): a small model, the smallest buckets, few steps.
SMALL_INTERNALS = {"parts": "buckets,gradhook,buffers,unused,static,join", "bucket_caps": "25,0.01", "cost_steps": 2,
                   "cost_rounds": 1, "pg_timeout_s": 2.0, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                   "micro_batch_size": 4}


@pytest.fixture(scope="module")
def internals(tmp_path_factory):
    job = notebook_runs.reuse("runs/05_internals", INTERNALS, 2) or \
        run(INTERNALS, nproc=2, out_dir=tmp_path_factory.mktemp("internals"), timeout=150, echo="none",
            progress=False, **SMALL_INTERNALS)
    return json.loads((job.out_dir / "internals.json").read_text())


def test_join_with_uneven_inputs_completes(internals):
    j = internals["join"]
    assert j["batches_per_rank"] == [3, 5]
    assert [r["steps_done"] for r in j["with_join"]["per_rank"]] == [3, 5]
    assert j["with_join"]["max_diff_between_ranks"] == 0.0  # join broadcasts the last rank's model at the end
    for r in j["with_join"]["per_rank"]:
        # DDP and the replay add the same float32 gradients, g/2 per rank (division by 2 is exact),
        # in the same order: only the SGD arithmetic could differ, by a few ulps of weights ~0.3.
        assert r["max_diff_vs_reference"] <= 1e-6


def test_without_join_the_longer_rank_fails_with_a_timeout(internals):
    short, long_ = internals["join"]["without_join"]
    assert short["error"] is None and short["steps_done"] == 3
    err = long_["error"]
    assert err is not None and "Timed out" in err["message"]
    assert long_["steps_done"] == 3  # the matched steps went through; the 4th all-reduce found nobody
    # bounded by the process-group timeout, not a hang (slack for a loaded machine)
    timeout_s = internals["options"]["pg_timeout_s"]
    assert timeout_s * 0.9 <= err["after_s"] <= timeout_s + 10


def test_buckets_rebuilt_in_reverse_order(internals):
    b = internals["buckets"]
    by_cap = {c["bucket_cap_mb"]: c for c in b["caps"]}
    assert by_cap[25.0]["allreduces_per_step"] == [1, 1, 1]
    small = by_cap[min(by_cap)]  # the smallest buckets: several per step
    assert small["allreduces_per_step"][0] == 1  # first step: one bucket, before DDP knows the order
    assert small["allreduces_per_step"][2] > 3
    first, last = small["buckets_rebuilt"][0]["params"], small["buckets_rebuilt"][-1]["params"]
    assert any(n.startswith(f"blocks.{internals['options']['n_layer'] - 1}.") or n.startswith("ln_f") for n in first)
    assert "tok_emb.weight" in last  # the tied embedding's gradient is complete only at the very end
    # every parameter is in exactly one bucket
    names = [n for bucket in small["buckets_rebuilt"] for n in bucket["params"]]
    assert sorted(names) == sorted(b["param_order"])
    # the bucket is launched right after its last gradient is ready
    events = small["events_rebuilt"]
    launches = [i for i, e in enumerate(events) if e["kind"] == "all-reduce launched"]
    readies = [i for i, e in enumerate(events) if e["kind"] == "grad ready"]
    assert launches[0] < readies[-1], "the first bucket should be all-reduced while backward goes on"


def test_gradient_hook_and_buffers(internals):
    for r in internals["gradhook"]["per_rank"]:
        assert r["max_err_vs_expected"] <= 1e-6  # (2 g0 + g1) / 2 in float32
        assert r["max_diff_vs_plain_mean"] > 1e-4  # and visibly not the plain mean
    buf = internals["buffers"]
    assert max(buf["on"]["gap_at_forward_start"]) == 0.0
    assert buf["off"]["gap_at_forward_start"][0] == 0.0  # equal at the start (DDP's one broadcast)
    assert buf["off"]["gap_at_forward_start"][-1] > 0.1  # then drift apart (data shifted by 3 per rank)


def test_unused_parameters_errors_and_fixes(internals):
    u = internals["unused"]
    assert "Expected to have finished reduction" in u["skipped_everywhere"]["error"]["message"]
    r0, r1 = u["skipped_on_rank1"]
    assert "Timed out" in r0["error"]["message"]  # rank 0 waits for a bucket rank 1 never offers
    assert "Expected to have finished reduction" in r1["error"]["message"]
    for case in u["fixed"].values():
        assert case["steps_done"] == 3 and case["max_grad_err"] <= 1e-6
    s = internals["static"]
    assert s["steps_done"] == 3 and s["max_grad_err"] <= 1e-6 and s["branch_grad_none"]
    assert set(s["cost"]["median_ms"]) == {"default", "find_unused_parameters", "static_graph"}


# --- the profile lab and the bucket benchmark ----------------------------------------------------------

TINY_PROFILE = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--micro_batch_size=4",
                "--trace_steps=1", "--steps=2", "--rounds=1", "--warmup=2"]


def test_profile_trace_shows_overlap(tmp_path):
    lesson = notebook_runs.reuse("runs/05_profile", "ddp_course.course.l05_inside_ddp.ddp_profile", 2, n_layer=2,
                                 bucket_cap_mb=0.25, steps=5, rounds=3)  # lesson 05's run: 0.25 MB buckets
    out = lesson.out_dir if lesson else tmp_path
    if lesson is None:
        torchrun("ddp_course.course.l05_inside_ddp.ddp_profile", 2,
                 [f"--out_dir={tmp_path}", "--bucket_cap_mb=0.01", *TINY_PROFILE], timeout=150)
    res = json.loads((out / "profile.json").read_text())
    for v in ("overlap", "one_bucket", "by_hand"):
        trace = json.loads((out / f"trace_{v}.json").read_text())  # a valid Chrome trace
        assert any(e.get("name") == "gloo:all_reduce" for e in trace["traceEvents"])
        assert res["variants"][v]["median_ms"] > 0
    stats = {v: res["variants"][v]["trace_stats"] for v in res["variants"]}
    assert stats["overlap"]["n_allreduce"] > 2 and stats["overlap"]["launched_during_backward"] >= 1
    assert stats["one_bucket"]["n_allreduce"] == 1 and stats["one_bucket"]["launched_during_backward"] == 0
    assert stats["by_hand"]["launched_during_backward"] == 0
    n_params = res["variants"]["by_hand"]["traffic"]["ops"]["allreduce"]
    shape = {k: res["options"][k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
    assert n_params == len(list(MiniGPT(GPTConfig(**shape)).parameters()))


def test_bucket_benchmark_tiny(tmp_path):
    from ddp_course.course.l05_inside_ddp import bench_buckets

    res = bench_buckets.run_bench(caps="0.01,25", n_layer=2, n_head=2, n_embd=32, block_size=16, micro_batch_size=4,
                            steps=1, rounds=1, warmup=2, timeout_s=150, out=tmp_path)
    on_disk = json.loads((tmp_path / "buckets.json").read_text())
    assert on_disk["rows"] == res["rows"]
    counts = {r["bucket_cap_mb"]: r["allreduces_per_step"] for r in on_disk["rows"]}
    assert counts[25.0] == 1 and counts[0.01] > 1
    assert all(r["median_ms"] > 0 for r in on_disk["rows"])
    assert bench_buckets.main(["--caps=0,1"]) == 2  # refused before anything starts
