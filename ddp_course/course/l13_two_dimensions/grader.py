"""Grader of exercise 13 (``lessons/exercises/13_two_d_plan.py``): the 2-D plan of MiniGPT on 4 ranks.

Runs the script with torchrun on 4 processes. Every rank trains its split model beside a one-process
MiniGPT on the same global batches and reports (``two_d_harness.train_side_by_side``): the losses,
the first step's gradients and the final weights against one process, where each parameter lives
(mesh dimensions, placements, elements), the bytes it holds, and the collectives of the first step by
mesh dimension. The grader judges what the plan *does*, whatever its spelling:

- the mesh: 2 x 2, dimensions ``dp`` and ``tp``;
- the numbers: the loss, the first gradients and the weights equal to one process's
  (``two_d_harness``'s tolerances);
- the memory: every parameter spread over ``dp`` (FSDP) and the block's linear layers over ``tp``,
  so that a rank holds about 1 / 4 of every linear layer and 1 / 2 of everything else;
- the communication: the collectives per mesh dimension equal to the plan's
  (``layouts.expected_collectives``: sequence parallelism's all-gathers and reduce-scatters over
  ``tp``, FSDP's over ``dp``);

and names the classic mistake nearest to what it measured: FSDP over the whole mesh, tensor
parallelism applied after ``fully_shard``, a row-wise layer whose output is not reduced (or reduced
twice), a sequence-parallel norm whose output the next layer does not gather, the root left unsharded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_course.check import GradedRun, Verdict, run_exercise

EXERCISE = "13_two_d_plan.py"  # the script this grades: lessons/exercises/13_two_d_plan.py
NPROC = 4
ROOT_PARAMS = ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias")
LINEAR = (".attn.qkv.weight", ".attn.qkv.bias", ".attn.proj.weight", ".mlp.fc.weight", ".mlp.fc.bias", ".mlp.proj.weight")


def _counts(r: dict[str, Any], phase: str) -> dict[str, int]:
    return {k: v for k, v in r["collectives"][phase].items() if v}


def _mesh_problem(r: dict[str, Any]) -> str | None:
    if r["dp"] * r["tp"] != NPROC or r["tp"] != 2:
        return (f"the mesh is {r['dp']} x {r['tp']} (dp x tp); the plan needs 2 x 2: "
                "init_device_mesh('cpu', (world_size // TP, TP), mesh_dim_names=('dp', 'tp')).")
    return None


def _placement_problem(r: dict[str, Any]) -> str | None:
    """Where the parameters live, against the plan: every one over dp, the block linears over tp too."""
    params = r["params"]
    not_dp = [n for n, p in params.items() if "dp" not in p["dims"]]
    if not_dp:
        root = [n for n in not_dp if n in ROOT_PARAMS]
        if root and len(root) == len(not_dp):
            return ("the root is not sharded: " + ", ".join(root) + " are whole on every rank and nothing averages "
                    "their gradients over the data-parallel ranks, so the two dp groups train two different "
                    "embeddings. Call fully_shard(model, mesh=mesh['dp']) after the blocks.")
        return (f"{len(not_dp)} parameter(s) are not sharded over dp ({', '.join(not_dp[:4])}): FSDP must wrap every "
                "block over mesh['dp'], then the root.")
    whole_mesh = [n for n, p in params.items() if n.endswith(LINEAR) and p["dims"] == ["dp", "tp"]
                  and "Replicate()" in p["placements"][:1]]
    if whole_mesh:
        return ("FSDP was given the whole 2-D mesh: with a 2-D mesh fully_shard replicates over its first dimension "
                "and shards over its second, so the parameters are sharded over tp, the ranks that split the model, "
                "and replicated over dp. Give fully_shard the data-parallel dimension only: mesh=mesh['dp'].")
    not_tp = [n for n, p in params.items() if n.endswith(LINEAR) and "tp" not in p["dims"]]
    if not_tp:
        return (f"the block's linear layers are not split over tp ({', '.join(not_tp[:4])}): qkv and mlp.fc "
                "column-wise (ColwiseParallel), attn.proj and mlp.proj row-wise (RowwiseParallel), over mesh['tp'].")
    return None


def diagnose(found: list[dict[str, Any]], expected: dict[str, dict[str, int]]) -> Verdict:
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    r0 = ranks[0]
    for problem in (_mesh_problem(r0), _placement_problem(r0)):
        if problem:
            return Verdict(False, problem)
    fwd, bwd = _counts(r0, "forward"), _counts(r0, "backward")
    tp_fwd = {k: v for k, v in fwd.items() if k.startswith("tp:")}
    want_tp = {k: v for k, v in expected["forward"].items() if k.startswith("tp:")}
    ok = all(r["ok"] for r in found)
    if ok and fwd == expected["forward"] and bwd == expected["backward"]:
        share = r0["states"]["params"] / r0["full_bytes"]
        return Verdict(True, f"the 2 x 2 plan trains like one process (loss {max(r['loss_rel_diff'] for r in found):.1e}, "
                             f"first gradients {max(r['grad_rel_err'] for r in found):.1e}, weights "
                             f"{max(r['update_rel_diff'] for r in found):.1e} relative); each rank holds {share:.1%} of the "
                             f"parameter bytes; per step {_fmt(fwd)} in forward and {_fmt(bwd)} in backward, as the plan "
                             "derives them.")
    gathers, want_gathers = tp_fwd.get("tp:all_gather", 0), want_tp.get("tp:all_gather", 0)
    scatters, want_scatters = tp_fwd.get("tp:reduce_scatter", 0), want_tp.get("tp:reduce_scatter", 0)
    reduces = tp_fwd.get("tp:all_reduce", 0)
    if scatters + reduces < want_scatters:
        return Verdict(False, f"the forward reduced {scatters + reduces} layer output(s) over tp where the plan reduces "
                              f"{want_scatters} (attn.proj and mlp.proj of every block): a row-wise layer's output is a "
                              "partial sum on each rank and must be reduced -- RowwiseParallel(output_layouts=Shard(1)) "
                              "reduce-scatters it onto the sequence. "
                              + _parity(found))
    if reduces > 0 and scatters >= want_scatters:
        return Verdict(False, f"the forward reduced over tp {scatters + reduces} times where the plan reduces "
                              f"{want_scatters}: a row-wise layer's output is summed twice (RowwiseParallel already "
                              "reduces it; an all-reduce of your own on top doubles it). " + _parity(found))
    if gathers < want_gathers:
        return Verdict(False, f"the forward all-gathered the sequence over tp {gathers} time(s) where the plan does "
                              f"{want_gathers}: a sequence-parallel LayerNorm hands on a slice of the sequence "
                              "(Shard(1)), and the attention and the MLP that follow need all of it -- give attn and mlp "
                              "PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)), and "
                              "the head the same. " + _parity(found))
    if not ok:
        return Verdict(False, "the split model does not train like one process: " + _parity(found))
    return Verdict(False, f"the numbers agree with one process, but the collectives differ from the plan's: forward "
                          f"{_fmt(fwd)} (the plan: {_fmt(expected['forward'])}), backward {_fmt(bwd)} (the plan: "
                          f"{_fmt(expected['backward'])}). Follow the plan of section 2: sequence parallelism on the "
                          "norms, the residual stream sharded on the sequence between blocks.")


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k.replace(':', ' ')}" for k, v in sorted(counts.items())) or "none"


def _parity(found: list[dict[str, Any]]) -> str:
    r = max(found, key=lambda r: r["grad_rel_err"])
    worst = sorted(r["grad_rel_err_per_param"].items(), key=lambda kv: -kv[1])[:3]
    return (f"Against one process: loss {max(x['loss_rel_diff'] for x in found):.1e}, first gradients "
            f"{max(x['grad_rel_err'] for x in found):.1e} (worst {', '.join(f'{n} {e:.1e}' for n, e in worst)}), "
            f"weights {max(x['update_rel_diff'] for x in found):.1e} relative.")


def expected(path: str | Path) -> dict[str, dict[str, int]]:
    """The collectives the plan issues per step for the script's model (``layouts.expected_collectives``)."""
    from ddp_course.course.l09_fsdp.grader import harness_constants
    from ddp_course.course.l13_two_dimensions.layouts import expected_collectives

    c = harness_constants(path)
    return expected_collectives(c["SHAPE"]["n_layer"], sequence_parallel=True, dp=NPROC // c["TP"])


def grade(path: str | Path, timeout: float = 240) -> Verdict:
    """Run the script on 4 ranks; judge its numbers, its placements and its collectives."""
    found = run_exercise(path, NPROC, "make_mesh() and parallelize()", timeout)
    if isinstance(found, Verdict):
        return found
    verdict = diagnose(found, expected(path))
    return GradedRun(verdict.ok, verdict.message, found)
