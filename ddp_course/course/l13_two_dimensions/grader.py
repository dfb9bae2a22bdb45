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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddp_course.check import Verdict, judged, run_exercise

EXERCISE = "13_two_d_plan.py"  # the script this grades: lessons/exercises/13_two_d_plan.py
NPROC = 4
ROOT_PARAMS = ("tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias")
LINEAR = (".attn.qkv.weight", ".attn.qkv.bias", ".attn.proj.weight", ".mlp.fc.weight", ".mlp.fc.bias", ".mlp.proj.weight")


# --- where each layout goes: the plan's, against the probe's records (two_d_harness.probe_layouts) ----

SLICE, WHOLE = "a slice of the sequence", "the whole sequence"
# per probed module: what its input and its output hold under the plan (on a rank of a tp group)
PLAN = {"blocks.0": (SLICE, SLICE), "blocks.0.ln1": (SLICE, SLICE), "blocks.0.attn": (WHOLE, SLICE),
        "blocks.0.attn.qkv": (WHOLE, WHOLE), "blocks.0.attn.proj": (WHOLE, SLICE), "blocks.0.ln2": (SLICE, SLICE),
        "blocks.0.mlp": (WHOLE, SLICE), "blocks.0.mlp.fc": (WHOLE, WHOLE), "blocks.0.mlp.proj": (WHOLE, SLICE),
        "ln_f": (SLICE, SLICE), "head": (WHOLE, WHOLE)}
SHORT = {"blocks.0.attn": "attn", "blocks.0.mlp": "mlp", "blocks.0.attn.qkv": "attn.qkv", "blocks.0.mlp.fc": "mlp.fc",
         "blocks.0.attn.proj": "attn.proj", "blocks.0.mlp.proj": "mlp.proj", "blocks.0.ln1": "ln1",
         "blocks.0.ln2": "ln2"}


def _holds(layout: dict[str, Any]) -> str:
    if layout["local_seq"] == layout["seq"]:
        return WHOLE
    return SLICE if layout["local_seq"] * 2 == layout["seq"] else f"{layout['local_seq']} of {layout['seq']} tokens"


STYLE = {"attn.qkv": "column-wise", "mlp.fc": "column-wise", "attn.proj": "row-wise", "mlp.proj": "row-wise"}


def _split(weight: list[str]) -> str | None:
    """How a linear layer's weight is split over tp, from its placements ((dp, tp) with FSDP on top)."""
    tp = weight[-1] if weight else ""
    return {"S(0)": "column-wise", "S(1)": "row-wise"}.get(tp)


def layout_problem(records: list[dict[str, Any]]) -> str | None:
    """The first module whose weight, input or output is not laid out as the plan's, said as the
    mistake it shows; None when every probed module matches. Weights first, then inputs in the order
    the modules ran, then outputs from the innermost module out (a wrong output shows in every module
    around it too)."""
    for r in records:
        name = SHORT.get(r["module"], r["module"])
        if name in STYLE and r.get("weight") and _split(r["weight"]) != STYLE[name]:
            got = _split(r["weight"]) or "not at all"
            return (f"{name} is split {got} over tp; the plan splits it {STYLE[name]}: qkv and mlp.fc column-wise "
                    "(ColwiseParallel: each rank its heads or hidden units), attn.proj and mlp.proj row-wise "
                    "(RowwiseParallel: each rank sums its part of the output).")
    problem = _input_problem(records)
    if problem:
        return problem
    return _output_problem(sorted(records, key=lambda r: -r["module"].count(".")))


def _planned(records: list[dict[str, Any]], side: str) -> Iterator[tuple[str, str, dict, str, str]]:
    """Each record whose ``side`` ("input" or "output") was seen and has a place in the plan: (module, its
    short name, the layout seen, what it holds, what the plan wants)."""
    for r in records:
        module = r["module"]
        want = PLAN.get(module, (None, None))[0 if side == "input" else 1]
        seen = r.get(side)
        if seen is not None and want is not None:
            yield module, SHORT.get(module, module), seen, _holds(seen), want


