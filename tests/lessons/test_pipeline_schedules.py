"""Lesson 11 (pipeline schedules): GPipe and 1F1B by hand and PyTorch's schedules against one process,
the activations each holds against the formulas, and the replay that measures an order's bubble.

Two launches of ``ddp_course.course.l11_beyond_data_parallel.schedules_lab`` (2 ranks, and 4 ranks with
8 blocks) feed the job tests; under ``make test`` they read the notebook's runs of the same jobs. The
orders, the replay and the byte counter are also tested in this process, on made-up durations.
"""

from __future__ import annotations

import json

import notebook_runs
import pytest
import torch

from ddp_course.cli import FlagError
from ddp_course.course.l11_beyond_data_parallel import held
from ddp_course.course.l11_beyond_data_parallel import schedules_lab as sl
from ddp_course.launch import run

MODULE = "ddp_course.course.l11_beyond_data_parallel.schedules_lab"
# The notebook's jobs, option for option (solutions/11_beyond_data_parallel.ipynb, section 3)
SCHED = {"micro_batches": 8, "repeats": 3}
JOBS = {2: 4, 4: 8}  # ranks: blocks


@pytest.fixture(scope="module", params=sorted(JOBS))
def lab(request, tmp_path_factory):
    nproc = request.param
    flags = {"n_layer": JOBS[nproc], **SCHED}
    job = notebook_runs.reuse(f"runs/11_sched{nproc}", MODULE, nproc, **flags)
    if job is None:
        job = run(MODULE, nproc=nproc, out_dir=tmp_path_factory.mktemp(f"sched{nproc}"), timeout=180,
                  progress=False, echo="none", **flags)
    return json.loads((job.out_dir / "schedules_lab.json").read_text())


# --- the jobs --------------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_every_schedule_computes_one_process_gradients(lab):
    # every schedule ran, but those this PyTorch cannot run on gloo (the V placement before 2.13)
    assert set(lab["left_out"]) == {n for n in sl.SCHEDULES if sl.not_run_reason(n)}
    assert set(lab["schedules"]) | set(lab["left_out"]) == set(sl.SCHEDULES)
    for name, s in lab["schedules"].items():
        assert s["matches"], name
        assert s["loss_rel_diff"] <= sl.LOSS_RTOL and max(s["grad_rel_err_per_stage"].values()) <= sl.GRAD_RTOL, name
        # every stage was run, on the rank its placement says
        stages = sorted(x for r in s["stages_of_rank"] for x in r)
        assert stages == list(range(lab["world_size"] * s["v"])), name


@pytest.mark.timeout(240)
def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p(lab):
    p, m, by = lab["world_size"], lab["micro_batches"], lab["schedules"]
    assert list(by["gpipe"]["in_flight"].values()) == [m] * p
    for name in ("1f1b", "lib_1f1b"):
        assert list(by[name]["in_flight"].values()) == [p - s for s in range(p)], name
    # the bytes autograd kept say the same, to a few percent (one micro-batch's bytes differ a little
    # between the first stage, fed token ids, and the others, fed activations)
    for name in ("gpipe", "1f1b"):
        for s, held in by[name]["held_micro_batches"].items():
            assert held == pytest.approx(by[name]["in_flight"][s], rel=0.05), (name, s)
    # the V placement: rank r holds stages r and 2p - 1 - r, and the stage nearer the end holds fewer
    for name in {"zbv", "dualpipev"} & set(by):
        assert by[name]["stages_of_rank"] == [[r, 2 * p - 1 - r] for r in range(p)]


@pytest.mark.timeout(240)
def test_the_replay_of_equal_stages_is_the_formula(lab):
    for name, s in lab["schedules"].items():
        if s["formula"] is not None:
            assert s["equal_stages_idle"] == pytest.approx(s["formula"], abs=1e-9), name
        else:  # the zero-bubble schedules: below 1F1B's formula with the same m (their W's fill the bubble)
            assert s["equal_stages_idle"] < sl.bubble_formula(lab["world_size"], lab["micro_batches"]), name
        assert 0 <= s["replayed_idle"] < 1 and all(0 <= x < 1 for x in s["measured_idle"]), name
        # the timelines are complete: every micro-batch's forward on every stage
        fwd = sorted((st, i) for rank in s["timeline"] for kind, st, i, *_ in rank if kind == "F")
        assert fwd == [(st, i) for st in range(lab["world_size"] * s["v"]) for i in range(lab["micro_batches"])]


