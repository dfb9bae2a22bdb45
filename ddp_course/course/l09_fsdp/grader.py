"""Grader of exercise 09 (``lessons/exercises/09_fsdp.py``): MiniGPT sharded with ``fully_shard``.

Runs the script with torchrun on 2 processes. Every rank reports how the model was sharded (which
modules are FSDP units, which parameters stayed plain tensors), the parameter bytes it holds, what
the first forward did (its all-gathers, and the most parameter bytes it held whole at once), and,
after a few AdamW steps side by side with a DDP copy, the largest parameter difference from DDP and
the norm of every (gathered) parameter. The grader checks

- the units: every transformer block and the root are FSDP modules (``fully_shard`` per block, then
  the root), and no parameter is left a plain tensor;
- what the units do: the first forward gathers one block at a time, as one unit per block does (one
  all-gather per block plus the root's; at most the root's and one block's parameters whole at once,
  ``forward_budget``) -- blocks given to ``fully_shard`` together in one list are FSDP modules too,
  but one unit, gathered all at once;
- the memory: each rank holds the total parameter bytes / 2, within 5 % (uneven rows and padding);
- the training: equal to DDP within the script's tolerance, and every parameter's norm equal to
  that of a reference the grader trains itself, in this process, on the global batch;

and names the mistake behind what it measured.
"""

from __future__ import annotations

from pathlib import Path

from ddp_course.check import Verdict, judged, run_exercise
from ddp_course.check.reference import harness_constants

EXERCISE = "09_fsdp.py"  # the script this grades: lessons/exercises/09_fsdp.py
# The course's own version of the answer: the strategy's wrap (printed after the grading cell).
DELEGATES = ("ddp_course.parallel.fsdp.wrap",)
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): the order of the
# calls (the blocks first, the root last) and why (a unit takes what no unit below it has taken).
GIVEAWAYS = ("then the root", "then the model itself", "then the whole model", "fully_shard is applied bottom-up",
             "the root takes what is left", "which takes what is left", "sharded last", "after the blocks",
             "before the root")

NPROC = 2
BALANCE_TOL = 0.05  # vocabulary rows (65) do not split evenly: a few hundred bytes of ~70 kB
NORM_RTOL = 1e-5  # one process on the global batch vs 2 ranks averaging: last-bit differences, ~1e-7
ROOT_PARAMS = ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias")


def reference_training(constants: dict, world_size: int = NPROC) -> tuple[list[float], dict[str, float]]:
    """Train the exercise's model with AdamW in this process on every rank's batch at once (SHAPE,
    MICRO_BATCH_SIZE, STEPS, LR, SEED of ``constants``): each step's loss, and the parameters' norms after."""
    import torch

    from ddp_course.course.tiny import micro_batch, tiny_model

    shape, mbs, steps, lr, seed = (constants[k] for k in ("SHAPE", "MICRO_BATCH_SIZE", "STEPS", "LR", "SEED"))
    model = tiny_model(seed, **shape)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):  # DDP's average over ranks = the mean loss over the concatenated batches
        parts = [micro_batch(step, r, micro_batch_size=mbs, block_size=shape["block_size"], seed=seed)
                 for r in range(world_size)]
        _, loss = model(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().norm().item() for n, p in model.named_parameters()}


def reference_norms(constants: dict, world_size: int = NPROC) -> dict[str, float]:
    """The parameters' norms after ``reference_training``."""
    return reference_training(constants, world_size)[1]


def forward_budget(constants: dict) -> dict[str, int]:
    """What one FSDP unit per block, then the root, does in a forward of the exercise's model: one
    all-gather per unit, and at most the root's parameters and one block's whole at once (bytes)."""
    from ddp_course.course.tiny import tiny_model

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    model = tiny_model(constants["SEED"], **constants["SHAPE"])
    blocks = [size(b) for b in model.blocks]
    root = size(model) - sum(blocks)  # the embeddings (tied with the head) and the final LayerNorm
    return {"all_gathers": len(blocks) + 1, "peak_gathered_bytes": root + max(blocks), "root_bytes": root,
            "block_bytes": max(blocks), "n_blocks": len(blocks)}


def _forward_problem(ranks: dict[int, dict], budget: dict[str, int]) -> str | None:
    """What the first forward's all-gathers and peak say against ``budget`` (``forward_budget``), or None.
    More all-gathers than one per unit with no more held at once (units smaller than a block) is fine."""
    if any("forward" not in r for r in ranks.values()):
        return None
    rank, r = max(ranks.items(), key=lambda kv: kv[1]["forward"]["peak_gathered_bytes"])
    got, peak = r["forward"]["all_gathers"], r["forward"]["peak_gathered_bytes"]
    want, limit = budget["all_gathers"], budget["peak_gathered_bytes"]
    if peak <= limit:
        return None
    at_once = max(1, round((peak - budget["root_bytes"]) / budget["block_bytes"]))
    which = (f"all {budget['n_blocks']} blocks are" if at_once >= budget["n_blocks"] else f"{at_once} blocks are")
    measured = (f"one forward issued {got} all-gathers instead of {want} (one per block, plus the root's), and rank "
                f"{rank} held up to {peak:,} parameter bytes whole at once instead of {limit:,} (the root's and one "
                "block's)")
    if got < want:
        return (f"every block and the root are FSDP modules, but {which} gathered at once: {measured}. Blocks given "
                "to fully_shard together (fully_shard(list(model.blocks), ...) or any list of several blocks) "
                "become one unit with one all-gather, so each rank's peak holds all of them -- the memory FSDP "
                "exists to save. Call fully_shard(block, mesh=mesh) on each block by itself, in a loop, then "
                "fully_shard(model, mesh=mesh).")
    return (f"every block is an FSDP unit of its own, but {which} held whole at once: {measured}. The blocks stay "
            "gathered after their forward (was reshard_after_forward=False passed to fully_shard?), so by the last "
            "block every block is whole. Shard each block with fully_shard's defaults, which free a block's "
            "gathered parameters as soon as its forward ends.")


