"""Lesson 14, part 1 (ring attention): the ring lab against one process at rings of 2 and 4 ranks, the
work, bytes and memory it measured against the formulas, MiniGPT trained on the ring; and, in one
process, the layouts and the formulas themselves.

The job is the notebook's: under ``make test`` the fixture reads the notebook's run of it
(``notebook_runs.reuse``) instead of launching it again.
"""

from __future__ import annotations

import json
import statistics
import sys

import notebook_runs
import pytest
import torch
from harness import run_command

from ddp_course.course.l14_sequences_and_experts import ring as R
from ddp_course.launch import run

LAB = "ddp_course.course.l14_sequences_and_experts.ring_lab"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    job = notebook_runs.reuse("runs/14_ring", LAB, 4)
    if job is None:
        job = run(LAB, nproc=4, out_dir=tmp_path_factory.mktemp("ring_lab"), timeout=300, progress=False, echo="none")
    return json.loads((job.out_dir / "ring_lab.json").read_text())


def test_layouts_cover_the_sequence_once():
    for world in (2, 4):
        for kind in R.LAYOUTS:
            chunks = sorted(c for r in range(world) for c in R.layout(kind, world)[r])
            assert chunks == list(range(R.n_chunks(kind, world)))
            x = torch.arange(8 * world).view(1, -1, 1)
            assert torch.equal(R.unshard([R.shard(x, kind, world, r) for r in range(world)], kind), x)
    assert R.layout("zigzag", 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert R.positions("zigzag", 2, 0, 8).tolist() == [0, 1, 6, 7]


def test_the_work_formula_balances_only_the_zigzag():
    plain = [w["blocks"] for w in R.predicted_work("plain", 4, 64)]
    zigzag = [w["blocks"] for w in R.predicted_work("zigzag", 4, 64)]
    assert plain == [1, 2, 3, 4] and zigzag == [9, 9, 9, 9]  # 2p + 1 half-size blocks on every rank
    # the same causal work in all: p(p+1)/2 blocks of (S/p)^2 against 2p(2p+1)/2 blocks of (S/2p)^2
    assert sum(w["score_elements"] for w in R.predicted_work("plain", 4, 64)) == 10 * 16 * 16
    assert sum(w["score_elements"] for w in R.predicted_work("zigzag", 4, 64)) == 36 * 8 * 8


@pytest.mark.timeout(420)
def test_ring_attention_equals_one_process_at_2_and_4_ranks(lab):
    assert set(lab["parity"]) == {f"{n}/{k}/{d}" for n in (2, 4) for k in R.LAYOUTS for d in ("float32", "float64")}
    for key, errs in lab["parity"].items():
        bound = lab["parity_rtol"] if key.endswith("float32") else 1e-13  # float64: ~1e-15 measured
        assert set(errs) == {"out", "dq", "dk", "dv"} and max(errs.values()) <= bound, (key, errs)


@pytest.mark.timeout(420)
def test_work_and_bytes_per_rank_are_the_formulas(lab):
    seq, n = lab["options"]["seq"], lab["world_size"]
    for kind, measured in lab["layouts"].items():
        predicted = R.predicted_work(kind, n, seq)
        for rank, (m, p) in enumerate(zip(measured["per_rank"], predicted)):
            assert (m["blocks"], m["score_elements"]) == (p["blocks"], p["score_elements"]), (kind, rank)
            assert m["bytes_sent"] == m["predicted_bytes"], (kind, rank)
    cpu = {k: [r["compute_s"] for r in v["per_rank"]] for k, v in lab["layouts"].items()}
    # The plain split's last rank computes 4 blocks to the first rank's 1 (about 3 times its CPU time,
    # measured), and zig-zag evens the ranks out. Neighbouring ranks differ by one block in 3 or 4, less
    # than CPU times move on 2 shared cores: under a loaded suite rank 3 once measured 6% below rank 2.
    # So only the large ratios are asserted, not the order of every rank.
    assert cpu["plain"][-1] > 1.5 * cpu["plain"][0], cpu
    busiest = {k: max(v) / statistics.mean(v) for k, v in cpu.items()}
    assert busiest["zigzag"] < busiest["plain"], busiest


@pytest.mark.timeout(420)
def test_no_rank_holds_the_score_matrix(lab):
    check = lab["peak_check"]  # the measure, on cases counted by hand (autograd's saved output included)
    assert check["saved_output_held"] >= check["one_result"] and check["after_the_graph_is_gone"] == 0
    assert check["two_alive"] == 2 * check["one_result"] and check["one_with_views"] == check["one_result"]
    mem = lab["one_process_memory"]
    # one process writing the scores out holds the matrix, its softmax and, in backward, their gradients
    assert mem["written_out"] >= 3 * mem["score_matrix_bytes"]
    for kind, measured in lab["layouts"].items():
        for m in measured["per_rank"]:
            assert m["peak_bytes"] < mem["score_matrix_bytes"] / 2, (kind, m["peak_bytes"])


@pytest.mark.timeout(420)
def test_minigpt_on_the_ring_trains_like_one_process(lab):
    f64, f32 = lab["training"]["float64"], lab["training"]["float32"]
    # 100 steps: float32's drift has reached its level by then (3.1e-4 at step 100, 3.9e-4 over 200 steps, measured)
    assert len(f64["loss_rel_diff"]) == lab["options"]["steps"] >= 100
    assert f64["ring_on"] != f32["ring_on"]  # the two precisions trained at once, on two rings of 2
    assert max(f64["loss_rel_diff"]) <= 1e-11  # rounding of float64 only (1.3e-13 measured, a ring of 2)
    assert f32["loss_rel_diff"][0] <= lab["parity_rtol"]  # the same weights: the first loss is one forward's rounding
    # every parameter's first gradient: the ranks' shares sum to one process's (a mean taken twice would not)
    assert len(f64["first_grad_rel_err"]) == len(f32["first_grad_rel_err"]) > 20
    assert max(f64["first_grad_rel_err"].values()) <= 1e-13 and max(f32["first_grad_rel_err"].values()) <= 1e-5
    assert f32["reference_losses"][-1] < f32["reference_losses"][0] - 1.0  # it learns


# PyTorch's context_parallel tried on the CPU in one process, as lesson 14's first cell does, once with the
# put-back and once without; then whether MiniGPT's attention still works in that process.
CP_ON_CPU = """
import contextlib
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from ddp_course.course.l14_sequences_and_experts.context_parallel import sdpa_put_back
original = F.scaled_dot_product_attention
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for guard in (sdpa_put_back, contextlib.nullcontext):
    q, k, v = torch.randn(3, 1, 2, 8, 4)
    try:
        with guard(), context_parallel(init_device_mesh("cpu", (1,)), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError:
        pass
    print(guard.__name__, "put back" if F.scaled_dot_product_attention is original else "left replaced")
    F.scaled_dot_product_attention = original
dist.destroy_process_group()
"""


def test_trying_pytorchs_context_parallel_leaves_attention_as_it_was():
    """Lesson 14's first cell tries PyTorch's context_parallel on the CPU (it raises) inside
    ``sdpa_put_back``: afterwards the kernel's attention is PyTorch's own again, whatever the version
    does on its own (2.10 leaves its wrapper in place; the line for ``nullcontext`` says what this one does)."""
    out = run_command([sys.executable, "-c", CP_ON_CPU], timeout=120).stdout
    assert "sdpa_put_back put back" in out, out
