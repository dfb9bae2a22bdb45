"""Lesson 10: the scaling, DataLoader and ddp_vs_threads benchmarks, the multi-node commands, a two-agent job.

Speed is not asserted (a busy test machine would make that flaky): the benchmarks must run, write
complete JSON, and hold together (speedup of one process is 1, efficiency = speedup / n, the
strong-scaling runs train the same model). The generated torchrun lines must be accepted by
torchrun's own parser, and two torchrun agents joined by a c10d rendezvous must train MiniGPT to
the same losses as one process.
"""

from __future__ import annotations

import json
import math
import shlex

import notebook_runs
import pytest
from harness import TINY, TINY_MODEL, python_module

from ddp_course import bench
from ddp_course.course.l10_scaling import bench_dataloader, bench_scaling, multinode


def _scaling_run(tmp_path) -> dict:
    """Lesson 10's scaling benchmark (process counts 1, 2, 4) when the notebook ran it in this session
    (``notebook_runs``), else a small one of 1 and 2 processes."""
    base = notebook_runs.folder("runs/10_bench")
    if base is not None and notebook_runs.fresh(base / "scaling.json"):
        return json.loads((base / "scaling.json").read_text())
    res = bench_scaling.bench(nprocs="1,2", steps=6, log_interval=2, phase_steps=3, micro_batch_size=4, global_batch=4,
                              timeout_s=120, out=tmp_path, **TINY_MODEL)
    on_disk = json.loads((tmp_path / "scaling.json").read_text())
    assert on_disk["weak"] == res["weak"]  # what bench() returns is what it wrote
    return on_disk


