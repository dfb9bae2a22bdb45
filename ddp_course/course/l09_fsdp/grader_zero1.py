"""Grader of exercise 09's second part (``lessons/exercises/09_zero1.py``): ZeRO-1 built by hand.

First, in its own process, it calls the learner's ``partition`` on other world sizes than the job's
and on another list of sizes (``partition_problem``: every parameter in exactly one rank's shard,
whether or not their number divides by the world size). Then it runs the script with torchrun on 2
processes. Every rank reports which parameters its optimizer steps, the bytes of that optimizer's
state and of a plain AdamW's (DDP's, on the same rank), the norm of each gradient it stepped with at
the first step, and, after a few steps side by side with DDP + AdamW, its largest parameter
difference from DDP, from rank 0, and every parameter's norm.
The grader checks, against references of its own:

- the partition: every parameter is stepped on exactly one rank (not on every rank: that is no
  sharding; not on two; not on none);
- the memory: each rank's optimizer state is 1/2 of an unsharded AdamW's (the lesson's calculator,
  ``memory.predict("ddp", ...)``) within what whole parameters allow;
- the gradients: those the owners stepped with at the first step equal the gradient of the mean
  loss over both ranks' batches, computed here in one process (``reference_gradient``);
- the training: every rank holds the same parameters, equal to DDP's within the script's tolerance,
  and every parameter's norm equals that of a one-process run on the global batch (``reference_norms``);

and names the mistake behind what it measured. The verdict carries the job's RESULT rows
(``verdict.records``), which the notebook's memory table reads.
"""

from __future__ import annotations

from pathlib import Path

from ddp_course.check import GradedRun, Nearest, Verdict, judged, nearest, run_exercise
from ddp_course.check.reference import harness_constants
from ddp_course.course.l09_fsdp.grader import NORM_RTOL, reference_norms

EXERCISE = "09_zero1.py"
# The course's own version of partition: the calculator's (lesson 09's memory tables use it).
DELEGATES = ("ddp_course.course.l09_fsdp.memory.zero1_partition",)
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): the greedy
# rule of the partition, and the two collectives' lines.
GIVEAWAYS = ("largest first", "from the largest down", "biggest items first", "the fewest elements so far",
             "into the emptiest bin", "sorted greedy", "dist.reduce(grad", "dist.broadcast(params[i]")
NPROC = 2
# One process on the concatenated batch vs 2 ranks averaging: the same sum in another order, last-bit
# differences (~1e-7 per gradient norm). A sum left undivided is off by a factor N, a rank's own
# gradient by tens of percent, so 1e-5 separates them.
GRAD_RTOL = 1e-5
STATE_BYTES_PER_ELEMENT = 8  # AdamW: exp_avg and exp_avg_sq, fp32
STEP_BYTES = 4  # and one fp32 step counter per parameter tensor


def state_slack(numels: list[int], world_size: int = NPROC) -> float:
    """How far whole parameters balanced by size may leave a rank's AdamW bytes from an exact 1/N.

    Greedy assignment (each parameter to the rank that owns the fewest elements so far) never lets
    two ranks differ by more than the largest parameter, so no rank is further than (N-1)/N of it
    from the average: 8 bytes per element of it. The 4-byte step counters, one per parameter owned,
    add at most 4 bytes per parameter. Any sharding at all (1/N) is far below an unsharded copy.
    """
    return (world_size - 1) / world_size * STATE_BYTES_PER_ELEMENT * max(numels) + STEP_BYTES * len(numels)


def state_budget(constants: dict) -> tuple[int, float]:
    """A plain AdamW's state bytes for the exercise's model (the lesson's calculator, ``memory.predict``)
    and the slack whole parameters allow a rank's 1/N of it (``state_slack`` of the model's tensors)."""
    from ddp_course.course.l09_fsdp import memory
    from ddp_course.course.tiny import VOCAB

    shape = {"vocab_size": VOCAB, **constants["SHAPE"]}
    numels = [t.numel for t in memory.parameter_table(shape)]
    return memory.predict("ddp", NPROC, shape)[0]["optimizer"], state_slack(numels)


