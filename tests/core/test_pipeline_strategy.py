"""``--strategy=pipeline`` (three dimensions) in the course's training loop, beyond what
``test_every_strategy`` runs (two stages on 2 ranks, nothing else split): on 4 ranks, the pipeline over
tensor parallelism (2 x 1 x 2) against one process at the same global batch, and the pipeline over FSDP
(2 x 2 x 1) against ``fsdp_tp`` on the same ranks (both read the batches of 2 data-parallel ranks), each
resumed from its step-2 checkpoint in fresh processes and ending where the uninterrupted run ends, to
the last bit. Plus the schedule and the layout, without a process group.

The runs: 4 AdamW steps, 2 micro-batches per step (1F1B with m = 2), gradient clipping on, fp32. The
sums are the same as one process's in other orders (over micro-batches, tensor parallelism's partial
products, FSDP's shards, the tied matrix's two copies): the losses and gradient norms agree to ~1e-7
relative (measured); 1e-5 is the pipeline labs' bound (``pp_lab.LOSS_RTOL``).
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import TINY, free_port, spawn

from ddp_course import checkpoint
from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.metrics import read_jsonl
from ddp_course.parallel import pipeline
from ddp_course.train import run_training

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD, STEPS, CKPT = 4, 4, 2
RTOL = 1e-5
RUN = {**TINY, "n_layer": 2, "n_head": 2, "n_embd": 32, "grad_accum_steps": 2, "max_steps": STEPS,
       "ckpt_interval": CKPT, "keep_last": STEPS, "log_interval": 1, "eval_interval": STEPS, "warmup_steps": 1,
       "lr": 3e-3, "grad_clip": 1.0, "sample_tokens": 8}
JOBS = {  # name: (options, checkpoint format)
    "pp_tp": ({"strategy": "pipeline", "pp": 2, "tp": 2}, "sharded"),
    "pp_fsdp": ({"strategy": "pipeline", "pp": 2, "tp": 1}, "full"),
    "fsdp_tp": ({"strategy": "fsdp_tp", "tp": 2}, "sharded"),  # the 2 data-parallel ranks' reference
}


def _cfg(name: str, out: Path, resume: bool = False) -> TrainConfig:
    options, fmt = JOBS[name]
    return TrainConfig(**{**RUN, **options, "ckpt_format": fmt, "resume": resume,
                          "out_dir": str(out / ("resumed" if resume else "straight") / name)})


def _jobs(rank: int, port: int, out: str, resume: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        info = DistInfo(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD, backend="gloo")
        for name in JOBS if not resume else ("pp_tp", "pp_fsdp"):
            cfg = _cfg(name, Path(out), resume)
            if resume and rank == 0:  # the uninterrupted run's step-2 checkpoint, as the latest
                src = checkpoint.checkpoint_path(_cfg(name, Path(out)).out_dir, CKPT, cfg.ckpt_format)
                dst = checkpoint.checkpoint_path(cfg.out_dir, CKPT, cfg.ckpt_format)
                dst.parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
                (dst.parent / checkpoint.POINTER).write_text(dst.name, encoding="utf-8")
            dist.barrier()
            run_training(cfg, info)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    spawn(_jobs, (free_port(), str(out), False), WORLD, deadline_s=300)
    spawn(_jobs, (free_port(), str(out), True), WORLD, deadline_s=300)
    one = TrainConfig(**{**RUN, "strategy": "single", "ckpt_interval": 0, "sample_tokens": 0,
                         "out_dir": str(out / "straight" / "single")})
    run_training(one, DistInfo())
    return out


def _rows(path: Path | str) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in read_jsonl(Path(path) / "metrics.jsonl")]


def _close(a: list[tuple], b: list[tuple]) -> float:
    assert [r[0] for r in a] == [r[0] for r in b]
    return max(abs(x - y) / abs(y) for ra, rb in zip(a, b) for x, y in zip(ra[1:], rb[1:]) if y is not None)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name, reference", [("pp_tp", "single"), ("pp_fsdp", "fsdp_tp")])
def test_the_pipeline_trains_like_its_reference_at_the_same_global_batch(runs, name, reference):
    mine, ref = _rows(runs / "straight" / name), _rows(runs / "straight" / reference)
    assert len(mine) == STEPS + 1 and all(r[2] is not None for r in mine if r[1] is not None)  # losses, norms, val
    assert _close(mine, ref) <= RTOL, (mine, ref)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ["pp_tp", "pp_fsdp"])
def test_a_resumed_pipeline_ends_where_the_uninterrupted_one_ends(runs, name):
    straight, resumed = runs / "straight" / name, runs / "resumed" / name
    assert _rows(resumed) == _rows(straight)[CKPT:]
    want, got = (torch.load(d / checkpoint.FINAL, weights_only=True)["model"] for d in (straight, resumed))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "tok_emb.weight" in want and "head.weight" in want  # every stage's part, merged: the whole model
    samples = [json.loads((d / "summary.json").read_text())["sample"] for d in (straight, resumed)]
    assert len(samples[0]) == RUN["sample_tokens"] and samples[0] == samples[1]


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_one_f_one_b_holds_at_most_pp_minus_s_micro_batches(pp, m):
    for s in range(pp):
        order = pipeline.one_f_one_b(m, pp, s)
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        held, peak = set(), 0
        for kind, i in order:
            if kind == "F":
                held.add(i)
            else:
                assert i in held, (s, order)  # a backward after its forward
                held.remove(i)
            peak = max(peak, len(held))
        assert peak == min(pp - s, m), (s, order)
        assert [k for k, _ in order[:min(pp - 1 - s, m)]] == ["F"] * min(pp - 1 - s, m)  # the warm-up


def test_the_stages_take_every_block_once():
    for n_layer, pp in ((4, 2), (5, 2), (1, 2), (7, 4), (3, 4)):
        spans = [pipeline.bounds(n_layer, pp, s) for s in range(pp)]
        assert spans[0][0] == 0 and spans[-1][1] == n_layer
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(hi - lo >= 1 for lo, hi in spans[:-1])


@pytest.mark.parametrize("change, world, said", [
    ({"pp": 1}, 4, "needs --pp=2 or more"),
    ({"tp": 3}, 4, "does not divide the 4 rank"),
    ({"n_layer": 1, "pp": 4}, 8, "cannot give each of the first 3"),
    ({"n_head": 1}, 4, "--n_head=1 does not divide by 2"),
    ({"precision": "fp16"}, 4, "does not take --precision=fp16"),
    ({"compile": True}, 4, "does not take --compile"),
])
def test_the_layout_refuses_what_the_pipeline_cannot_run(change, world, said):
    cfg = TrainConfig(**{**TINY, "strategy": "pipeline", "pp": 2, "tp": 2, "n_head": 2, **change})
    with pytest.raises(ConfigError, match=said):
        pipeline.layout(world, cfg)
    assert pipeline.layout(8, TrainConfig(**{**TINY, "strategy": "pipeline", "pp": 2, "tp": 2})) == (2, 2, 2)
