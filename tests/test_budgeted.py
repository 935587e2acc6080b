"""Budgeted mixes end to end on a tiny model: the budget is kept, the recipe quantises, errors are clear."""

from __future__ import annotations

import pytest
import torch

from fewbits import api
from fewbits.budgeted import Budget, budget_recipe
from fewbits.calib.sensitivity import Sensitivity, measure
from fewbits.methods.budget import BudgetError

CANDS = ["int3-g64", "int4-g64", "int8"]


@pytest.fixture
def calib() -> torch.Tensor:
    return torch.randint(0, 320, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize(("text", "kind", "value"), [
    ("bpw=4.25", "bpw", 4.25), ("size=1.2GB", "size", 1.2e9), ("size=900 MiB", "size", 900 * 2**20),
    ("size=123456", "size", 123456), ("step-ms=8.5", "step-ms", 8.5), (" BPW = 3 ", "bpw", 3.0)])
def test_budget_spellings(text: str, kind: str, value: float) -> None:
    b = Budget.parse(text)
    assert (b.kind, b.value) == (kind, pytest.approx(value))


@pytest.mark.parametrize(("text", "why"), [
    ("4.25", "write bpw="), ("bits=4", "write bpw="), ("bpw=x", "not a number"), ("size=3TB", "a size is"),
    ("bpw=-1", "positive"), ("step-ms=inf", "positive")])
def test_bad_budgets_are_named(text: str, why: str) -> None:
    with pytest.raises(BudgetError, match=why):
        Budget.parse(text)


def test_bpw_budget_is_kept_and_the_recipe_quantises_to_it(tiny_llama, calib) -> None:
    sens = measure(tiny_llama, calib, [n for n, m in tiny_llama.named_modules()
                                       if isinstance(m, torch.nn.Linear) and n != "lm_head"], CANDS, "rtn")
    plans = {b: budget_recipe(tiny_llama, calib, f"bpw={b}", CANDS, "rtn", sensitivity=sens) for b in (3.25, 4.5, 8.25)}
    for b, mix in plans.items():
        assert mix.bits_per_weight <= b
    assert set(plans[3.25].formats.values()) == {"int3-g64"}  # int3-g64 is exactly 3.25 bits: no room for more
    assert set(plans[8.25].formats.values()) == {"int8"}  # per-channel int8 is 8 + 16/64 or less: all fit
    assert plans[3.25].proxy_kl > plans[4.5].proxy_kl > plans[8.25].proxy_kl
    assert len(set(plans[4.5].formats.values())) > 1  # a real mix
    # the bytes the optimiser counted are the bytes quantisation stores
    mix = plans[4.5]
    report = api.quantize(tiny_llama, mix.recipe, calib, progress=False, chooser="reference")
    assert report.bits_per_weight == pytest.approx(mix.bits_per_weight, rel=1e-12)
    assert {r["name"]: r["format"] for r in report.quantized_layers} == mix.formats


def test_size_and_step_budgets(tiny_llama, calib) -> None:
    base = budget_recipe(tiny_llama, calib, "bpw=4.25", CANDS, "rtn", device="h100")
    assert base.step_s is not None and base.uniform["int4-g64"]["step_s"] > 0
    S = Sensitivity.from_dict(base.sensitivity)  # the measurement again, as budget.json keeps it
    size = budget_recipe(tiny_llama, calib, f"size={base.model_bytes}", CANDS, "rtn", sensitivity=S)
    assert size.model_bytes <= base.model_bytes
    t = base.uniform["int4-g64"]["step_s"]
    step = budget_recipe(tiny_llama, calib, f"step-ms={1e3 * t}", CANDS, "rtn", device="h100", sensitivity=S)
    assert step.step_s <= t * (1 + 1e-12)
    with pytest.raises(BudgetError, match="needs the device"):
        budget_recipe(tiny_llama, calib, "step-ms=1", CANDS, "rtn", sensitivity=S)
    with pytest.raises(BudgetError, match="below the cheapest"):
        budget_recipe(tiny_llama, calib, "bpw=3", CANDS, "rtn", sensitivity=S)
    with pytest.raises(BudgetError, match="does not fit"):
        budget_recipe(tiny_llama, calib, "bpw=4", ["int4-g256"], "rtn", sensitivity=S)