def test_scaling_bench_holds_together(tmp_path):
    on_disk = _scaling_run(tmp_path)
    opts = on_disk["options"]
    nprocs, mbs, gb = opts["nprocs"], opts["micro_batch_size"], opts["global_batch"]
    for kind in ("weak", "strong"):
        rows = on_disk[kind]
        assert [r["nproc"] for r in rows] == nprocs and nprocs[0] == 1
        assert rows[0]["speedup"] == pytest.approx(1.0)
        for r in rows:
            assert r["tokens_per_s"] > 0 and r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
    assert [r["global_batch"] for r in on_disk["weak"]] == [mbs * n for n in nprocs]  # weak: the per-rank batch is fixed
    assert [r["micro_batch_size"] for r in on_disk["strong"]] == [gb // n for n in nprocs]  # strong: the global one
    # Strong scaling trains the same model on the same samples: losses agree up to float32 summation
    # order (~1e-7 per step); a rank training on the wrong data would differ by 1e-2 or more.
    assert on_disk["strong_final_loss_gap"] < 1e-4
    one, two = on_disk["phases"][:2]
    for key in bench_scaling.PHASES:
        assert one[key] >= 0 and two[key] >= 0, key
    assert one["comm_wait"] == 0.0 and one["allreduce_full_gradient"] == 0.0  # one process: no communication
    assert two["allreduce_full_gradient"] > 0 and "ddp_avg_backward_comm_time" in two


def test_scaling_bench_refuses_bad_options():
    with pytest.raises(bench_scaling.BenchError, match="must include 1"):
        bench_scaling.parse_options(["--nprocs=2,4"])
    with pytest.raises(bench_scaling.BenchError, match="does not split evenly"):
        bench_scaling.parse_options(["--nprocs=1,2,4", "--global_batch=6"])
    with pytest.raises(bench_scaling.BenchError, match="unknown option"):
        bench_scaling.parse_options(["--nproc=2"])


def test_dataloader_bench(tmp_path, one_thread):
    res = bench_dataloader.bench(batches=2, rounds=1, repeats=2, workers="0,1", prefetch="2,3", epochs=2, epoch_batches=2,
                           consumer="none", out=tmp_path)
    on_disk = json.loads((tmp_path / "dataloader.json").read_text())
    assert [r["label"] for r in on_disk["rows"]] == ["num_workers=0", "num_workers=1", "num_workers=1, prefetch_factor=3"]
    for r in on_disk["rows"]:
        assert r["per_batch_s"] > 0 and math.isfinite(r["speedup_vs_0_workers"])
    assert [p["persistent_workers"] for p in on_disk["persistent"]] == [False, True]
    assert all(len(p["first_batch_each_epoch_s"]) == 2 for p in on_disk["persistent"])
    if not res["pin_memory"]["measured"]:  # without CUDA: a reason, never a number
        assert "GPU" in res["pin_memory"]["reason"] and "rows" not in res["pin_memory"]


def test_dataset_tokenizes_like_the_course():
    from ddp_course.data import CharTokenizer

    text = "To be, or not to be, that is the question. " * 20
    tok = CharTokenizer.from_text(text)
    ds = bench_dataloader.TokenizeOnRead(text, tok.stoi, block_size=8, repeats=3)
    x, y = ds[2]
    assert tok.decode(x) == text[16:24] and tok.decode(y) == text[17:25]


@pytest.mark.parametrize("nnodes,nproc", [(2, 8), (4, 2), (1, 1)])
def test_generated_commands_parse(nnodes, nproc):
    spec = multinode.JobSpec(nnodes=nnodes, nproc=nproc, master_addr="10.0.0.1", args=("--strategy=ddp", "--max_steps=10"))
    summary = multinode.check_commands(spec)  # every line through torchrun's own argument parser
    assert [s["node_rank"] for s in summary["static"]] == list(range(nnodes))
    assert summary["c10d"]["rdzv_endpoint"] == "10.0.0.1:29500"
    assert summary["slurm"]["sbatch"]["nodes"] == str(nnodes)
    assert summary["slurm"]["torchrun"][-2:] == ["--strategy=ddp", "--max_steps=10"]
    # srun is given the cores again: Slurm 22.05 to 23.02 do not pass sbatch's --cpus-per-task on to it
    srun = next(ln for ln in multinode.slurm_script(spec).splitlines() if ln.startswith("srun "))
    assert shlex.split(srun)[:3] == ["srun", "--ntasks-per-node=1", "--cpus-per-task=$SLURM_CPUS_PER_TASK"]


def test_multinode_command_output_is_valid_torchrun():
    proc = python_module("ddp_course", ["multinode", "--nnodes=2", "--nproc=8", "--master_addr=10.0.0.1",
                                        "--nccl_debug=INFO", "--", "--strategy=ddp"], timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = [ln.split("  ", 1)[-1] for ln in proc.stdout.splitlines() if "torchrun --nnodes" in ln
             and not ln.startswith("srun")]
    assert len(lines) == 3  # two static lines and the c10d line
    for line in lines:
        words = shlex.split(line)
        multinode.parse_torchrun(words[words.index("torchrun"):])
    assert "#SBATCH --nodes=2" in proc.stdout and "NCCL_SOCKET_IFNAME" in proc.stdout


def test_torchrun_parser_refuses_a_broken_line():
    with pytest.raises(multinode.MultinodeError, match="torchrun refuses"):
        multinode.parse_torchrun(["torchrun", "--nnodes=2", "--no_such_flag=1", "-m", "ddp_course.train"])
    with pytest.raises(multinode.MultinodeError, match="unknown option"):
        multinode.spec_from_argv(["--nodes=2"])


def test_two_agents_c10d_rendezvous_train_minigpt(tmp_path):
    from ddp_course.config import to_cli
    from ddp_course.course.l04_ddp.two_nodes import run_two_nodes
    from ddp_course.launch import run
    from ddp_course.metrics import read_jsonl

    flags = {**TINY, "max_steps": 6, "log_interval": 2, "threads": 1, "device": "cpu"}
    from concurrent.futures import ThreadPoolExecutor

    two = tmp_path / "two_nodes"
    with ThreadPoolExecutor(max_workers=1) as pool:  # the one-process reference runs beside the two agents
        reference = pool.submit(run, "ddp_course.train", nproc=1, strategy="single", out_dir=tmp_path / "one",
                                timeout=120, progress=False, echo="none",
                                **{**flags, "micro_batch_size": 2 * TINY["micro_batch_size"]})
        cmds = run_two_nodes(two, nproc_per_node=1, timeout=120, rendezvous="c10d",
                             script=["-m", "ddp_course.train", *to_cli({**flags, "strategy": "ddp",
                                                                          "out_dir": str(two)})])
        one = reference.result()
    assert all("--rdzv_backend=c10d" in c for c in cmds)
    config = json.loads((two / "config.json").read_text())
    assert config["world_size"] == 2
    a = [r["loss"] for r in read_jsonl(two / "metrics.jsonl") if "loss" in r]
    b = [r["loss"] for r in one.train_rows]
    # same global batch, same samples: float32 summation order only (~1e-7); wrong data differs by 1e-2
    assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


# --- the ddp_vs_threads benchmark (two processes against one with two threads) ------------------------------

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