def reference_gradients(constants: dict, world_size: int = NPROC) -> dict[str, dict[str, float]]:
    """Norms of the first step's gradients, computed in this process: ``global`` (the mean loss over
    every rank's batch, what averaging must give) and, per rank, that rank's own batch alone."""
    from ddp_course.course.tiny import micro_batch, reference_gradient, tiny_model

    shape, mbs, seed = constants["SHAPE"], constants["MICRO_BATCH_SIZE"], constants["SEED"]
    model = tiny_model(seed, **shape)
    out = {"global": {n: g.norm().item() for n, g in
                      reference_gradient(model, [0], world_size, micro_batch_size=mbs, block_size=shape["block_size"],
                                         seed=seed).items()}}
    for rank in range(world_size):
        x, y = micro_batch(0, rank, micro_batch_size=mbs, block_size=shape["block_size"], seed=seed)
        model(x, y)[1].backward()
        out[rank] = {n: p.grad.norm().item() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    return out


def _names(items: list[str], k: int = 4) -> str:
    return ", ".join(items[:k]) + (f" (and {len(items) - k} more)" if len(items) > k else "")


def _everything_held(ranks: dict[int, dict], names: list[str], slack: float) -> str:
    """What an optimizer that holds every parameter on every rank did, said by the AdamW state it kept.

    AdamW creates a parameter's state at its first step with a gradient, and skips a parameter whose
    ``.grad`` is None: an optimizer over all parameters keeps the full state when every gradient is
    there, and only its share when the gradients of the parameters it does not own were set to None.
    """
    r0 = ranks[0]
    full = r0["ddp_optimizer_bytes"]
    share = full / NPROC
    mine = r0["optimizer_bytes"]
    held = (f"every rank's optimizer holds all {len(names)} parameters (its param_groups), not only the "
            "parameters of its shard")
    said = f"{mine:,} bytes of AdamW state on rank 0, {mine / share:.1f}x its 1/{NPROC} share"
    fix = "In shard_optimizer, give the optimizer only the parameters of shards[rank]."
    if all(row["optimizer_bytes"] >= full - slack for row in ranks.values()):
        return (f"every rank's optimizer steps all {len(names)} parameters: each rank keeps the full AdamW state "
                f"({said}), which is DDP, not ZeRO-1. {fix}")
    if all(abs(row["optimizer_bytes"] - share) <= slack for row in ranks.values()):
        with_grad = len(r0["grad_norms"])
        when = (f": at its first step only {with_grad} of them had a gradient on rank 0"
                if 0 < with_grad < len(names) else "")
        return (f"{held}. Its AdamW state is sharded all the same ({said}) because an optimizer skips a parameter "
                f"whose .grad is None{when}. So the sharding rests on average_gradients clearing the gradients a "
                "rank does not own, which its contract does not ask for (the other ranks' copies \"may hold "
                "anything afterwards\"): this optimizer steps every parameter that carries a gradient, and its "
                f"param_groups and state_dict() list all {len(names)} parameters on every rank. {fix}")
    each = ", ".join(f"rank {r}: {row['optimizer_bytes']:,}" for r, row in sorted(ranks.items()))
    return (f"{held}, and the ranks keep {each} bytes of AdamW state where 1/{NPROC} of AdamW's is {share:,.0f}: "
            f"an optimizer steps every parameter it holds that has a gradient, owned or not. {fix}")


def _partition_problem(ranks: dict[int, dict], names: list[str], slack: float) -> str | None:
    stepped = {r: row["stepped"] for r, row in ranks.items()}
    if any(None in s for s in stepped.values()):
        return ("the optimizer holds tensors that are not the model's parameters (copies?): AdamW must hold the "
                "model's own parameters, params[i] for the i in this rank's shard, so that its step changes the model.")
    counts = {n: sum(n in s for s in stepped.values()) for n in names}
    if all(c == NPROC for c in counts.values()):
        return _everything_held(ranks, names, slack)
    twice = [n for n, c in counts.items() if c > 1]
    if twice:
        return (f"parameter(s) {_names(twice)} are stepped on {max(counts.values())} ranks: the shards overlap, so "
                "their AdamW state is kept twice. partition must give every parameter to exactly one rank.")
    none = [n for n, c in counts.items() if c == 0]
    if none:
        return (f"parameter(s) {_names(none)} are stepped on no rank: the shards leave them out, so they never "
                "train. partition must give every parameter to exactly one rank (check the parameters at the "
                "boundary between two ranks' shares).")
    return None


def _near(got: dict[str, float], ref: dict[str, float]) -> bool:
    """Every gradient norm in ``got`` is the reference's, within GRAD_RTOL."""
    return all(abs(g - ref[n]) <= GRAD_RTOL * ref[n] for n, g in got.items())


GRADIENT_EXPLANATIONS = {"averaged": "the averaged gradient", "summed": "the sum over the ranks, not averaged",
                         "own": "the rank's own batch alone", "own_divided": "the rank's own gradient divided"}


def gradient_explanation(got: dict[str, float], reference: dict, rank: int) -> Nearest:
    """Which gradient the norms ``got`` (of what rank ``rank``'s optimizer stepped with) are nearest to:
    the averaged one, or one of the classic mistakes, each computed by the grader in this process."""
    names = list(got)
    predicted = {"averaged": (reference["global"], 1.0), "summed": (reference["global"], NPROC),
                 "own": (reference[rank], 1.0), "own_divided": (reference[rank], 1 / NPROC)}
    return nearest([got[n] for n in names],
                   {k: [factor * ref[n] for n in names] for k, (ref, factor) in predicted.items()})


def _gradient_mistakes(rank: int) -> dict[str, str]:
    """What each named gradient mistake of rank ``rank`` means, and what to do (by explanation)."""
    return {
        "summed": (f"the gradients rank {rank}'s optimizer stepped with are {NPROC:.2f} times the averaged gradient: "
                   f"summed over the ranks but not averaged. In average_gradients, divide the sum by the number of "
                   "ranks. (AdamW nearly hides this, as its update divides by the gradient's size; plain SGD, "
                   "gradient clipping or a changed world size would not.)"),
        "own": (f"rank {rank}'s optimizer stepped with the gradient of its own batch alone: the gradients were "
                "never combined across ranks, so each owner trains on half the data. In average_gradients, sum "
                "each gradient over the ranks (dist.reduce to its owner, or dist.all_reduce), then divide by the "
                "number of ranks."),
        "own_divided": (f"rank {rank}'s optimizer stepped with its own gradient divided by {NPROC}: the division of "
                        "the average happened, the sum over the ranks did not. Reduce (sum) each gradient before "
                        "dividing."),
    }


def _grad_problem(ranks: dict[int, dict], reference: dict) -> str | None:
    want = reference["global"]
    for rank, row in sorted(ranks.items()):
        got = row["grad_norms"]
        if not got or _near(got, want):
            continue
        found = gradient_explanation(got, reference, rank)
        mistakes = _gradient_mistakes(rank)
        if found.clear() and found.name in mistakes:
            return f"{mistakes[found.name]} ({found.shown(GRADIENT_EXPLANATIONS)}.)"
        worst = max(got, key=lambda n: abs(got[n] - want[n]) / want[n])
        return (f"the gradient rank {rank}'s optimizer stepped with differs from the gradient averaged over both "
                f"ranks' batches (e.g. {worst}: norm {got[worst]:.4g}, expected {want[worst]:.4g}). average_gradients "
                "must leave on each parameter's owner the sum over the ranks divided by their number.")
    return None


def diagnose(found: list[dict], reference: dict, norms: dict[str, float], unsharded: int, slack: float,
             lr: float) -> Verdict:
    """The verdict on the script's RESULT rows, given the grader's own references (``references``):
    ``reference`` from ``reference_gradients``, ``norms`` from ``reference_norms``, ``unsharded`` and
    ``slack`` from ``state_budget``."""
    ranks = {r["rank"]: r for r in found}
    if sorted(ranks) != list(range(NPROC)):
        return Verdict(False, f"only ranks {sorted(ranks)} reported; every rank must finish.")
    r0 = ranks[0]
    names = list(r0["param_norms"])
    problem = _partition_problem(ranks, names, slack)
    if problem:
        return Verdict(False, problem)
    share = unsharded / NPROC
    for r in ranks.values():
        if abs(r["optimizer_bytes"] - share) > slack:
            held = ", ".join(f"rank {k}: {v['optimizer_bytes']:,}" for k, v in sorted(ranks.items()))
            return Verdict(False, f"every parameter has one owner, but the optimizer state is unbalanced ({held} bytes; "
                                  f"1/{NPROC} of AdamW's {unsharded:,} is {share:,.0f}, and whole parameters allow "
                                  f"{slack:,.0f} either way): the largest rank sets the memory. In partition, "
                                  "balance by size: give each parameter, largest first, to the rank that owns the "
                                  "fewest elements so far.")
    problem = _grad_problem(ranks, reference)
    if problem:
        return Verdict(False, problem)
    across = max(r["max_abs_diff_across_ranks"] for r in found)
    if across > 0:  # a broadcast copies the owner's bits: any difference means a rank missed an update
        return Verdict(False, f"after training, the ranks hold different parameters (up to {across:.2e} apart): each "
                              "rank updated only the parameters it owns and never received the others. In "
                              "share_updates, broadcast every parameter from its owner (dist.broadcast(..., src=owner)).")
    worst = max(r["max_abs_diff_vs_ddp"] for r in found)
    if worst > lr / 100:  # rounding stays far below; a parameter missing an update is ~lr away
        return Verdict(False, f"every rank holds the same parameters, but they differ from DDP's by up to {worst:.2e} "
                              f"(more than lr / 100 = {lr / 100:.0e}): did share_updates send each parameter from the "
                              "rank that stepped it (its owner in shards)?")
    bad = [n for n, v in norms.items() if n not in r0["param_norms"] or abs(r0["param_norms"][n] - v) > NORM_RTOL * abs(v)]
    if bad:
        return Verdict(False, f"the parameters {bad[:4]} after training differ from the grader's own reference (one "
                              "process on the global batch, plain AdamW). Step each parameter once, with the averaged "
                              "gradient, and leave AdamW's settings as they are (lr=LR, its defaults otherwise).")
    held = ", ".join(f"{r['optimizer_bytes']:,}" for _, r in sorted(ranks.items()))
    return Verdict(True, f"every parameter is stepped on exactly one rank; the ranks hold {held} bytes of AdamW state, "
                         f"1/{NPROC} of an unsharded AdamW's {unsharded:,} within {slack:,.0f} (whole parameters); "
                         f"the owners stepped with the averaged gradient; after training every rank holds the same "
                         f"parameters, equal to DDP's (max difference {worst:.1e}) and to the grader's one-process "
                         "reference.")


# ``partition`` is a pure function, and the job calls it on 2 ranks only, where MiniGPT's 28 tensors
# divide evenly: a rule that works only then (rows of world_size, the last one dropped) passes there
# and leaves a parameter without an owner on 3 ranks. So before the job the grader also calls the
# learner's own ``partition`` in this process (the script imported as a module; its ``main`` does not
# run) on other world sizes and another list of sizes, and checks the exercise's contract as the
# harness relies on it: one shard per rank (rank r owns shards[r]), every parameter in exactly one of
# them, and each rank's share "about sum(sizes) / world_size", read as loosely as whole parameters
# allow: no rank above it by more than the largest parameter (a greedy by size stays within (N-1)/N
# of it, runs of consecutive parameters cut by running size within 1x). How a correct partition
# balances is otherwise its own business: the job measures the memory on its 2 ranks. A partition
# already wrong on the job's own case is left to the job, which shows what it does.
PARTITION_WORLD_SIZES = (1, 3, 4, 5, 8)  # the exercise's model on these (28 tensors: 1, 3 or 4 left over)
PARTITION_OTHER = ([7, 5, 3, 3, 1], (2, 3))  # and an odd number of parameters, on 2 and 3 ranks
PARTITION_DEADLINE_S = 10.0  # for all the calls together; the course's partition takes microseconds
OWNERLESS = "without an owner"


def _load_script(path: str | Path):
    """The learner's script as a module (its ``main`` does not run: it is guarded by ``__name__``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("exercise_09_zero1", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _contract_problem(shards, sizes: list[int], world_size: int, names: list[str] | None) -> str | None:
    """What ``shards``, returned by ``partition(sizes, world_size)``, does against the exercise's
    contract, as the rest of a sentence ("partition(...) returns 2 shards for 3 ranks"); None when nothing.
    A parameter without an owner is said with OWNERLESS."""
    import operator

    def named(indices: list[int]) -> str:
        return _names([f"{names[i]} (index {i})" if names else f"index {i}" for i in indices], 3)

    try:
        given = [[operator.index(i) for i in shard] for shard in shards]
    except TypeError as exc:
        return f"returns {shards!r:.80}, which is not one list of parameter indices per rank ({exc})"
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    if len(given) < world_size:
        return (f"returns {len(given)} shard(s) for {ranks}: shards[{len(given)}] does not exist, and the harness "
                "looks up shards[rank] on every rank. Return one list per rank")
    extra = [i for shard in given[world_size:] for i in shard]
    if extra:
        return (f"returns {len(given)} shards for {ranks}: {named(extra)} in shards[{world_size}:] would belong to "
                "ranks that do not exist, and never train. Return one list per rank")
    bad = sorted({i for shard in given for i in shard if not 0 <= i < len(sizes)})
    if bad:
        return (f"holds {_names([str(i) for i in bad], 3)}, which {'is' if len(bad) == 1 else 'are'} not the index "
                f"of a parameter (0..{len(sizes) - 1})")
    owners = {i: [r for r, shard in enumerate(given) for j in shard if j == i] for i in range(len(sizes))}
    none = [i for i, rs in owners.items() if not rs]
    if none:
        n, left = len(sizes), len(sizes) % world_size
        why = f" ({n} = {n // world_size} x {world_size} + {left}: what happens to the {left} left over?)" if left else ""
        return (f"gives {named(none)} to no rank: {'it is' if len(none) == 1 else 'they are'} in no shard, left "
                f"{OWNERLESS}, and would never train{why}")
    twice = [i for i, rs in owners.items() if len(rs) > 1]
    if twice:
        return (f"gives {named(twice)} to more than one rank (ranks {owners[twice[0]]}"
                f"{' for the first' if len(twice) > 1 else ''}): each would keep its AdamW state and step it")
    share, largest = sum(sizes) / world_size, max(sizes)
    owned = [sum(sizes[i] for i in shard) for shard in given]
    worst = max(range(world_size), key=lambda r: owned[r])
    if owned[worst] > share + largest:
        return (f"gives rank {worst} {owned[worst]:,} of the {sum(sizes):,} elements, more than an even share "
                f"({share:,.0f}) plus the largest parameter ({largest:,}) allow: that rank would hold most of the "
                "optimizer state. Balance the shares by size")
    return None


def partition_problem(partition, sizes: list[int], names: list[str]) -> str | None:
    """What the learner's ``partition`` does wrong away from the job's case, as a verdict's message, or None.

    ``sizes`` and ``names``: the exercise's model's parameters. ``partition`` is called on them with
    every world size of ``PARTITION_WORLD_SIZES``, and on ``PARTITION_OTHER``'s sizes, after the job's
    own case (the model on ``NPROC`` ranks): None when the contract holds on every case, or when it
    already fails on the job's own case (the job then shows what the partition does). The calls run in
    a thread, within ``PARTITION_DEADLINE_S`` for all of them.
    """
    import threading

    cases = [(sizes, names, NPROC), *((sizes, names, n) for n in PARTITION_WORLD_SIZES),
             *((PARTITION_OTHER[0], None, n) for n in PARTITION_OTHER[1])]
    at: list[int] = [0]  # the case being called
    found: list[str] = []

    def call_all() -> None:
        for k, (case_sizes, case_names, n) in enumerate(cases):
            at[0] = k
            try:
                problem = _contract_problem(partition(list(case_sizes), n), case_sizes, n, case_names)
            except Exception as exc:  # noqa: BLE001 -- the learner's code: any error is part of the verdict
                said = str(exc).strip().splitlines()
                problem = f"raised {type(exc).__name__}" + (f": {said[0][:200]}" if said else "")
            if problem:
                found.append(problem)
                return

    thread = threading.Thread(target=call_all, name="partition check", daemon=True)
    thread.start()
    thread.join(PARTITION_DEADLINE_S)
    k = at[0]
    if k == 0 or not (found or thread.is_alive()):
        return None
    case_sizes, case_names, n = cases[k]
    problem = found[0] if found else f"did not return within {PARTITION_DEADLINE_S:.0f}s"
    what = f"sizes of the exercise's {len(case_sizes)} parameters" if case_names else str(list(case_sizes))
    ranks = f"{n} rank{'s' if n > 1 else ''}"
    if OWNERLESS not in problem:
        lead = f"your partition breaks the exercise's contract on another world size than the job's {NPROC}"
    elif len(case_sizes) % n:
        lead = "your partition leaves parameters without an owner when their number does not divide by the world size"
    else:
        lead = "your partition leaves parameters without an owner"
    return (f"{lead}: on {ranks}, partition({what}, {n}) {problem}. The job runs {NPROC} ranks with the exercise's "
            f"{len(sizes)} parameters, where this does not show; partition must give every parameter to exactly "
            "one rank, in one shard per rank, for any world size and any number of parameters. Fix partition, "
            "then run the check again.")


def learner_partition_problem(path: str | Path) -> str | None:
    """``partition_problem`` of the ``partition`` in the script at ``path``, on the exercise's model
    (None also when the script cannot be read or imported here: the job then shows why)."""
    from ddp_course.course.tiny import tiny_model

    try:
        constants = harness_constants(path)
        partition = _load_script(path).partition
        named = list(tiny_model(constants["SEED"], **constants["SHAPE"]).named_parameters())
    except Exception:  # noqa: BLE001 -- e.g. an import error or a syntax error: the job reports it, with its line
        return None
    return partition_problem(partition, [p.numel() for _, p in named], [n for n, _ in named])


def collect(path: str | Path, timeout: float = 180) -> list[dict] | Verdict:
    """Run the script on 2 ranks: its RESULT lines, or a failing verdict saying why there are none."""
    return run_exercise(path, NPROC, "a function of the exercise", timeout, hint=_hint)


def _hint(output: str) -> str:
    """A likely cause of a job that did not finish, read from its output."""
    if "empty parameter list" in output:
        return (" A rank's AdamW got no parameter at all: partition left that rank without a share. Give every "
                "rank some parameters, balanced by size.")
    return ""


def references(path: str | Path) -> dict:
    """The grader's own references for the script at ``path`` (its constants read, not run)."""
    constants = harness_constants(path)
    unsharded, slack = state_budget(constants)
    return {"reference": reference_gradients(constants), "norms": reference_norms(constants),
            "unsharded": unsharded, "slack": slack, "lr": constants["LR"]}


def optimizer_problem(shard_optimizer, params: list, shards: list[list[int]], lr: float) -> str | None:
    """What the learner's ``shard_optimizer`` does wrong with the arguments ``ZeroRedundancyOptimizer``
    users pass (another optimizer class and its keyword arguments), as a verdict's message; or None.
    The default (AdamW with the exercise's LR) is the job's case, checked there."""
    import torch

    try:
        opt = shard_optimizer(params, shards, 0, torch.optim.SGD, lr=0.5, momentum=0.9)
    except Exception as exc:  # noqa: BLE001 -- the learner's error, reported
        return (f"shard_optimizer(params, shards, 0, torch.optim.SGD, lr=0.5, momentum=0.9) raised "
                f"{type(exc).__name__}: {exc}. It must accept an optimizer class and its keyword arguments.")
    if not isinstance(opt, torch.optim.SGD):
        return (f"shard_optimizer(params, shards, 0, torch.optim.SGD, lr=0.5, momentum=0.9) returned an "
                f"optimizer of class {type(opt).__name__}: build optimizer_class, the class the caller names "
                "(AdamW is only the default).")
    group = opt.param_groups[0] if opt.param_groups else {}
    if group.get("lr") != 0.5 or group.get("momentum") != 0.9:
        return ("shard_optimizer(params, shards, 0, torch.optim.SGD, lr=0.5, momentum=0.9) built an SGD with "
                f"lr={group.get('lr')}, momentum={group.get('momentum')}: pass the caller's keyword arguments "
                f"(defaults) to the optimizer, with lr={lr:g} only when they give none.")
    return None  # which parameters it gets: the job measures that, and names the mistake from its numbers


def learner_optimizer_problem(path: str | Path) -> str | None:
    """``optimizer_problem`` of the ``shard_optimizer`` in the script at ``path`` (None also when the
    script cannot be imported here: the job then shows why)."""
    import torch

    try:
        script = _load_script(path)
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 4, 3, 2)]
        shards = [[0, 3], [1, 2]]
        return optimizer_problem(script.shard_optimizer, params, shards, harness_constants(path)["LR"])
    except Exception:  # noqa: BLE001
        return None


def grade(path: str | Path, timeout: float = 180) -> GradedRun:
    """Check the learner's ``partition`` on other world sizes in this process (``learner_partition_problem``),
    then run the script on 2 ranks and compare with the grader's own references.

    The verdict carries the job's RESULT rows (``verdict.records``, one per rank; empty when the job
    gave none): the notebook shows what the job measured without launching it again.
    """
    problem = learner_partition_problem(path) or learner_optimizer_problem(path)  # in this process, before any job
    if problem:
        return GradedRun(False, problem)
    found = collect(path, timeout)
    return judged(found, lambda rows: diagnose(rows, **references(path)))
