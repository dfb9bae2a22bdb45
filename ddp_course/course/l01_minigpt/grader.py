"""Grader of exercise 01 (``lessons/exercises/01_global_val_loss.py``) and notebook 01's attention check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_course.check import Verdict, nearest, not_complete, run_exercise
from ddp_course.check.records import notebook_exercise

EXERCISE = "01_global_val_loss.py"  # the script this grades: lessons/exercises/01_global_val_loss.py
# What would state the answer before it is graded (tests/exercises/test_exercises_ask.py): that each rank's
# sum and count are what goes into the collective (one tensor, one all-reduce), and the division after it.
GIVEAWAYS = ("sum and a count fit in one", "one collective carries both", "sum and count over all ranks",
             "all-reduce the sum and the count", "all-reduce the sums and the counts", "total sum over the total count")


N_WINDOWS = 47  # the exercise's own setting (part of its harness, which check.grade compares)
# float32 window losses summed in another order are ~1e-7 apart; the classic mistakes are ~1e-4 off or
# more. Measured in one process on the ranks' shards: the solution's global mean 1.4e-7 (2 ranks) and
# 6.1e-8 (3 ranks) from the grader's value, the mean of the per-rank means 8.3e-5 and 6.4e-5, a rank's
# own mean 1.3e-3 to 4.2e-3.
TOLERANCE = 1e-6


def reference_losses() -> torch.Tensor:
    """The loss of each of the exercise's validation windows (float64), computed here in one process
    with the exercise's model (same seed, same shape): what the grader's answers are made of."""
    from ddp_course.data import prepare
    from ddp_course.dist import seeded
    from ddp_course.model import GPTConfig, MiniGPT

    data = prepare("tinyshakespeare", block_size=32, val_fraction=0.1, announce=lambda *a, **k: None)
    with seeded(0):  # the script's weights, whatever another thread draws meanwhile
        model = MiniGPT(GPTConfig(vocab_size=data.tokenizer.vocab_size, block_size=32, n_layer=1, n_head=2,
                                  n_embd=32)).eval()
    x, y = (torch.stack([data.val[i][j] for i in range(N_WINDOWS)]) for j in (0, 1))
    with torch.no_grad():
        per_token = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
    return per_token.mean(dim=1).double()


def reference_mean() -> float:
    """The mean loss over all the exercise's validation windows: the grader's own answer, not the script's."""
    return reference_losses().mean().item()


# What a wrong global_mean returns on rank r of W, from the windows' losses, and what to tell the learner.
MISTAKES: dict[str, tuple[Callable[[torch.Tensor, int, int], float], str]] = {
    "per-rank means averaged": (
        lambda w, r, n: torch.stack([w[q::n].mean() for q in range(n)]).mean().item(),
        "you averaged the per-rank means, but the ranks hold different numbers of windows (47 does not divide "
        "by the world size): all-reduce the sums and the counts, then divide."),
    "this rank's mean only": (
        lambda w, r, n: w[r::n].mean().item(),
        "each rank returned the mean of its own windows: nothing was combined over the ranks. All-reduce the "
        "sum and the count (every rank must call the collective)."),
    "sum not divided": (
        lambda w, r, n: w.sum().item(),
        "that is the sum of the losses over all windows: divide it by the total count (all-reduced too)."),
    "per-rank means summed": (
        lambda w, r, n: torch.stack([w[q::n].mean() for q in range(n)]).sum().item(),
        "that is the sum of the per-rank means: the all-reduce summed them, and nothing divided the result. "
        "All-reduce the sums and the counts instead."),
    "total over this rank's count": (
        lambda w, r, n: (w.sum() / len(range(r, len(w), n))).item(),
        "you divided the all-reduced sum by this rank's own count: all-reduce the count too."),
    "total over the world size": (
        lambda w, r, n: (w.sum() / n).item(),
        "you divided the all-reduced sum by the world size: divide by the number of windows over all ranks."),
}


def explain(result: float, rank: int, nproc: int, losses: torch.Tensor) -> str:
    """Which classic mistake rank ``rank``'s wrong ``result`` is (nearest, with a margin), or a question."""
    candidates = {name: [fn(losses, rank, nproc)] for name, (fn, _) in MISTAKES.items()}
    candidates["the right answer"] = [losses.mean().item()]
    found = nearest([result], candidates)
    if found.name in MISTAKES and found.clear():
        return f" It looks like {MISTAKES[found.name][1]}"
    return (" It is none of the classic mistakes the grader knows (the mean of per-rank means, a rank's own "
            "mean, a sum not divided by the total count): print each rank's sum and count before and after "
            "the all-reduce.")


def grade(path: str | Path, timeout: float = 180) -> Verdict:
    """global_mean must give every rank the mean over all windows (2 and 3 ranks), the mean this
    grader computes itself."""
    losses = None
    for nproc in (2, 3):
        found = run_exercise(path, nproc, "global_mean()", timeout)
        if isinstance(found, Verdict):
            return found
        losses = reference_losses() if losses is None else losses
        want = losses.mean().item()
        bad = [x for x in found if not abs(x["result"] - want) < TOLERANCE]
        if bad:
            x = bad[0]
            return Verdict(False, f"with {nproc} processes rank {x['rank']} got {x['result']:.6f} but the mean over "
                                  f"all windows is {want:.6f}.{explain(x['result'], x['rank'], nproc, losses)}")
    return Verdict(True, f"every rank gets the mean over all windows ({want:.6f}, computed by the grader in one "
                         f"process, within {TOLERANCE:.0e}), with 2 and with 3 processes.")


@notebook_exercise("causal_attention")
def attention(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Verdict:
    """Notebook 01: a hand-written causal attention must equal F.scaled_dot_product_attention."""
    g = torch.Generator().manual_seed(0)
    for shape in ((2, 4, 8, 16), (1, 2, 5, 8)):
        q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            got = fn(q, k, v)
        except NotImplementedError:
            return not_complete(f"{getattr(fn, '__name__', 'your attention')}()")
        except Exception as exc:  # noqa: BLE001 -- a learner's bug is reported, not raised
            return Verdict(False, f"for inputs of shape {tuple(shape)} your attention raised {type(exc).__name__}: {exc}")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return Verdict(False, f"for inputs of shape {tuple(shape)} expected an output of shape "
                                  f"{tuple(want.shape)}, got {getattr(got, 'shape', type(got).__name__)}.")
        # SDPA and the explicit formula round differently in float32: a few 1e-7 apart on a CPU, well under 1e-5
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
            k_future = fn(q, k.clone().index_fill_(2, torch.tensor([shape[2] - 1]), 0.0), v)
            leak = not torch.allclose(k_future[:, :, :-1], got[:, :, :-1], atol=1e-6)
            hint = (" Position t attends to later positions: mask the scores above the diagonal with -inf."
                    if leak else " Check the 1/sqrt(head size) scaling and the softmax dimension (the last).")
            err = (got - want).abs().max().item()
            return Verdict(False, f"output differs from scaled_dot_product_attention by up to {err:.3g}.{hint}")
    return Verdict(True, "your attention equals F.scaled_dot_product_attention (causal) on two shapes.")
