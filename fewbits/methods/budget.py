"""One format per layer under a budget: the multiple-choice knapsack behind `fewbits quantize --budget`.

Every layer i has candidate formats j, each with a cost c_ij (bytes, or predicted seconds of a decode
step) and a sensitivity s_ij (the damage of storing that layer in that format, e.g. its share of the
model's KL).  Sensitivities of different layers are taken to add (true to second order when the layers'
errors are independent), so the best mix solves

    minimise  sum_i s_i,j(i)   subject to   sum_i c_i,j(i) <= B,   one j(i) per layer

(the multiple-choice knapsack; exllamav2 and llama.cpp's target-bpw search solve the same problem with
measured or imatrix-weighted errors).  `choose` solves it exactly by dynamic programming over a
discretised budget: every layer first takes its cheapest candidate; the extra cost of the others is
counted in units of u = (B - sum_i min_j c_ij) / resolution, rounded up, so any pick the program
finds stays within B in the exact costs.  A pick whose exact extra cost is at most B' - n u (n layers)
is always within reach, so the result is at least as good as the true optimum at that slightly smaller
budget; with integer costs and a spare budget of at most `resolution`, u = 1 and the result is the
exact optimum.  Pure numpy; no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: budget units of the dynamic programme (time and memory grow linearly; n layers lose at most n units)
RESOLUTION = 20_000


class BudgetError(ValueError):
    """A budget no choice of candidates meets, or costs/sensitivities that cannot be optimised."""


@dataclass(frozen=True)
class Choice:
    """The pick: candidate index per layer, its total cost and total sensitivity."""

    picks: tuple[int, ...]
    cost: float
    sensitivity: float


def _check(costs: np.ndarray, sens: np.ndarray) -> None:
    if costs.ndim != 2 or costs.shape != sens.shape or costs.shape[0] == 0 or costs.shape[1] == 0:
        raise BudgetError(f"costs {costs.shape} and sensitivities {sens.shape} must be the same (layers, "
                          "candidates) shape with at least one of each")
    if not (np.isfinite(costs).all() and np.isfinite(sens).all()):
        raise BudgetError("costs and sensitivities must be finite numbers")
    if (costs < 0).any():
        raise BudgetError("costs must not be negative")


def choose(costs: Sequence[Sequence[float]] | np.ndarray, sensitivities: Sequence[Sequence[float]] | np.ndarray,
           budget: float, resolution: int = RESOLUTION) -> Choice:
    """The candidate per layer (rows) minimising the summed sensitivity with summed cost <= `budget`.

    costs, sensitivities: (layers, candidates).  Raises BudgetError naming the least reachable cost
    when even the cheapest candidate of every layer exceeds the budget."""
    c = np.asarray(costs, dtype=np.float64)
    s = np.asarray(sensitivities, dtype=np.float64)
    _check(c, s)
    if resolution < 1:
        raise BudgetError(f"resolution must be a positive number of units, got {resolution}")
    n = c.shape[0]
    base = c.min(axis=1)
    spare = float(budget) - float(base.sum())
    if spare < -1e-9 * max(1.0, abs(float(budget))):
        raise BudgetError(f"budget {budget:.6g} is below the cheapest choice ({base.sum():.6g}: every layer in "
                          "its cheapest candidate)")
    spare = max(spare, 0.0)
    extra = c - base[:, None]
    integral = bool(np.all(extra == np.round(extra)))
    if integral and spare <= resolution:
        unit, cap = 1.0, int(math.floor(spare + 1e-9))
    else:
        unit, cap = (spare / resolution if spare > 0 else 1.0), (resolution if spare > 0 else 0)
    w = np.ceil(extra / unit - 1e-12).astype(np.int64) if spare > 0 else np.where(extra > 0, cap + 1, 0)
    w = np.maximum(w, 0)
    # best[b]: least summed sensitivity of the layers so far using at most b units of extra cost
    best = np.zeros(cap + 1)
    arg = np.empty((n, cap + 1), dtype=np.int32)  # the candidate layer i takes at each budget
    for i in range(n):
        nxt = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int32)
        for j in range(c.shape[1]):
            if w[i, j] > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w[i, j]:] = best[: cap + 1 - w[i, j]] + s[i, j]
            better = cand < nxt
            nxt[better] = cand[better]
            pick[better] = j
        best = nxt
        arg[i] = pick
    b = cap
    picks = [0] * n
    for i in range(n - 1, -1, -1):  # walk back from the full budget
        j = int(arg[i, b])
        picks[i] = j
        b -= int(w[i, j])
    rows = np.arange(n)
    sel = np.asarray(picks)
    return Choice(tuple(picks), float(c[rows, sel].sum()), float(s[rows, sel].sum()))

