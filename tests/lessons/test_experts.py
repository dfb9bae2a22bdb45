"""Lesson 14's mixture of experts: the expert-parallel layer trains as one process does, drops the same
token-slots, and sends exactly the rows and bytes the routers' choices predict.

The lab on 4 ranks (its parity on all 4 and on ranks 0 and 1; its two training runs on two pairs of ranks
at once) feeds the tests that take ``lab``: the notebook's run when this session has it. The others run
the one-process layer in this process, on hand-made routings small enough to check by hand.
"""

from __future__ import annotations

import json

import notebook_runs
import pytest
import torch
import torch.nn as nn

from ddp_course.cli import FlagError
from ddp_course.course.l14_sequences_and_experts import experts as moe
from ddp_course.course.l14_sequences_and_experts import moe_lab
from ddp_course.dist import seeded
from ddp_course.launch import run
from ddp_course.model import GPTConfig

LAB = "ddp_course.course.l14_sequences_and_experts.moe_lab"
TRAIN = {"train_steps": 40}  # enough steps for the collapse without the auxiliary loss; the notebook runs 200


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The lab on 4 ranks: lesson 14's run when this session has it, else a run of its own (``TRAIN``)."""
    job = notebook_runs.reuse("runs/14_moe", LAB, 4)
    if job is None:
        job = run(LAB, nproc=4, out_dir=tmp_path_factory.mktemp("moe_lab"), timeout=240, progress=False,
                  echo="none", **TRAIN)
    return json.loads((job.out_dir / "moe_lab.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def trained(lab):
    """The same lab: its training runs, on 2 ranks each (lesson 14, section 12)."""
    return lab


# --- the lab on 4 ranks, its parity also on 2 --------------------------------------------------------------


@pytest.mark.timeout(300)
def test_expert_parallel_trains_as_one_process(lab):
    tol = lab["tolerances"]
    assert lab["world_size"] == 4 and lab["options"]["capacity_factor"] < 1 and set(lab["parity"]) == {"2", "4"}
    f32, f64 = lab["parity"]["4"]["float32"], lab["parity"]["4"]["float64"]
    assert f32["loss_rel_diff"] <= tol["loss_rtol"] and f32["grad_rel_err"] <= tol["grad_rtol"], f32["worst_grad"]
    assert f32["update_rel_diff"] <= tol["update_rtol"]
    # every parameter of the one-process model compared once: the replicated ones on each rank, each expert on its own
    n_experts, L = lab["options"]["n_experts"], lab["options"]["n_layer"]
    replicated = 2 + L * (4 + 4 + 1) + 2  # embeddings; per block two norms, qkv and proj, the router; the last norm
    assert f32["grads_compared"] == 4 * replicated + L * n_experts * 4
    # float64: the same algorithm, ~1e-15 from one process -- what float32 leaves is rounding
    assert max(f64["loss_rel_diff"], f64["grad_rel_err"]) <= tol["fp64_rtol"]
    assert f64["update_rel_diff"] <= 1e-9
    # on 2 ranks (ranks 0 and 1 of the same launch): the same bounds, each of the 2 ranks holding half the experts
    two32, two64 = lab["parity"]["2"]["float32"], lab["parity"]["2"]["float64"]
    assert two32["loss_rel_diff"] <= tol["loss_rtol"] and two32["grad_rel_err"] <= tol["grad_rtol"], two32["worst_grad"]
    assert two32["update_rel_diff"] <= tol["update_rtol"] and two32["grads_compared"] == 2 * replicated + L * n_experts * 4
    assert max(two64["loss_rel_diff"], two64["grad_rel_err"]) <= tol["fp64_rtol"] and two64["update_rel_diff"] <= 1e-9


@pytest.mark.timeout(300)
def test_the_same_slots_are_dropped_and_some_are(lab):
    for size, name in ((s, d) for s in ("2", "4") for d in ("float32", "float64")):
        v = lab["parity"][size][name]
        assert v["dropped"] == v["reference_dropped"], (size, name)
        assert all(d > 0 for step in v["dropped"] for d in step), "a capacity factor below 1 must drop slots"
        o = lab["options"]
        want = moe.capacity(o["batch_size"] * o["block_size"], o["top_k"], o["n_experts"], o["capacity_factor"])
        assert all(c == want for step in v["capacity"] for c in step)


@pytest.mark.timeout(300)
def test_rows_and_bytes_equal_what_the_routers_predict(lab):
    assert lab["parity"]["2"]["float32"]["traffic_matches"] and lab["parity"]["2"]["float32"]["tokens_match"]
    v = lab["parity"]["4"]["float32"]
    assert v["tokens_match"] and v["traffic_matches"]
    assert v["tokens_per_expert"] == v["reference_tokens_per_expert"]
    o = lab["options"]
    slots = o["batch_size"] // 4 * o["block_size"] * o["top_k"]  # one rank's token-slots
    for row in v["traffic"]:
        m = row["measured"]
        assert m == row["predicted"], row["rank"]
        assert m["dispatch"] == o["n_layer"] * slots * o["n_embd"] * 4  # float32: every slot leaves, dropped or not
        assert m["dispatch.others"] < m["dispatch"] and m["combine.backward"] == m["dispatch"]
    sent = sum(r["measured"]["dispatch"] for r in v["traffic"])
    assert sent == sum(r["measured"]["combine"] for r in v["traffic"])  # each row received is sent back


@pytest.mark.timeout(300)
def test_training_records_the_balance_and_the_aux_loss_evens_it(trained):
    lab = trained
    runs = lab["training"]
    none, aux = runs["aux_coef=0"], runs[f"aux_coef={lab['options']['aux_coef']:g}"]
    steps = lab["options"]["train_steps"]
    for r in (none, aux):
        assert len(r["imbalance"]) == len(r["dropped_fraction"]) == steps
        assert all(1 <= x <= r["n_experts"] / r["top_k"] for x in r["imbalance"])
    assert none["on_ranks"] == [0, 1] and aux["on_ranks"] == [2, 3]  # two pairs of ranks at once
    # without the auxiliary loss the routers collapse: some rank's experts get no row at all in a block,
    # and the job still finishes (the empty rank takes part in every backward exchange)
    ranks = none["ranks"]
    per_rank = lab["options"]["n_experts"] // ranks
    assert any(sum(layer[r * per_rank:(r + 1) * per_rank]) == 0 for step in none["tokens_per_expert"]
               for layer in step for r in range(ranks))
    assert aux["last"]["imbalance"] < none["last"]["imbalance"]
    assert aux["last"]["dropped_fraction"] < none["last"]["dropped_fraction"]
    assert aux["last"]["aux"] < none["last"]["aux"]


@pytest.mark.timeout(60)
def test_the_balance_figure_draws_the_lab_data(trained):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_course.course.l14_sequences_and_experts.figures import moe_balance, running_mean

    fig = moe_balance(trained["training"])
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2 * len(trained["training"]) + 2
    plt.close(fig)
    assert running_mean([1, 3, 5, 7], 2) == [1, 2, 4, 6]


# --- the one-process layer, by hand ---------------------------------------------------------------------------


def test_capacity_is_exact_arithmetic():
    assert moe.capacity(256, 2, 8, 0.75) == 48
    assert moe.capacity(256, 1, 8, 1.0) == 32 and moe.capacity(10, 1, 4, 1.0) == 3
    assert 1.1 * 100 * 2 / 4 > 55 and moe.capacity(100, 2, 4, 1.1) == 55  # floats would give 56


def test_kept_slots_follow_slot_order():
    expert = torch.tensor([0, 1, 0, 0, 1, 0])
    assert moe.kept_slots(expert, 2, 2).tolist() == [True, True, True, False, True, False]
    assert moe.dropped_slots(torch.bincount(expert), 2) == 2


def layer(weight: list[list[float]], top_k: int, factor: float) -> moe.MoE:
    """An MoE of width 4 whose router is ``weight`` (E, 4): token ``e_i`` (a basis vector) gets the logits
    ``weight[:, i]``."""
    with seeded(0):
        m = moe.MoE(GPTConfig(vocab_size=8, n_embd=4, n_head=1), len(weight), top_k, factor)
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor(weight))
    return m.double()


def test_tokens_over_capacity_are_dropped_in_token_order():
    m = layer([[5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 0.0, 0.0]], top_k=1, factor=0.5)  # every token picks expert 0
    x = torch.eye(4, dtype=torch.float64).view(1, 4, 4)
    out = m(x)
    assert m.capacity == 1 and m.tokens_per_expert.tolist() == [4, 0] and m.dropped == 3
    gate = torch.softmax(torch.tensor([5.0, 0.0], dtype=torch.float64), 0)[0]
    assert torch.allclose(out[0, 0], m.experts[0](x[0, :1])[0] * gate)
    assert torch.count_nonzero(out[0, 1:]) == 0  # the residual carries the dropped tokens


def test_a_second_choice_can_take_a_later_first_choice_s_place():
    # token 0 chooses (0, 1), token 1 chooses (1, 2); capacity 1: expert 1 serves token 0's second choice
    m = layer([[2.0, 0.0, 0, 0], [1.0, 2.0, 0, 0], [0.0, 1.0, 0, 0]], top_k=2, factor=0.75)
    x = torch.eye(4, dtype=torch.float64)[:2].view(1, 2, 4)
    out = m(x)[0]
    assert m.capacity == 1 and m.tokens_per_expert.tolist() == [1, 2, 1] and m.dropped == 1
    r = moe.route(m.router, x[0], 2)
    assert r.expert.tolist() == [[0, 1], [1, 2]]
    assert torch.allclose(r.gate.sum(1), torch.ones(2, dtype=torch.float64))  # top-2: renormalised
    want0 = r.gate[0, 0] * m.experts[0](x[0, :1]) + r.gate[0, 1] * m.experts[1](x[0, :1])
    want1 = r.gate[1, 1] * m.experts[2](x[0, 1:])  # its first choice was dropped
    assert torch.allclose(out, torch.cat([want0, want1]))


def test_top1_gate_is_the_chosen_probability():
    router = nn.Linear(3, 4, bias=False)
    h = torch.randn(5, 3)
    r = moe.route(router, h, 1)
    assert torch.equal(r.gate[:, 0], r.probs.max(1).values)


def test_aux_loss_by_hand():
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])  # P = (0.75, 0.25)
    assert moe.aux_loss(probs, torch.tensor([3, 1])).item() == pytest.approx(2 * (0.75 * 0.75 + 0.25 * 0.25))
    uniform = torch.full((4, 4), 0.25)
    assert moe.aux_loss(uniform, torch.tensor([2, 2, 2, 2])).item() == pytest.approx(1.0)


