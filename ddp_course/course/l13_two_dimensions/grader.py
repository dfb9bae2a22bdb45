"""Grader of exercise 13 (``lessons/exercises/13_two_d_plan.py``): the 2-D plan of MiniGPT on 4 ranks.

Runs the script with torchrun on 4 processes. Every rank trains its split model beside a one-process
MiniGPT on the same global batches and reports (``two_d_harness.train_side_by_side``): the losses,
the first step's gradients and the final weights against one process, the ranks of its group along
each mesh dimension, where each parameter lives (mesh dimensions, placements, elements), the layout
each module of the first block receives and hands on, the bytes it holds, and the collectives of the
first step by mesh dimension. The grader judges what the plan *does*, whatever its spelling:

- the mesh: 2 x 2, dimensions ``dp`` and ``tp``, ``tp`` the inner one (its groups consecutive ranks,
  the ranks a real machine puts on one node);
- the numbers: the loss, the first gradients and the weights equal to one process's
  (``two_d_harness``'s tolerances);
- the memory: every parameter spread over ``dp`` (FSDP) and the block's linear layers over ``tp``,
  so that a rank holds about 1 / 4 of every linear layer and 1 / 2 of everything else;
- the layouts: the LayerNorms and the residual stream split on the sequence (dimension 1);
- the communication: the collectives per mesh dimension equal to the plan's
  (``layouts.expected_collectives``: sequence parallelism's all-gathers and reduce-scatters over
  ``tp``, FSDP's over ``dp``);

and names the classic mistake nearest to what it measured: the mesh's dimensions the other way
round, tensor parallelism and FSDP on each other's dimension, FSDP over the whole mesh, tensor
parallelism applied after ``fully_shard``, plan keys that name no module, a row-wise layer whose
output is not reduced (or reduced twice), a sequence-parallel norm whose output the next layer does
not gather, the stream split on the batch instead of the sequence, the root left unsharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddp_course.check import Verdict, judged, run_exercise

EXERCISE = "13_two_d_plan.py"  # the script this grades: lessons/exercises/13_two_d_plan.py
# The course's own versions of the answer (the strategy's and the lab's), which an answer may not call
DELEGATES = ("ddp_course.parallel._tp_plan.block_plan", "ddp_course.parallel._tp_plan.root_plan",
             "ddp_course.parallel._tp_plan.tensor_parallel", "ddp_course.parallel.fsdp_tp.wrap",
             "ddp_course.parallel.fsdp_tp.device_mesh", "ddp_course.course.l13_two_dimensions.two_d_lab.split")
# What would state the answer before the grading cell: the mesh's order, the plan's entries, the order
# of tensor parallelism and FSDP
GIVEAWAYS = ('mesh_dim_names=("dp", "tp")', "(world_size // TP, TP)", "tensor parallelism first",
             "tensor parallel first", "then fully_shard", 'fully_shard(block, mesh=mesh["dp"])',
             'fully_shard(model, mesh=mesh["dp"])', "each block, then the root", "each block, then the model",
             "RowwiseParallel(output_layouts=Shard(1))", "input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)",
             "desired_input_layouts=(Shard(1),)", "ln1 SequenceParallel", '"ln1": SequenceParallel()',
             "attn PrepareModuleInput", "mlp PrepareModuleInput", "attn.proj RowwiseParallel", "mlp.proj RowwiseParallel",
             "blocks.0 PrepareModuleInput", "head PrepareModuleInput", "ln_f SequenceParallel")
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
    around it too). A stream split on the batch comes before all of them."""
    problem = sequence_dim_problem(records)
    if problem:
        return problem
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


NORMS = ("blocks.0.ln1", "blocks.0.ln2", "ln_f")