# --- in this process -------------------------------------------------------------------------------

@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (3, 5), (8, 8)])
def test_1f1b_order_warms_up_then_alternates(p, m):
    for rank in range(p):
        ops = sl.one_f_one_b_order(m, p, rank)
        assert ops.count("F") == ops.count("B") == m
        warm = min(p - 1 - rank, m)
        assert ops[:warm] == ["F"] * warm and ops[warm:warm + 2] == ["F", "B"]
        live = [ops[:k + 1].count("F") - ops[:k + 1].count("B") for k in range(len(ops))]
        assert min(live) >= 0 and max(live) == min(p - rank, m)  # a B never before its F; p - s at most


def _order(name: str, p: int, m: int, f: float = 1.0, b: float = 2.0) -> list[list[tuple[str, int, int, float]]]:
    order = sl.gpipe_order if name == "gpipe" else sl.one_f_one_b_order
    out = []
    for rank in range(p):
        count = {"F": 0, "B": 0}
        slots = []
        for kind in order(m, p, rank):
            slots.append((kind, rank, count[kind], f if kind == "F" else b))
            count[kind] += 1
        out.append(slots)
    return out


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 8), (4, 16), (3, 7)])
def test_replay_of_equal_slots_gives_the_bubble_formula(name, p, m):
    laid = sl.replay(_order(name, p, m), p)
    assert sl.statistics.mean(laid["idle"]) == pytest.approx(sl.bubble_formula(p, m), abs=1e-12)
    assert laid["makespan"] == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1) slots of F + B


def test_replay_names_an_order_that_would_wait_for_ever():
    orders = _order("1f1b", 2, 4)
    orders[1] = [orders[1][1], orders[1][0], *orders[1][2:]]  # the last stage: a backward before its forward
    with pytest.raises(RuntimeError, match="deadlocks"):
        sl.replay(orders, 2)


def test_in_flight_closes_a_split_backward_at_its_w():
    slots = [("F", 0, 0, 0, 1), ("F", 0, 1, 1, 2), ("I", 0, 0, 2, 3), ("F", 0, 2, 3, 4), ("W", 0, 0, 4, 5),
             ("B", 0, 1, 5, 6), ("B", 0, 2, 6, 7)]
    assert sl.in_flight(slots, [0]) == {0: 3}


def test_saved_bytes_counts_what_autograd_keeps_until_the_backward():
    layer = torch.nn.Linear(16, 16)
    saved = held.SavedBytes({q.untyped_storage().data_ptr() for q in layer.parameters()})
    x = torch.randn(4, 16, requires_grad=True)
    with saved.hooks():
        saved.stage = 0
        y = torch.tanh(layer(x))  # saves x (the weight is a parameter: not counted) and tanh's output
        saved.stage = -1
    assert saved.live[0] == 2 * 4 * 16 * 4
    y.sum().backward()
    assert saved.live[0] == 0 and saved.peak[0] == 2 * 4 * 16 * 4


@pytest.mark.parametrize("flags,words", [
    ({"micro_batches": 1}, "fewer than the 2 stages"),
    ({"batch_size": 10}, "divisible by --micro_batches"),
    ({"schedules": "gpipe,zigzag"}, "unknown ['zigzag']"),
    ({"n_layer": 2}, "cannot give each of 4 stages a block"),
])
def test_bad_options_are_refused_before_any_step(flags, words):
    with pytest.raises(FlagError, match=None) as err:
        sl.check_options({**sl.DEFAULTS, **flags}, 2)
    assert words in str(err.value)


def test_the_v_schedules_are_left_out_only_where_pytorch_cannot_run_them():
    for name in sl.SCHEDULES:
        v = sl.SCHEDULES[name][1] == "v"
        assert (sl.not_run_reason(name, "2.10.0+cpu") is not None) == v  # measured: the first step fails
        assert sl.not_run_reason(name, "2.13.0+cpu") is None  # measured: both V schedules run
    assert "gloo cannot" in sl.not_run_reason("zbv", "2.12.1")