def diagnose(found: list[dict], reference: dict[str, float], lr: float, budget: dict[str, int] | None = None) -> Verdict:
    """The verdict on the script's RESULT rows: ``reference`` from ``reference_norms``, ``budget`` from
    ``forward_budget`` (None: the first forward is not judged)."""
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    r0 = ranks[0]
    plain = r0["plain_params"]
    if plain and len(plain) == len(r0["param_norms"]):
        return Verdict(False, "no parameter was sharded: every one is still a plain tensor, so each rank holds the whole "
                              "model and nothing synchronises the gradients. Call fully_shard(block, mesh=mesh) on each "
                              "block of model.blocks, then fully_shard(model, mesh=mesh), and return the model.")
    if plain:
        root = [n for n in plain if n in ROOT_PARAMS]
        why = (" These belong to the root module: call fully_shard(model, mesh=mesh) after the blocks, so that the "
               "embeddings (tied with the output head) and the final LayerNorm are sharded too." if root else "")
        return Verdict(False, f"{len(plain)} parameter(s) stayed plain tensors ({', '.join(plain[:5])}): every rank holds "
                              "them in full and, worse, nothing averages their gradients, so the ranks drift apart."
                              + why)
    units = r0["units"]
    if not all(units["blocks"]):
        missing = [i for i, u in enumerate(units["blocks"]) if not u]
        return Verdict(False, f"every parameter is sharded, but block(s) {missing} are not FSDP units of their own: "
                              "sharding only the root makes the whole model one unit, all-gathered in full before the "
                              "first layer's forward, so each rank's peak holds every parameter at once -- the memory "
                              "FSDP exists to save. Call fully_shard(block, mesh=mesh) on each block before the root.")
    if not units["root"]:
        return Verdict(False, "the model returned is not an FSDP module: return the model after fully_shard(model, ...).")
    problem = _forward_problem(ranks, budget) if budget is not None else None
    if problem:
        return Verdict(False, problem)
    for rank, r in sorted(ranks.items()):
        share = r["total_bytes"] / NPROC
        if abs(r["local_bytes"] - share) > BALANCE_TOL * share:
            return Verdict(False, f"rank {rank} holds {r['local_bytes']:,} parameter bytes, but 1/{NPROC} of the model is "
                                  f"{share:,.0f}: shard over all ranks (init_device_mesh('cpu', (world_size,))).")
    worst = max(r["max_abs_diff_vs_ddp"] for r in found)
    if worst > lr / 100:  # rounding (another summation order) stays ~1e-6; a real bug moves parameters by ~lr
        return Verdict(False, f"after training, the sharded model differs from DDP by up to {worst:.2e}, more than "
                              f"rounding explains (lr / 100 = {lr / 100:.0e}). Did shard() change the model's weights or options (for example a "
                              "mixed-precision policy)? Shard it as it is.")
    bad = [n for n, v in reference.items()
           if abs(r0["param_norms"].get(n, float("nan")) - v) > NORM_RTOL * abs(v) or n not in r0["param_norms"]]
    if bad:
        return Verdict(False, f"the parameters {bad[:4]} after training differ from the grader's own reference (one process "
                              "on the global batch). Shard the model as it is, without changing it.")
    forward = r0.get("forward")
    gathers = (f"one forward issued {forward['all_gathers']} all-gathers and held at most "
               f"{forward['peak_gathered_bytes']:,} parameter bytes whole at once (one block at a time); "
               if forward and budget is not None else "")
    return Verdict(True, f"every block and the root are FSDP units; {gathers}each rank holds {r0['local_bytes']:,} of "
                         f"{r0['total_bytes']:,} parameter bytes; after training, the parameters equal DDP's (max "
                         f"difference {worst:.1e}) and the grader's one-process reference.")


def collect(path: str | Path, timeout: float = 180) -> list[dict] | Verdict:
    """Run the script on 2 ranks: its RESULT lines, or a failing verdict saying why there are none."""
    return run_exercise(path, NPROC, "shard()", timeout)


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """Run the script on 2 ranks, then compare with the grader's own one-process reference."""
    found = collect(path, timeout)
    constants = harness_constants(path)
    return judged(found, lambda rows: diagnose(rows, reference_norms(constants), constants["LR"],
                                               forward_budget(constants)))
