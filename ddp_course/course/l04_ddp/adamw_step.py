"""How far one AdamW step moves each weight, against the size of its gradient (lesson 04, section 6).

PyTorch's Adam and AdamW update every coordinate by ``lr * m_hat / (sqrt(v_hat) + eps)``
(``torch/optim/adam.py``, ``_single_tensor_adam``: ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
.add_(eps)`` then ``param.addcdiv_(exp_avg, denom, value=-step_size)`` with ``step_size = lr /
bias_correction1``), ``eps = 1e-8`` unless set. At the first step the bias-corrected moments are the
gradient itself (``m_hat = g``, ``v_hat = g**2``), so a coordinate moves by exactly

    lr * |g| / (|g| + eps)

which is about ``lr`` where ``|g|`` is far above ``eps`` and about ``lr * |g| / eps`` where it is far
below. SGD moves the same coordinate by ``lr * |g|``. ``first_step`` takes that step for real on a
model whose ``.grad`` is filled, and ``by_decade`` tabulates it; lesson 04 shows both, and the
lessons after it point back to them. AdamW's weight decay (PyTorch's default 0.01, which lesson 04's
recipe keeps) moves every weight by ``lr * weight_decay * |w|`` more, whatever its gradient:
``first_step`` measures that part separately (``decay``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn

EPS = 1e-8  # torch.optim.AdamW's default, which the course never changes


def first_step(model: nn.Module, lr: float, *, betas: tuple[float, float] = (0.9, 0.999),
               weight_decay: float = 0.0) -> dict[str, Any]:
    """One AdamW step on a copy of ``model``, from the gradients in its ``.grad``, taken twice: with
    ``weight_decay=0`` (the gradient's part of the step alone, ``step``) and with ``weight_decay`` (what
    the decay adds, ``decay``: ``|w_decayed - w_undecayed|``, which is ``lr * weight_decay * |w|`` --
    AdamW shrinks every weight by ``1 - lr * weight_decay`` before its Adam step, ``torch/optim/adam.py``,
    ``_single_tensor_adam``: ``param.mul_(1 - lr * weight_decay)`` -- whatever its gradient). Returns
    every coordinate's ``|g|``, ``|step|``, ``decay`` and ``|w|`` (flat float64 tensors), and for each
    parameter its name and the coordinates' range in those tensors."""
    after = {}
    for wd in (0.0, weight_decay):
        work = copy.deepcopy(model)
        named = [(n, p, q) for (n, p), q in zip(work.named_parameters(), model.parameters()) if q.grad is not None]
        for _, p, q in named:
            p.grad = q.grad.detach().clone()
        opt = torch.optim.AdamW([p for _, p, _ in named], lr=lr, betas=betas, eps=EPS, weight_decay=wd)
        opt.step()
        after[wd] = torch.cat([p.detach().double().flatten() for _, p, _ in named])
    grads, weights, names, start = [], [], [], 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad.detach().double().abs().flatten())
        weights.append(p.detach().double().flatten())
        names.append((name, start, start + p.numel()))
        start += p.numel()
    w = torch.cat(weights)
    return {"lr": lr, "eps": EPS, "weight_decay": weight_decay, "grad": torch.cat(grads),
            "step": (after[0.0] - w).abs(), "decay": (after[weight_decay] - after[0.0]).abs(), "weight": w.abs(),
            "params": names}


def formula(grad: torch.Tensor, lr: float, eps: float = EPS) -> torch.Tensor:
    """AdamW's first step for gradients ``grad``: ``lr * |g| / (|g| + eps)``."""
    return lr * grad / (grad + eps)


def by_decade(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per decade of ``|g|`` that holds coordinates: how many, their median ``|g|``, the median
    step in units of lr measured and by the formula, the median move of the weight decay in units of lr
    and how many coordinates it moves further than their gradient's step, and SGD's step in units of
    lr (``|g|``)."""
    g, step, lr = result["grad"], result["step"], result["lr"]
    rows = []
    nonzero = g > 0
    lo = math.floor(math.log10(g[nonzero].min().item()))
    hi = math.floor(math.log10(g.max().item()))
    for d in range(lo, hi + 1):
        sel = nonzero & (g >= 10.0 ** d) & (g < 10.0 ** (d + 1))
        if not sel.any():
            continue
        gm = g[sel].median().item()
        rows.append({"decade": d, "count": int(sel.sum()), "grad": gm, "step_over_lr": step[sel].median().item() / lr,
                     "formula_over_lr": formula(torch.tensor(gm, dtype=torch.float64), lr).item() / lr,
                     "decay_over_lr": result["decay"][sel].median().item() / lr,
                     "decay_exceeds": int((result["decay"][sel] > step[sel]).sum()), "sgd_over_lr": gm})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`by_decade` as an aligned table (``decay > step``: how many of the row's weights
    the decay moves further than their gradient's step)."""
    lines = [f"{'|g| in':>17} {'weights':>8} {'median |g|':>11} {'AdamW step / lr':>16} {'formula':>9} "
             f"{'decay / lr':>11} {'decay > step':>13} {'SGD step / lr':>14}"]
    for r in rows:
        lines.append(f"[1e{r['decade']:+03d}, 1e{r['decade'] + 1:+03d}) {r['count']:>8,} {r['grad']:>11.1e} "
                     f"{r['step_over_lr']:>16.2e} {r['formula_over_lr']:>9.2e} {r['decay_over_lr']:>11.1e} "
                     f"{r['decay_exceeds']:>13,} {r['sgd_over_lr']:>14.1e}")
    return "\n".join(lines)


def worst_formula_error(result: dict[str, Any]) -> float:
    """The largest ``|measured - formula| / formula`` over the coordinates that moved. The step is taken
    in fp32 (``w - step`` rounds at about 6e-8 of ``|w|``) and the formula is float64, so what is left
    is rounding: largest where the step is small next to the weight it is subtracted from."""
    g, step, lr = result["grad"], result["step"], result["lr"]
    want = formula(g, lr)
    moved = want > 0
    return ((step[moved] - want[moved]).abs() / want[moved]).max().item()


def rows_of(result: dict[str, Any], suffix: str, part: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|g|, |step|)`` of the parameters whose name ends with ``suffix`` (``part`` of each, e.g. the
    key third of ``attn.qkv.bias``), concatenated."""
    g = [result["grad"][a:b][part] for name, a, b in result["params"] if name.endswith(suffix)]
    s = [result["step"][a:b][part] for name, a, b in result["params"] if name.endswith(suffix)]
    return torch.cat(g), torch.cat(s)