def sequence_dim_problem(records: list[dict[str, Any]]) -> str | None:
    """A LayerNorm handed the residual stream split on the batch (dimension 0) instead of the sequence:
    the same numbers and the same collectives as the plan, but not sequence parallelism."""
    split = [r for r in records if r["module"] in NORMS and (r.get("input") or {}).get("dtensor")
             and (r["input"]["placements"] or [""])[-1] == "S(0)"]
    if not split:
        return None
    names = ", ".join(SHORT.get(r["module"], r["module"]) for r in split)
    return (f"the LayerNorms and the residual stream are split on dimension 0, the batch, not on dimension 1, the "
            f"sequence: {names} receive(s) placements S(0), every rank holding all {split[0]['input']['seq']} tokens of "
            "fewer sequences. The numbers and the collectives come out the same on this run, because each rank of a "
            "tp group takes a part of its group's sequences -- but that is data parallelism inside the "
            "tensor-parallel group, not sequence parallelism: at scale a tensor-parallel group often runs a "
            "micro-batch of one long sequence, which a batch split cannot divide, while the sequence always has "
            "tokens to share. Sequence parallelism is Shard(1): SequenceParallel()'s default, and Shard(1) in "
            "the layouts before and after it.")


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


def _tp_after_fsdp(output: str) -> bool:
    """PyTorch's words when a parallel style meets a parameter FSDP already sharded: SequenceParallel's
    ``DTensor.from_local`` refuses a DTensor, Colwise/RowwiseParallel's ``distribute_tensor`` refuses one
    on another mesh (torch/distributed/tensor/_api.py)."""
    import re

    if "only accepts torch.Tensor but got" in output and "parallelize_module" in output:
        return True
    found = re.search(r"Cannot distribute a DTensor with device mesh (.*?) to a different device mesh (.*)", output)
    return bool(found) and "dp" in found.group(1) and "tp" in found.group(2)


PLAN_KEY = "Parallelize plan key '"
# where a module of MiniGPT sits, for a key parallelize_module could not resolve inside it
WHERE = {"HeadParallelAttention": "attn.", "CausalSelfAttention": "attn.", "MLP": "mlp.", "Block": "", "MiniGPT": ""}


def unmatched_keys(output: str) -> list[dict[str, Any]]:
    """The plan keys ``parallelize_module`` skipped because they name no module: its warning, "Parallelize
    plan key '<key>' could not be resolved: no submodule matching token '<token>' in module <the module's
    repr>" (torch/distributed/tensor/parallel/api.py), read from the job's output; each once, with the
    class it looked in and that class's children (from the repr)."""
    import re

    found: dict[str, dict[str, Any]] = {}
    lines = [re.sub(r"^\[(?:default)?rank ?\d+\]:", "", ln) for ln in output.splitlines()]  # torchrun's prefix
    for i, line in enumerate(lines):
        m = re.search(r"Parallelize plan key '([^']*)' could not be resolved: no submodule matching token '([^']*)' "
                      r"in module (\w+)", line)
        if not m:
            continue
        children = []
        for nxt in lines[i + 1:]:
            if not nxt.startswith(" "):  # the repr's closing parenthesis, or another line
                break
            c = re.match(r"^  \((\w+)\): ", nxt)
            if c:
                children.append(c.group(1))
        key = WHERE.get(m.group(3), "") + m.group(1)
        found.setdefault(key, {"key": key, "token": m.group(2), "module": m.group(3), "children": children})
    return list(found.values())


def unmatched_problem(keys: list[dict[str, Any]]) -> str:
    said = "; ".join(f"'{k['key']}' ({k['module']} has {', '.join(k['children']) or 'no such child'}, no "
                     f"'{k['token']}')" for k in keys)
    return (f"plan key(s) that name no module of MiniGPT: {said}. parallelize_module warns and skips such an entry "
            "(\"could not be resolved\"), so the layers meant stay plain tensors beside the split ones, and the "
            "first operation that mixes the two fails (\"got mixed torch.Tensor and DTensor\"). A plan's keys are "
            "module names relative to the module it is applied to: print(model.blocks[0]) and print(model) show them.")


