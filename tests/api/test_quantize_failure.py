"""A failed or interrupted `api.quantize` never leaves the model silently wrong: every check that can fail
runs over all layers before the first swap (the model is left exactly as it was), and a failure after
that (an error half-way, Ctrl-C) says the model is unusable, makes its forward and saving refuse, and
undoes the block runner's replay patches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fewbits import api
from fewbits.calib import pipeline
from fewbits.calib.runner import iterate_blocks
from fewbits.formats.quant import ScaleRangeError
from fewbits.models.qlinear import QuantLinear

LAST = "model.layers.1.mlp.down_proj"  # the last planned linear of the tiny model (the head stays 16-bit)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = dict(model.named_parameters())
    return (not any(isinstance(m, QuantLinear) for m in model.modules()) and now.keys() == before.keys()
            and all(torch.allclose(now[n], before[n], rtol=0, atol=0, equal_nan=True) for n in before))


def _patched(model: nn.Module) -> list[str]:
    """Modules whose forward is replaced by an instance attribute (the block runner's replay/freeze)."""
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def _calib() -> torch.Tensor:
    return torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", ["rtn", "hqq", "gptq", "awq"])
def test_nan_in_the_last_layer_changes_nothing(tiny_factory, method: str) -> None:
    model = tiny_factory()
    with torch.no_grad():
        model.get_submodule(LAST).weight[3, 5] = float("nan")
    before = _snapshot(model)
    spec = "int4-g32"
    with pytest.raises(api.QuantizeError, match=rf"{LAST}: weight of shape \(64, 96\) has 1 NaN"):
        api.quantize(model, api.Recipe.from_format(spec, method), _calib(), progress=False)
    assert _unchanged(model, before)


@pytest.mark.parametrize(("value", "spec", "what"), [(1e6, "int4-g32", "overflow fp16"),
                                                     (7e4, "nf4-g32", "overflow fp16"),
                                                     (1e38, "int8", "overflow fp16"),
                                                     (1e-9, "int4-g32", "underflow to 0 in fp16")])
def test_scales_out_of_range_refused_before_any_swap(tiny_factory, value: float, spec: str, what: str) -> None:
    model = tiny_factory()
    with torch.no_grad():
        model.get_submodule(LAST).weight[0].fill_(value)
    before = _snapshot(model)
    with pytest.raises(ScaleRangeError, match=rf"{LAST}: .*{what}.*-sfp32"):
        api.quantize(model, spec, progress=False)
    assert _unchanged(model, before)
    wide = spec.replace("int4-g32", "int4-g32-sfp32").replace("nf4-g32", "nf4-g32-sfp32").replace(
        "int8", "int8-sfp32")
    api.quantize(model, wide, progress=False, chooser="reference")  # the suggested format takes them
    w = model.get_submodule(LAST).qweight.dequantize()[0]
    assert torch.allclose(w, torch.full_like(w, value), rtol=1e-3)


def test_ctrl_c_in_rtn_makes_the_model_refuse_to_run_and_save(tiny_factory, monkeypatch, tmp_path) -> None:
    model = tiny_factory()
    real = api.quantize_tensor
    calls = []

    def interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(api, "quantize_tensor", interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        api.quantize(model, "int8", progress=False)
    assert "2 of 14 layers swapped" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="unusable: quantize stopped in method rtn after 2 of 14"):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(api.QuantizeError, match="cannot save: the model is unusable"):
        api.save_quantized_model(model, api.Recipe.from_format("int8"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stop", [RuntimeError("boom"), KeyboardInterrupt()])
def test_gptq_stopped_mid_block_restores_every_patch(tiny_factory, monkeypatch, stop: BaseException) -> None:
    """The third GPTQ group of block 0 (gate/up) runs while attention is replayed and its norm frozen;
    stopping there leaves no patched forward behind, and the model says it is unusable."""
    model = tiny_factory()
    real = pipeline.gptq_quantize
    seen: list[list[str]] = []

    def failing(*a, **k):
        seen.append(_patched(model))
        if len(seen) == 3:
            raise stop
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "gptq_quantize", failing)
    with pytest.raises(type(stop)) as info:
        api.quantize(model, api.Recipe.from_format("int4-g32", "gptq"), _calib(), progress=False)
    assert "model.layers.0.self_attn" in seen[2]  # the patches were really there when it stopped
    assert _patched(model) == []
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "unusable" in text
    with pytest.raises(RuntimeError, match="unusable"):
        model(torch.tensor([[1, 2, 3]]))


def test_runner_restores_patches_when_the_caller_breaks_off(tiny_factory) -> None:
    from contextlib import closing

    model = tiny_factory()
    with pytest.raises(ValueError, match="stop"), closing(iterate_blocks(model, _calib())) as runs:
        for run in runs:
            run.freeze("input_layernorm")
            assert _patched(model) == ["model.layers.0.input_layernorm"]
            raise ValueError("stop")
    assert _patched(model) == []


def test_gptq_nan_names_the_real_layer_not_the_fused_shape(tiny_factory) -> None:
    model = tiny_factory()
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[0, 0] = float("inf")
    plans = api.Recipe.from_format("int4-g32", "gptq").plan(api.linear_shapes(model))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj: weight of shape \(32, 64\)"):
        pipeline.run_gptq(model, [p for p in plans if p.action == "quantize"], _calib(), lambda n, q: None, False)
