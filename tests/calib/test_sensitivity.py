"""The KL proxy against the truth it stands for: the model's KL when only one layer changes format."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fewbits.calib.sensitivity import Sensitivity, check_budget_method, layer_kl, measure, reference_logprobs
from fewbits.calib.stats import CalibrationError
from fewbits.methods.common import MethodError


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties among measured KLs): the Pearson correlation of the ranks."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def _linears(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_proxy_tracks_true_single_layer_kl(tiny, method: str) -> None:
    model = tiny("llama", seed=3)
    data = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(5))
    names = _linears(model)
    sens = measure(model, data, names, ["int3-g64", "int4-g64"], method, keep=names)
    ref = reference_logprobs(model, data)
    proxy, true = [], []
    for n in names:
        for f in ("int3-g64", "int4-g64"):
            proxy.append(sens.kl[n][f])
            true.append(layer_kl(model, n, sens.w_hat[(n, f)], data, ref))
    ratio = np.array(proxy) / np.array(true)
    # second order in the error and unbiased on average: the proxy is the KL, not merely ordered like it
    assert 0.5 < float(np.median(ratio)) < 2.0, ratio
    assert spearman(proxy, true) > 0.8
    # int3 hurts more than int4 on every layer, in the proxy as in the truth
    assert all(sens.kl[n]["int3-g64"] > sens.kl[n]["int4-g64"] for n in names)


def test_measure_leaves_the_model_as_it_was(tiny, calib_ids) -> None:
    model = tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    measure(model, calib_ids, _linears(model)[:3], ["int4-g64"], "rtn")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())


def test_layer_kl_restores_the_weight_and_is_zero_for_the_same_weight(tiny, calib_ids) -> None:
    model = tiny("llama")
    n = _linears(model)[0]
    w = model.get_submodule(n).weight.detach().clone()
    ref = reference_logprobs(model, calib_ids[:2])
    assert layer_kl(model, n, w, calib_ids[:2], ref) == pytest.approx(0.0, abs=1e-9)
    assert layer_kl(model, n, w + 0.05, calib_ids[:2], ref) > 0
    assert torch.equal(model.get_submodule(n).weight, w)


def test_methods_and_formats_are_checked_before_any_work() -> None:
    with pytest.raises(CalibrationError, match="--budget works with methods"):
        check_budget_method("smoothquant", ["int8"])
    with pytest.raises(MethodError, match="gptq"):
        check_budget_method("gptq", ["nf4-g64"])
    assert check_budget_method("awq+gptq", ["int4-g64"]) == "gptq"


def test_budget_refuses_torchrun(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # each rank would see its share of the per-token weights
    with pytest.raises(CalibrationError, match="one process"):
        check_budget_method("gptq", ["int4-g64"])


def test_layers_outside_the_blocks_are_refused(tiny, calib_ids) -> None:
    model = tiny("llama")
    with pytest.raises(CalibrationError, match="outside"):
        measure(model, calib_ids, ["lm_head"], ["int8"], "rtn")


def test_truth_rescales_each_layer_by_its_single_layer_kl(tiny) -> None:
    model = tiny("llama", seed=3).double()  # float64: the single-layer KLs of a tiny random model are small
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked next-token distributions, as a trained model's
    data = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(5))
    names = _linears(model)
    sens = measure(model, data, names, ["int3-g64", "int4-g64"], "gptq", keep=names, truth_windows=4)
    ref4, ref = reference_logprobs(model, data[:4]), reference_logprobs(model, data)
    scaled_err = []
    for n in names:
        ((fmt, true),) = sens.truth[n].items()
        assert fmt == "int3-g64"  # the candidate the proxy finds most damaging: the loudest signal
        assert true == pytest.approx(layer_kl(model, n, sens.w_hat[(n, fmt)], data[:4], ref4), rel=1e-6)
        assert sens.effective(n, fmt) == pytest.approx(true)
        # one factor per layer: the candidates keep the proxy's proportions
        assert sens.effective(n, "int4-g64") / true == pytest.approx(sens.kl[n]["int4-g64"] / sens.kl[n][fmt])
        # the other format's truth (all the data) predicted by the rescaled proxy within 1.5x on every layer
        t4 = layer_kl(model, n, sens.w_hat[(n, "int4-g64")], data, ref)
        scaled_err.append(abs(np.log(sens.effective(n, "int4-g64") / t4)))
    assert max(scaled_err) < np.log(1.5), scaled_err
    back = Sensitivity.from_dict(json.loads(json.dumps(sens.to_dict())))
    assert all(back.effective(n, "int4-g64") == sens.effective(n, "int4-g64") for n in names)
    assert Sensitivity(names, ["int4-g64"], {n: {"int4-g64": 1.0} for n in names}).effective(names[0], "int4-g64") == 1