def hint(output: str) -> str:
    """What a failed job's output says about the plan: the first layout against the plan's, or what
    the exception shows of the order of the calls."""
    if "overlapping meshes" in output:
        return ("\nThe classic mistake: FSDP given the whole 2-D mesh. fully_shard then spans both dimensions, the "
                "tensor-parallel one included, which the parameters already use. Give it the data-parallel "
                "dimension only: fully_shard(module, mesh=mesh['dp']).")
    keys = unmatched_keys(output)
    if keys:
        return "\nWhere it went wrong: " + unmatched_problem(keys)
    if _tp_after_fsdp(output):
        return ("\nThe classic mistake: tensor parallelism applied after fully_shard. FSDP has already made the "
                "parameters DTensors sharded over dp, and parallelize_module can only split plain tensors (a "
                "parameter that is already a DTensor over dp cannot be distributed again over tp). Split over tp "
                "first, then shard over dp.")
    records = _probe(output)
    problem = layout_problem(records) if records else None
    return f"\nWhere it went wrong: {problem}" if problem else ""


def _counts(r: dict[str, Any], phase: str) -> dict[str, int]:
    return {k: v for k, v in r["collectives"][phase].items() if v}


def _mesh_problem(r: dict[str, Any]) -> str | None:
    if r["dp"] * r["tp"] != NPROC or r["tp"] != 2:
        return (f"the mesh is {r['dp']} x {r['tp']} (dp x tp); the plan needs 2 x 2: "
                "init_device_mesh('cpu', (world_size // TP, TP), mesh_dim_names=('dp', 'tp')).")
    groups = r.get("groups") or {}
    tp_group, dp_group = groups.get("tp"), groups.get("dp")
    if tp_group and tp_group != list(range(tp_group[0], tp_group[0] + len(tp_group))):
        return (f"the mesh has its dimensions the other way round: rank {r['rank']}'s tensor-parallel group is ranks "
                f"{tp_group} and its data-parallel group {dp_group}. On these 4 CPU processes the numbers come out "
                "the same, but a real machine numbers its ranks node by node: consecutive ranks share a node and "
                "its fast links, ranks apart sit on different nodes. Tensor parallelism communicates inside every "
                f"block, forward and backward; with tp as the outer dimension its groups join ranks {tp_group} -- "
                "with 2 GPUs per node, two nodes -- and every block's collectives cross the slowest link, while "
                "FSDP's, fewer and larger, stay inside a node. Make tp the last (innermost) dimension of the mesh: "
                "init_device_mesh(..., (world_size // TP, TP), mesh_dim_names=('dp', 'tp')).")
    return None


def _placement_problem(r: dict[str, Any]) -> str | None:
    """Where the parameters live, against the plan: every one over dp, the block linears over tp too."""
    params = r["params"]
    linear = [p for n, p in params.items() if n.endswith(LINEAR)]
    if linear and all(p["dims"] == ["tp", "dp"] for p in linear):
        return ("tensor parallelism ran over mesh['dp'] and FSDP over mesh['tp']: the two dimensions swapped. Every "
                "parameter is sharded by FSDP over tp (tok_emb.weight over tp alone), and the block's linear layers "
                "are split over dp (their tensor-parallel placement is on dp). The ranks of a dp group read "
                "different batches, so a layer split over them combines partial results of different inputs, and "
                "the two ranks that split the model are the ones FSDP treats as data-parallel replicas. Split the "
                "model over mesh['tp'] (parallelize_module) and shard it over mesh['dp'] (fully_shard).")
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
    keys = unmatched_keys("\n".join(r0.get("skipped_keys") or []))
    fwd, bwd = _counts(r0, "forward"), _counts(r0, "backward")
    ok = all(r["ok"] for r in found)
    plan_comm = fwd == expected["forward"] and bwd == expected["backward"]
    if keys and not (ok and plan_comm):
        return Verdict(False, unmatched_problem(keys) + " " + _parity(found))
    for problem in (_mesh_problem(r0), _placement_problem(r0), sequence_dim_problem(r0.get("probe") or [])):
        if problem:
            return Verdict(False, problem)
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