def test_inverse_undoes_a_permutation():
    perm = torch.tensor([2, 0, 3, 1])
    t = torch.arange(4) * 10
    assert torch.equal(t[perm][moe.inverse(perm)], t)


def test_predicted_traffic_by_hand():
    counts = [[3, 1], [2, 4]]  # rank 0's slots to experts 0, 1; rank 1's; rank r holds expert r
    p = moe_lab.predicted_traffic(counts, 0, row_bytes=10)
    assert (p["dispatch"], p["dispatch.others"], p["combine"], p["combine.others"]) == (40, 10, 50, 20)
    assert p["dispatch.backward"] == p["combine"] and p["combine.backward"] == p["dispatch"]


def test_moe_gpt_is_seeded_and_keeps_its_experts_names():
    a, b = moe.moe_gpt(n_experts=4, seed=3), moe.moe_gpt(n_experts=4, seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "blocks.1.mlp.experts.3.fc.weight" in sa and "blocks.0.mlp.router.weight" in sa
    assert not torch.equal(sa["blocks.0.mlp.experts.0.fc.weight"], sa["blocks.0.mlp.experts.1.fc.weight"])


@pytest.mark.parametrize("flags, world, words", [
    ({"n_experts": 6}, 4, "cannot be split evenly over 4 ranks"),
    ({"top_k": 3}, 2, "1 or 2 experts"),
    ({"batch_size": 6}, 4, "divisible by the 4 ranks"),
    ({"capacity_factor": 0.0}, 2, "must be positive"),
    ({"n_experts": 3, "batch_size": 3}, 3, "must be even"),  # the lab also runs on ranks 0 and 1 alone
])
def test_bad_options_are_refused(flags, world, words):
    with pytest.raises(FlagError, match=words):
        moe_lab.check_options({**moe_lab.DEFAULTS, **flags}, world)


def test_without_torchrun_the_lab_says_how_to_launch_it():
    from harness import python_module

    proc = python_module(LAB, ["--train_steps=0"], timeout=60, check=False)
    assert proc.returncode == 2 and "error:" in proc.stderr and "torchrun --standalone" in proc.stderr