def _input_problem(records: list[dict[str, Any]]) -> str | None:
    for module, name, lin, got, want_in in _planned(records, "input"):
        if module.endswith(("ln1", "ln2")) or module == "ln_f":
            if not lin["dtensor"]:
                return (f"{name} normalises a slice of the sequence as a plain module: without SequenceParallel its "
                        "weight and bias are not replicated over tp, so their gradients come from this rank's "
                        "tokens only. Give every LayerNorm SequenceParallel().")
        if got != want_in:
            if module.endswith((".attn", ".mlp")):
                why = ("attention mixes the tokens, and each rank's heads need every one" if name == "attn" else
                       "each rank computes its hidden units for every token, and its proj then sums them and cuts "
                       "the sequence")
                return (f"{name} receives {got}, but it needs {want_in}: {why}. Gather the sequence before it: "
                        f"PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) on {name}.")
            if module.endswith((".qkv", ".fc")):
                taken = " and treats it as the whole (a local slice declared Replicate)" if lin["placements"] == ["R"] else ""
                return (f"{name} receives {got}{taken}: a column-wise layer needs the whole sequence. Gather it "
                        f"before the {'attention' if 'attn' in name else 'MLP'} (PrepareModuleInput(Shard(1) -> "
                        "Replicate)), and keep SequenceParallel's output a DTensor (its default).")
            if module == "blocks.0":
                return ("the first block receives the whole sequence, but the residual stream between blocks is "
                        "sequence-parallel: cut it at the first block's input, PrepareModuleInput(input_layouts="
                        "(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True) on blocks.0.")
            if module == "head":
                return ("the head receives a slice of the sequence: the logits need every token. Gather it: "
                        "PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) on head.")
            return f"{name} receives {got} where the plan has {want_in}."
    return None


def _output_problem(records: list[dict[str, Any]]) -> str | None:
    for module, name, _, got, want_out in _planned(records, "output"):
        if got != want_out:
            if module.endswith(".proj") and got == WHOLE:
                return (f"{name} hands on the whole sequence where the residual stream holds a slice: a row-wise "
                        "layer's output is a partial sum on each rank, and it must be summed over tp *and* cut back "
                        "onto the sequence. RowwiseParallel(output_layouts=Shard(1)) does both (a reduce-scatter); "
                        "RowwiseParallel() all-reduces it to the whole sequence, and output_layouts=Partial() leaves "
                        "the sum undone.")
            if module.endswith((".attn", ".mlp")) and got not in (WHOLE, SLICE):
                return (f"{name}'s output holds {got}: it was reduced and cut onto the sequence twice. "
                        "RowwiseParallel(output_layouts=Shard(1)) on its proj already does it; drop the second one.")
            return f"{name}'s output holds {got} where the plan has {want_out}."
    return None


def _probe(output: str) -> list[dict[str, Any]] | None:
    import json

    for line in output.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    return None


def hint(output: str) -> str:
    """What a failed job's output says about the plan: the first layout against the plan's, or what
    the exception shows of the order of the calls."""
    if "overlapping meshes" in output:
        return ("\nThe classic mistake: FSDP given the whole 2-D mesh. fully_shard then spans both dimensions, the "
                "tensor-parallel one included, which the parameters already use. Give it the data-parallel "
                "dimension only: fully_shard(module, mesh=mesh['dp']).")
    if "only accepts torch.Tensor but got" in output and "parallelize_module" in output:
        return ("\nThe classic mistake: tensor parallelism applied after fully_shard. FSDP has already made the "
                "parameters DTensors sharded over dp, and parallelize_module can only split plain tensors. Split "
                "over tp first, then shard over dp.")
    records = _probe(output)
    problem = layout_problem(records) if records else None
    return f"\nWhere it went wrong: {problem}" if problem else ""


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
    ok = all(r["ok"] for r in found)
    plan_comm = fwd == expected["forward"] and bwd == expected["backward"]
    if not (ok and plan_comm):
        problem = layout_problem(r0.get("probe") or [])
        if problem:
            agree = ("The numbers agree with one process -- DTensor found another way to compute it -- but not the "
                     "plan: " if ok else "")
            return Verdict(False, f"{agree}{problem} {_parity(found)} Per step: {_fmt(fwd)} in forward, {_fmt(bwd)} in "
                                  f"backward (the plan: {_fmt(expected['forward'])}; {_fmt(expected['backward'])}).")
    tp_fwd = {k: v for k, v in fwd.items() if k.startswith("tp:")}
    want_tp = {k: v for k, v in expected["forward"].items() if k.startswith("tp:")}
    if ok and plan_comm:
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
    from ddp_course.check.reference import harness_constants
    from ddp_course.course.l13_two_dimensions.layouts import expected_collectives

    c = harness_constants(path)
    return expected_collectives(c["SHAPE"]["n_layer"], sequence_parallel=True, dp=NPROC // c["TP"])


def grade(path: str | Path, timeout: float = 240) -> Verdict:
    """Run the script on 4 ranks; judge its numbers, its placements and its collectives."""
    found = run_exercise(path, NPROC, "make_mesh() and parallelize()", timeout, hint=hint)
    return judged(found, lambda rows: diagnose(rows, expected(path)))
