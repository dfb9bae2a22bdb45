"""A mixture of experts spread over CPU ranks (expert parallelism), against one process.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.moe_lab

MiniGPT's MLPs become mixtures of ``--n_experts`` experts (``experts.MoE``); in the expert-parallel copy
(``experts.ExpertParallelMoE``) rank r keeps experts ``r E/p .. (r+1) E/p - 1``, every rank routes its own
quarter (at 4 ranks) of the global batch and sends each token-slot to its expert's rank with
``all_to_all_single``. One launch gives both sizes: on more than 2 ranks the parity runs once on all of
them and once on ranks 0 and 1 alone (a group of 2), and the two training runs go to two pairs of ranks
at once. The lab records, rank 0 writing ``<out_dir>/moe_lab.json`` (``--out_dir=runs/14_moe``):

- **parity** with one process (every rank of the group also trains the one-process model on the whole
  global batch, from the same weights): each step's loss, every gradient of the first step (each rank
  compares the parameters it holds), the weights at the end, and the slots dropped, at
  ``--capacity_factor`` below 1 so that slots really drop; in float32, and once more in float64
  (``--fp64``); on 2 ranks and on all of them (``parity["2"]``, ``parity["4"]``);
- **traffic**: the rows each expert received and the bytes each rank handed to ``all_to_all_single``,
  measured, against what the routers' choices alone predict (:func:`predicted_traffic`);
- **balance over training**: ``--train_steps`` AdamW steps on the corpus without the auxiliary loss and
  with ``--aux_coef``, each on 2 ranks (ranks 0 and 1, and ranks 2 and 3 at the same time when there are
  4; one after the other on 2), the load of the busiest expert over the mean and the fraction of slots
  dropped at each step (``figures.moe_balance`` draws them).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l11_beyond_data_parallel.tp_lab import same_batches  # global batches of the corpus
from ddp_course.course.l14_sequences_and_experts import experts as moe
from ddp_course.course.options import lab_help, write_result
from ddp_course.dist import log, setup

PROG = "torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.moe_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/14_moe", "n_experts": 8, "top_k": 2, "capacity_factor": 0.75, "aux_coef": 0.01,
    "steps": 3, "fp64": True, "train_steps": 200, "train_capacity_factor": 1.0, "n_layer": 2, "n_head": 2,
    "n_embd": 32, "block_size": 32, "batch_size": 8, "lr": 3e-3, "seed": 0, "corpus": "tinyshakespeare",
    "timeout_s": 60.0,
}
HELP = lab_help("moe_lab", DEFAULTS, n_experts="experts per block (divisible by the ranks)",
                top_k="experts per token: 1 or 2",
                capacity_factor="capacity of the parity runs (below 1: slots drop)",
                aux_coef="weight of the load-balancing loss (parity, and the second training run)",
                steps="AdamW steps of the parity runs", fp64="repeat the parity in float64",
                train_steps="AdamW steps of each training run (0: none)",
                train_capacity_factor="capacity of the training runs",
                batch_size="sequences per step, the whole global batch (divisible by the ranks)",
                seed="model initialisation and the batches")
# Tolerances of the float32 parity. Both sides do the same arithmetic on the same rows, grouped
# differently: the one-process matmuls see 256 rows where a rank sees 64, an expert's rows arrive in
# other batches, a token's two experts are added in another order, the losses and gradients are
# averaged over ranks. Each regrouping moves a float32 result by about its rounding, ~1e-7 relative;
# the bounds leave a factor of 10 (loss) to 100 (the smallest gradients, an expert's bias) above that.
# The weights after a few AdamW steps (relative to the weights) differ more than the gradients: AdamW
# moves a weight whose gradient is rounding noise by a sizeable fraction of lr (lesson 04, section 6),
# which the measured 6e-5 to 9e-5 reflect; 1e-3 leaves a factor of 10 above them.
# In float64 the same algorithm lands ~1e-16 (loss) to ~1e-13 (weights) from one process: what is left in
# float32 is rounding. FP64_RTOL bounds its loss and gradients: 1e-12 is ~9,000 units of float64's rounding
# (1.1e-16), a loose bound on purpose -- the loss and gradients measure a few units (1e-16 to 6e-16), and a
# token-slot served by another expert or brought home to another token moves them by ~1e-6 or more
# (experts_harness), so any bound between the two tells them apart.
LOSS_RTOL, GRAD_RTOL, UPDATE_RTOL = 1e-6, 1e-5, 1e-3
FP64_RTOL = 1e-12


def check_options(opts: dict[str, Any], world_size: int) -> None:
    """Bad options become a :class:`FlagError` before any process group is formed."""
    if opts["top_k"] not in (1, 2):
        raise FlagError(f"--top_k={opts['top_k']}: a token goes to 1 or 2 experts (Switch: 1, Mixtral: 2).")
    if opts["n_experts"] < max(2, opts["top_k"]):
        raise FlagError(f"--n_experts={opts['n_experts']} must be at least 2 and at least --top_k={opts['top_k']}.")
    if opts["n_experts"] % world_size:
        raise FlagError(f"--n_experts={opts['n_experts']} cannot be split evenly over {world_size} ranks: "
                        f"choose a multiple of {world_size}.")
    if opts["batch_size"] % world_size:
        raise FlagError(f"--batch_size={opts['batch_size']} must be divisible by the {world_size} ranks.")
    if world_size > 2 and (opts["n_experts"] % 2 or opts["batch_size"] % 2):
        raise FlagError(f"--n_experts={opts['n_experts']} and --batch_size={opts['batch_size']} must be even: "
                        "the lab also runs on groups of 2 ranks.")
    for key in ("capacity_factor", "train_capacity_factor"):
        if opts[key] <= 0:
            raise FlagError(f"--{key}={opts[key]} must be positive.")
    for key in ("steps", "n_layer", "n_head", "n_embd", "block_size"):
        if opts[key] < 1:
            raise FlagError(f"--{key} must be at least 1 (got {opts[key]}).")
    if opts["n_embd"] % opts["n_head"]:
        raise FlagError(f"--n_embd={opts['n_embd']} must be a multiple of --n_head={opts['n_head']}.")
    if opts["train_steps"] < 0 or opts["aux_coef"] < 0:
        raise FlagError("--train_steps and --aux_coef cannot be negative.")


def build(opts: dict[str, Any], capacity_factor: float, vocab: int, dtype: torch.dtype):
    """The one-process mixture-of-experts MiniGPT, the same in every process (seeded)."""
    shape = {k: opts[k] for k in ("n_experts", "top_k", "seed", "block_size", "n_layer", "n_head", "n_embd")}
    return moe.moe_gpt(capacity_factor=capacity_factor, vocab_size=vocab, **shape).to(dtype)


def my_rows(batch: tuple[torch.Tensor, torch.Tensor], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a global batch in ``group``: consecutive rows, the group's rank 0 first (the
    global token order)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    n = batch[0].shape[0] // size
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)


def pairs(world_size: int) -> list[tuple[dist.ProcessGroup | None, list[int]]]:
    """Groups of 2 ranks, (0, 1), (2, 3), ... with their ranks; on 2 ranks the world itself. Every rank
    must call it (``new_group`` is collective)."""
    if world_size == 2:
        return [(None, [0, 1])]
    return [(dist.new_group([r, r + 1]), [r, r + 1]) for r in range(0, world_size - 1, 2)]


def parity(opts: dict[str, Any], data: list, vocab: int, group: dist.ProcessGroup | None, dtype: torch.dtype
           ) -> dict[str, Any]:
    """This rank's view of ``--steps`` AdamW steps of one process and of the expert-parallel model on
    ``group`` side by side."""
    ref = build(opts, opts["capacity_factor"], vocab, dtype)
    ep = moe.expert_parallel(ref, group)  # before the reference moves: the same initial weights
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=opts["lr"], foreach=False)
    opt_ep = torch.optim.AdamW(ep.parameters(), lr=opts["lr"], foreach=False)
    ref_params = dict(ref.named_parameters())
    out: dict[str, Any] = {"rank": dist.get_rank(group), "experts": [int(e) for e in ep.blocks[0].mlp.experts],
                           "steps": []}
    for step, batch in enumerate(data[:opts["steps"]]):
        loss_ref, _ = moe.moe_loss(ref, *batch, opts["aux_coef"])
        loss_ref.backward()
        for layer in moe.moe_layers(ep):
            layer.ledger.clear()
        loss_ep, _ = moe.moe_loss(ep, *my_rows(batch, group), opts["aux_coef"])
        loss_ep.backward()
        moe.sync_gradients(ep, group)
        glob = loss_ep.detach().double().clone()
        dist.all_reduce(glob, group=group)  # the global loss: the mean of the ranks' losses (equal batches)
        layers, ref_layers = moe.moe_layers(ep), moe.moe_layers(ref)
        out["steps"].append({
            "loss": float(glob) / dist.get_world_size(group), "reference_loss": float(loss_ref.detach()),
            "dropped_here": [m.dropped_here for m in layers], "reference_dropped": [m.dropped for m in ref_layers],
            "capacity": [m.capacity for m in layers], "reference_capacity": [m.capacity for m in ref_layers],
            "local_tokens_per_expert": [m.local_tokens_per_expert.tolist() for m in layers],
            "received": [m.received for m in layers],
            "reference_tokens_per_expert": [m.tokens_per_expert.tolist() for m in ref_layers],
            "ledger": [dict(m.ledger) for m in layers]})
        if step == 0:
            errs = {n: moe.relative_error(w.grad, ref_params[n].grad) for n, w in ep.named_parameters()}
            worst = max(errs, key=errs.get)
            out["grad_rel_err"], out["worst_grad"], out["grads_compared"] = errs[worst], worst, len(errs)
        for opt in (opt_ref, opt_ep):
            opt.step()
            opt.zero_grad(set_to_none=True)
    out["update_rel_diff"] = max(moe.relative_error(w.detach(), ref_params[n].detach()) for n, w in ep.named_parameters())
    return out


def predicted_traffic(local_counts: list[list[int]], rank: int, row_bytes: int) -> dict[str, int]:
    """The bytes rank ``rank`` hands to ``all_to_all_single`` in one layer's forward and backward, from the
    routers' choices alone: ``local_counts[s][e]`` slots of rank s routed to expert e.

    Dispatch sends all of the rank's slots (a dropped slot is dropped where its expert is, so it travels
    too); combine sends back one row per row received. The backward exchanges mirror them: the
    combine's backward sends what the dispatch sent, the dispatch's backward what the combine sent.
    ``.others``: rows bound for other ranks; the rest is the rank's own split, which ``all_to_all_single``
    copies in memory. The counts exchanged first (E int64 per layer, an all-to-all and an all-reduce) are
    control traffic, not counted here."""
    p, n_experts = len(local_counts), len(local_counts[0])
    mine = range(rank * n_experts // p, (rank + 1) * n_experts // p)
    sent = sum(local_counts[rank])
    kept_home = sum(local_counts[rank][e] for e in mine)
    received = sum(local_counts[s][e] for s in range(p) for e in mine)
    out = {"dispatch": sent, "dispatch.others": sent - kept_home, "combine": received,
           "combine.others": received - kept_home}
    out |= {"combine.backward": out["dispatch"], "combine.backward.others": out["dispatch.others"],
            "dispatch.backward": out["combine"], "dispatch.backward.others": out["combine.others"]}
    return {k: v * row_bytes for k, v in out.items()}


def summarise_parity(per_rank: list[dict[str, Any]], row_bytes: int) -> dict[str, Any]:
    """The ranks' views put together: the figures the notebook prints and the tests assert."""
    steps, first = range(len(per_rank[0]["steps"])), per_rank[0]["steps"]
    losses = [first[s]["loss"] for s in steps]
    ref_losses = [first[s]["reference_loss"] for s in steps]
    dropped = [[sum(r["steps"][s]["dropped_here"][i] for r in per_rank) for i in range(len(first[s]["capacity"]))]
               for s in steps]
    received = [[[n for r in per_rank for n in r["steps"][s]["received"][i]] for i in range(len(first[s]["capacity"]))]
                for s in steps]
    traffic_ok, tokens_ok = True, True
    for s in steps:
        for i in range(len(first[s]["capacity"])):
            counts = [r["steps"][s]["local_tokens_per_expert"][i] for r in per_rank]
            routed = [sum(c[e] for c in counts) for e in range(len(counts[0]))]
            tokens_ok &= received[s][i] == routed == first[s]["reference_tokens_per_expert"][i]
            for r in per_rank:
                traffic_ok &= r["steps"][s]["ledger"][i] == predicted_traffic(counts, r["rank"], row_bytes)
    return {
        "losses": losses, "reference_losses": ref_losses,
        "loss_rel_diffs": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)],
        "loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "grad_rel_err": max(r["grad_rel_err"] for r in per_rank),
        "worst_grad": max(per_rank, key=lambda r: r["grad_rel_err"])["worst_grad"],
        "grads_compared": sum(r["grads_compared"] for r in per_rank),
        "update_rel_diff": max(r["update_rel_diff"] for r in per_rank),
        "dropped": dropped, "reference_dropped": [first[s]["reference_dropped"] for s in steps],
        "capacity": [first[s]["capacity"] for s in steps],
        "tokens_per_expert": received, "reference_tokens_per_expert": [first[s]["reference_tokens_per_expert"]
                                                                       for s in steps],
        "tokens_match": tokens_ok, "traffic_matches": traffic_ok,
        "per_rank": per_rank,
    }


