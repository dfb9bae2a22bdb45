"""DDP on two CPU processes (gloo), started with torch.multiprocessing.spawn.

(a) A 2-rank DDP step is the single-process step on the concatenated batch.
(b) Gradient accumulation with ``no_sync`` gives the one-big-batch gradient while all-reducing once
    per optimizer step; entering ``no_sync`` only around backward silently all-reduces every time.

Workers are module-level functions (spawn pickles them by name) and write their results to files
in ``tmp_path``. Every spawn has a deadline, and the process group a short timeout, so a stuck
collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import free_port, spawn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course import parallel
from ddp_course.config import TrainConfig
from ddp_course.dist import DistInfo, clean_exit
from ddp_course.model import GPTConfig, MiniGPT
from ddp_course.train import build_optimizer, train_step

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
SEED = 1234
GPT = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)
PG_TIMEOUT_S = 30  # a collective that waits longer than this is a bug, not a slow machine
CPU = torch.device("cpu")


# --- helpers shared by the test process and the workers ----------------------------------------------

def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    with clean_exit():  # spawned workers end like torchrun's (ddp_course/dist.py)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))


def _model() -> MiniGPT:
    torch.manual_seed(SEED)  # identical initial weights in every process
    return MiniGPT(GPT)


def _global_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch (rows x block_size), the same in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(GPT.vocab_size, (rows, GPT.block_size + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _rank_rows(x: torch.Tensor, rank: int) -> slice:
    n = x.shape[0] // WORLD
    return slice(rank * n, (rank + 1) * n)


def _train_cfg() -> TrainConfig:
    # a large lr so that several steps move the weights far enough for any mismatch to show
    return TrainConfig(strategy="ddp", lr=1e-2, weight_decay=0.1, grad_clip=1.0)


def _each_rank(worker, tmp_path: Path) -> list:
    """Run ``worker(rank, port, out)`` on WORLD spawned ranks; what each saved in ``out/rank<r>.pt``."""
    spawn(worker, (free_port(), str(tmp_path)), WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


# --- (a) a DDP step equals the single-process step on the concatenated batch --------------------------

STEPS = 6
MICRO = 4  # sequences per micro-batch per rank
ACCUM = 2  # micro-batches per optimizer step (exercises train_step's no_sync path as well)


def _ddp_steps_worker(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    try:
        cfg = _train_cfg()
        model = _model()
        info = DistInfo(rank=rank, world_size=WORLD, local_world_size=WORLD, backend="gloo")
        ddp = parallel.wrap(model, info, cfg)
        assert isinstance(ddp, DDP)
        opt = build_optimizer(ddp, cfg, CPU)
        losses, norms = [], []
        for step in range(STEPS):
            x, y = _global_batch(step, WORLD * ACCUM * MICRO)
            x, y = x[_rank_rows(x, rank)], y[_rank_rows(y, rank)]
            micro = [(x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]) for k in range(ACCUM)]
            loss, norm = train_step(ddp, opt, None, micro, device=CPU, precision="fp32",
                                    grad_clip=cfg.grad_clip, no_sync=True)
            losses.append(loss.item())
            norms.append(norm.item())
        torch.save({"losses": losses, "norms": norms,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_ddp_steps_equal_single_process_steps_on_the_concatenated_batch(tmp_path):
    ranks = _each_rank(_ddp_steps_worker, tmp_path)

    cfg = _train_cfg().replace(strategy="single")
    model = _model()
    opt = build_optimizer(model, cfg, CPU)
    ref_losses, ref_norms = [], []
    for step in range(STEPS):
        x, y = _global_batch(step, WORLD * ACCUM * MICRO)  # the whole batch at once, K = 1
        loss, norm = train_step(model, opt, None, [(x, y)], device=CPU, precision="fp32",
                                grad_clip=cfg.grad_clip, no_sync=True)
        ref_losses.append(loss.item())
        ref_norms.append(norm.item())

    # Each DDP replica receives the same all-reduced buckets, so the replicas stay bit-identical.
    for n, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][n]), f"replicas diverged at {n}"
    # Against one process the arithmetic is the same up to fp32 summation order (mean of two
    # half-batch means vs one mean; two micro-batches vs one), ~1e-7 relative per step, so losses and
    # gradient norms agree to 1e-5 relative. One real error -- a rank on the wrong data, a missing
    # average (the gradient norm doubles), a skipped sync -- is visible at the first step.
    ddp_losses = [sum(v) / WORLD for v in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert ddp_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert ranks[0]["norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert ranks[1]["norms"] == ranks[0]["norms"]
    # Weights: atol 1e-4. AdamW divides each gradient by sqrt(v) + eps, which turns rounding noise
    # on coordinates whose true gradient is ~0 into updates of up to lr * noise / (noise + eps).
    # The key bias is such a coordinate: adding a constant to every key shifts all of a query's
    # scores equally, which softmax ignores, so its exact gradient is zero. Observed: <= 2e-5 there,
    # <= 1e-6 elsewhere. 1e-4 is still 100x below one step's update (lr = 1e-2).
    moved = 0.0
    init = dict(_model().named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(ranks[0]["params"][n], p.detach(), rtol=1e-5, atol=1e-4,
                                   msg=lambda m, n=n: f"{n}: {m}")
        moved = max(moved, (p.detach() - init[n].detach()).abs().max().item())
    assert moved > 1e-3  # the comparison is not between two untrained models


# --- (b) no_sync accumulation: same gradient, one all-reduce per step ----------------------------------

K = 4  # micro-batches per optimizer step
BUCKET_MB = 0.02  # ~20 kB buckets: the ~110 kB of gradients form several buckets


def _counting_hook(state: dict, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def _accumulate(ddp, micro, mode: str) -> None:
    """One optimizer step's forward/backward passes (no optimizer step).

    mode "no_sync": the course's loop -- every non-final micro-step, forward *and* backward, inside
    ``sync_context``; "sync": all-reduce on every micro-step; "buggy": only backward inside
    ``no_sync()``, the forward outside it.
    """
    for k, (x, y) in enumerate(micro):
        last = k == len(micro) - 1
        if mode == "buggy" and not last:
            _, loss = ddp(x, y)
            with ddp.no_sync():
                (loss / len(micro)).backward()
        else:
            with parallel.sync_context(ddp, sync=last or mode == "sync"):
                _, loss = ddp(x, y)
                (loss / len(micro)).backward()


def _accum_worker(rank: int, port: int, out: str) -> None:
    _init(rank, port)
    try:
        model = _model()
        ddp = parallel.record(DDP(model, bucket_cap_mb=BUCKET_MB), "ddp")  # built by hand: a DDP to the course
        state = {"calls": 0}
        ddp.register_comm_hook(state, _counting_hook)

        def one_step(micro, mode):
            state["calls"] = 0
            _accumulate(ddp, micro, mode)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            ddp.zero_grad(set_to_none=True)
            return state["calls"], grads

        x, y = _global_batch(99, WORLD * MICRO)
        warm = (x[_rank_rows(x, rank)], y[_rank_rows(y, rank)])
        # DDP re-buckets after its first backward (in gradient-arrival order): measure after that
        one_step([warm], "sync")
        buckets_per_backward, _ = one_step([warm], "sync")
        n_buckets = (len(ddp.reducer._get_zeros_like_grad_buckets())
                     if hasattr(ddp.reducer, "_get_zeros_like_grad_buckets") else None)

        x, y = _global_batch(0, WORLD * K * MICRO)
        x, y = x[_rank_rows(x, rank)], y[_rank_rows(y, rank)]
        micro = [(x[k * MICRO:(k + 1) * MICRO], y[k * MICRO:(k + 1) * MICRO]) for k in range(K)]
        results = {mode: one_step(micro, mode) for mode in ("no_sync", "sync", "buggy")}
        torch.save({"buckets_per_backward": buckets_per_backward, "n_buckets": n_buckets,
                    "calls": {m: c for m, (c, _) in results.items()},
                    "grads": {m: g for m, (_, g) in results.items()}}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_no_sync_accumulation_gradients_and_all_reduce_counts(tmp_path):
    ranks = _each_rank(_accum_worker, tmp_path)

    model = _model()
    x, y = _global_batch(0, WORLD * K * MICRO)  # all K x WORLD micro-batches as one batch
    _, loss = model(x, y)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}

    # Gradients: the mean of K micro-batch means on each rank, averaged over ranks, is the mean over
    # the whole batch; only fp32 summation order differs (~1e-7 relative for a sum of like-signed
    # terms, more for elements that are small sums of cancelling terms: hence rtol 1e-4, and atol
    # 1e-7 for elements that are ~0, such as the key bias). An unscaled loss (K times too large) or
    # a rank-local gradient misses by 100% or so, not 0.01%.
    for r in ranks:
        for mode in ("no_sync", "sync", "buggy"):
            for n, g in reference.items():
                torch.testing.assert_close(r["grads"][mode][n], g, rtol=1e-4, atol=1e-7,
                                           msg=lambda m, n=n, mode=mode: f"{mode} {n}: {m}")

    # Counts: the hook runs once per bucket per all-reducing backward.
    for r in ranks:
        b = r["buckets_per_backward"]
        assert b > 1, "the small bucket_cap_mb should give several buckets"
        if r["n_buckets"] is not None:
            assert b == r["n_buckets"]
        assert r["calls"]["no_sync"] == b  # one all-reduce of every bucket per optimizer step
        assert r["calls"]["sync"] == K * b  # every micro-step all-reduces
        # The classic silent bug: DDP decides in *forward* whether the backward will all-reduce, so
        # no_sync around backward only changes nothing -- same gradients (above), K times the traffic.
        assert r["calls"]["buggy"] > b
        assert r["calls"]["buggy"] == K * b


def test_a_suite_can_give_each_process_its_share_of_the_cores():
    """``DDP_COURSE_THREADS`` sets the threads of a process that does not choose (what ``make test``'s
    two workers do); without it a lone process takes every core, and a program's own choice wins."""
    from harness import run_command

    from ddp_course.dist import THREADS_VAR, cpu_count

    code = ("import sys, torch\nfrom ddp_course.dist import setup\n"
            "with setup(device='cpu', threads=int(sys.argv[1])):\n    print(torch.get_num_threads())")
    given = run_command([sys.executable, "-c", code, "0"], 60, env={THREADS_VAR: "1"}).stdout.split()
    free = run_command([sys.executable, "-c", code, "0"], 60, env={THREADS_VAR: ""}).stdout.split()
    own = run_command([sys.executable, "-c", code, "2"], 60, env={THREADS_VAR: "1"}).stdout.split()
    assert (given[-1], free[-1], own[-1]) == ("1", str(cpu_count()), "2")
