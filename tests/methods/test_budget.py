"""The budget optimiser against hand-computed cases and against trying every combination."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fewbits.methods.budget import BudgetError, Choice, choose


def brute_force(costs: np.ndarray, sens: np.ndarray, budget: float) -> Choice | None:
    best: Choice | None = None
    for picks in itertools.product(range(costs.shape[1]), repeat=costs.shape[0]):
        cost = float(sum(costs[i, j] for i, j in enumerate(picks)))
        if cost > budget:
            continue
        val = float(sum(sens[i, j] for i, j in enumerate(picks)))
        if best is None or val < best.sensitivity:
            best = Choice(tuple(picks), cost, val)
    return best


def test_hand_computed_two_layers() -> None:
    # layer 0: 3 bits costs 3, error 9; 4 bits costs 4, error 4; 8 bits costs 8, error 0
    # layer 1: the same costs, errors 1, 0.5, 0 (much less sensitive)
    costs = [[3, 4, 8], [3, 4, 8]]
    sens = [[9, 4, 0], [1, 0.5, 0]]
    # budget 8: 8 + 3 = 11 does not fit; 4 + 4 gives 4.5, 3 + 4 gives 9.5, 4 + 3 gives 5: so (1, 1)
    assert choose(costs, sens, 8).picks == (1, 1)
    # budget 11: the sensitive layer in 8 bits, the other in 3: 0 + 1 = 1 beats 4 + 4 (4.5); 4 + 8 = 12 > 11
    r = choose(costs, sens, 11)
    assert r.picks == (2, 0) and r.cost == 11 and r.sensitivity == 1
    # budget 7: 4 + 3 with the bits on the sensitive layer (4 + 1 = 5) beats 3 + 4 (9 + 0.5)
    assert choose(costs, sens, 7).picks == (1, 0)
    # exactly the cheapest choice
    assert choose(costs, sens, 6).picks == (0, 0)


def test_budget_below_cheapest_is_refused() -> None:
    with pytest.raises(BudgetError, match="below the cheapest choice"):
        choose([[3, 4], [3, 4]], [[1, 0], [1, 0]], 5.5)


def test_bad_shapes_and_values_are_refused() -> None:
    with pytest.raises(BudgetError, match="same"):
        choose([[1, 2]], [[1, 2, 3]], 10)
    with pytest.raises(BudgetError, match="finite"):
        choose([[1, float("nan")]], [[1, 2]], 10)
    with pytest.raises(BudgetError, match="negative"):
        choose([[-1, 2]], [[1, 2]], 10)


@pytest.mark.parametrize("seed", range(30))
def test_integer_costs_match_brute_force_exactly(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 7)), int(rng.integers(1, 5))
    costs = rng.integers(1, 20, size=(n, k)).astype(float)
    sens = rng.random((n, k))
    budget = float(rng.integers(int(costs.min(1).sum()), int(costs.max(1).sum()) + 2))
    r = choose(costs, sens, budget)
    ref = brute_force(costs, sens, budget)
    assert ref is not None
    assert r.cost <= budget
    assert r.sensitivity == pytest.approx(ref.sensitivity, abs=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_float_costs_feasible_and_at_least_as_good_as_optimum_of_slightly_smaller_budget(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n, k = int(rng.integers(2, 7)), int(rng.integers(2, 5))
    costs = rng.random((n, k)) * 1e6  # bytes, not integers in any unit the programme uses
    sens = rng.random((n, k))
    lo, hi = costs.min(1).sum(), costs.max(1).sum()
    budget = float(lo + rng.random() * (hi - lo))
    resolution = 50  # coarse, so the rounding matters
    r = choose(costs, sens, budget, resolution=resolution)
    assert r.cost <= budget + 1e-6
    unit = (budget - lo) / resolution
    smaller = brute_force(costs, sens, budget - n * unit)
    if smaller is not None:
        assert r.sensitivity <= smaller.sensitivity + 1e-12
    full = brute_force(costs, sens, budget)
    assert r.sensitivity >= full.sensitivity - 1e-12  # never better than the true optimum


def test_fine_resolution_finds_the_optimum_on_float_costs() -> None:
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(20):
        costs = rng.random((5, 3)) * 1e3
        sens = rng.random((5, 3))
        budget = float(costs.min(1).sum() + 0.5 * (costs.max(1).sum() - costs.min(1).sum()))
        hits += choose(costs, sens, budget).sensitivity == pytest.approx(brute_force(costs, sens, budget).sensitivity)
    assert hits == 20