def traffic_table(per_rank: list[dict[str, Any]], row_bytes: int) -> list[dict[str, Any]]:
    """The first step's bytes per rank, summed over the layers: measured, and predicted from the routers."""
    rows = []
    first = [r["steps"][0] for r in per_rank]
    for r, mine in zip(per_rank, first):
        layers = range(len(mine["ledger"]))
        predicted = [predicted_traffic([f["local_tokens_per_expert"][i] for f in first], r["rank"], row_bytes)
                     for i in layers]
        rows.append({"rank": r["rank"], "experts": r["experts"],
                     "measured": {k: sum(mine["ledger"][i].get(k, 0) for i in layers) for k in predicted[0]},
                     "predicted": {k: sum(p[k] for p in predicted) for k in predicted[0]}})
    return rows


def train_balance(opts: dict[str, Any], data: list, vocab: int, group: dist.ProcessGroup | None, aux_coef: float
                  ) -> dict[str, Any]:
    """``--train_steps`` AdamW steps of the expert-parallel model on ``group``; per step the global
    cross-entropy and auxiliary loss, the busiest expert's load over the mean (per block, then averaged)
    and the dropped fraction."""
    size = dist.get_world_size(group)
    model = moe.expert_parallel(build(opts, opts["train_capacity_factor"], vocab, torch.float32), group)
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    series: dict[str, list] = {"ce": [], "aux": [], "imbalance": [], "dropped_fraction": [], "tokens_per_expert": []}
    for batch in data[:opts["train_steps"]]:
        loss, ce = moe.moe_loss(model, *my_rows(batch, group), aux_coef)
        loss.backward()
        moe.sync_gradients(model, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        layers = moe.moe_layers(model)
        both = torch.stack([ce.detach(), sum(m.aux_loss.detach() for m in layers)]).double()
        dist.all_reduce(both, group=group)  # the means over ranks are the global values (equal batches; aux: see MoE)
        counts = [m.tokens_per_expert for m in layers]
        series["ce"].append(float(both[0]) / size)
        series["aux"].append(float(both[1]) / size / len(layers))
        series["imbalance"].append(sum(float(c.max() / c.float().mean()) for c in counts) / len(counts))
        series["dropped_fraction"].append(sum(m.dropped for m in layers) / sum(int(c.sum()) for c in counts))
        series["tokens_per_expert"].append([c.tolist() for c in counts])
    tail = max(1, len(series["ce"]) // 5)
    series["last"] = {k: sum(series[k][-tail:]) / tail for k in ("ce", "aux", "imbalance", "dropped_fraction")}
    series["first"] = {k: sum(series[k][:tail]) / tail for k in ("ce", "aux", "imbalance", "dropped_fraction")}
    series["window"] = tail
    return {"aux_coef": aux_coef, "capacity_factor": opts["train_capacity_factor"], "n_experts": opts["n_experts"],
            "top_k": opts["top_k"], "ranks": size, **series}


def report_parity(name: str, v: dict[str, Any]) -> None:
    log(f"[moe_lab] parity, {name}: losses {' '.join(f'{x:.6f}' for x in v['losses'])} (one process "
        f"{' '.join(f'{x:.6f}' for x in v['reference_losses'])}); relative differences: loss "
        f"{v['loss_rel_diff']:.1e}, gradients {v['grad_rel_err']:.1e} (worst {v['worst_grad']}, "
        f"{v['grads_compared']} compared), weights {v['update_rel_diff']:.1e}")
    log(f"[moe_lab]   dropped slots per block and step {v['dropped']} (one process {v['reference_dropped']}, "
        f"capacity {v['capacity'][0][0]}); rows per expert = routers' choices: {v['tokens_match']}, "
        f"bytes = prediction: {v['traffic_matches']}")


@command
def main(argv: list[str]) -> int:
    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    check_options(opts, int(os.environ.get("WORLD_SIZE", 1)))
    with setup(device="cpu", timeout_s=opts["timeout_s"], threads=1,
               because="expert parallelism by hand with gloo's all_to_all_single, on a laptop's cores") as info:
        if not info.is_distributed or info.world_size < 2:
            raise FlagError(f"the lab needs a process group of at least 2 ranks: launch it with `{PROG}`.")
        t0 = time.perf_counter()
        data, vocab = same_batches({**opts, "steps": max(opts["steps"], opts["train_steps"])}, info.device)
        log(f"[moe_lab] {info.world_size} ranks, {opts['n_experts']} experts per block "
            f"({opts['n_experts'] // info.world_size} per rank), top-{opts['top_k']}; global batch "
            f"{opts['batch_size']} x {opts['block_size']} tokens; MiniGPT with experts "
            f"{build(opts, 1.0, vocab, torch.float32).num_params():,} parameters")
        n, groups = info.world_size, pairs(info.world_size)
        dtypes = (("float32", torch.float32), ("float64", torch.float64))[:2 if opts["fp64"] else 1]
        coefs = (0.0, opts["aux_coef"])[:2 if opts["train_steps"] else 0]
        # Each rank's share of the work, gathered once at the end: the parity on all the ranks, then on
        # ranks 0 and 1 alone while ranks 2 and 3 start training; the two training runs on 2 ranks each,
        # at once on two pairs when there are 4 ranks or more (one after the other on 2).
        mine: dict[str, Any] = {"parity": {}, "training": {}}
        for size, (group, members) in {n: (None, list(range(n))), 2: groups[0]}.items():
            if info.rank in members:
                mine["parity"][str(size)] = {name: parity(opts, data, vocab, group, dtype) for name, dtype in dtypes}
        for i, coef in enumerate(coefs):
            group, members = groups[i % len(groups)]
            if info.rank in members:
                run = train_balance(opts, data, vocab, group, coef)
                if info.rank == members[0]:
                    mine["training"][f"aux_coef={coef:g}"] = {**run, "on_ranks": members}
        every: list = [None] * n
        dist.all_gather_object(every, mine)
        results: dict[str, Any] = {}
        for size in sorted({2, n}):
            results[str(size)] = {}
            for name, dtype in dtypes:
                per_rank = [r["parity"][str(size)][name] for r in every if str(size) in r["parity"]]
                row_bytes = opts["n_embd"] * torch.tensor([], dtype=dtype).element_size()
                v = results[str(size)][name] = summarise_parity(per_rank, row_bytes)
                v["traffic"] = traffic_table(per_rank, row_bytes)
                report_parity(f"{size} ranks, {name}", v)
        for row in results[str(n)]["float32"]["traffic"]:
            m, p = row["measured"], row["predicted"]
            log(f"[moe_lab]   rank {row['rank']} (experts {row['experts']}), step 1 forward: dispatch "
                f"{m['dispatch']:,} B ({m['dispatch.others']:,} to other ranks), combine {m['combine']:,} B "
                f"({m['combine.others']:,}); predicted {p['dispatch']:,} ({p['dispatch.others']:,}) and "
                f"{p['combine']:,} ({p['combine.others']:,})")
        training = {label: r["training"][label] for label in (f"aux_coef={c:g}" for c in coefs)
                    for r in every if label in r["training"]}
        for label, run in training.items():
            f, la = run["first"], run["last"]
            log(f"[moe_lab] train {label} on ranks {run['on_ranks']}: cross-entropy {f['ce']:.3f} -> {la['ce']:.3f}; busiest "
                f"expert / mean {f['imbalance']:.2f} -> {la['imbalance']:.2f}; dropped {f['dropped_fraction']:.1%}"
                f" -> {la['dropped_fraction']:.1%} (means of the first and last {run['window']} steps)")
        out = {"world_size": info.world_size, "options": opts, "vocab_size": vocab, "parity": results,
               "training": training, "seconds": time.perf_counter() - t0,
               "tolerances": {"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL, "update_rtol": UPDATE_RTOL,
                              "fp64_rtol": FP64_RTOL}}
        write_result(info, opts["out_dir"], "moe_lab", out, f" in {out['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
