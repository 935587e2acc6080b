"""HQQ: the shrinkage operator, and lower error than round-to-nearest on heavy-tailed weights."""

from __future__ import annotations

import pytest
import torch

from fewbits.methods.hqq import hqq_quantize, shrink_lp
from fewbits.methods.rtn import rtn_quantize


def test_shrink_operator_by_hand() -> None:
    # |x| - |x|^(p-1)/beta with p = 0.5, beta = 2: x = 4 -> 4 - 0.5/2 = 3.75; x = 0.01 -> 0 (thresholded)
    x = torch.tensor([4.0, -4.0, 0.01, 0.0])
    assert torch.allclose(shrink_lp(x, 2.0, 0.5), torch.tensor([3.75, -3.75, 0.0, 0.0]))


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int3-g64-asym", "int2-g32-asym", "int3-g64", "int4-g64",
                                  "int3-g64-narrow"])
def test_hqq_beats_rtn_on_heavy_tailed_weights(spec: str) -> None:
    torch.manual_seed(0)
    w = torch.distributions.StudentT(4.0).sample((128, 256)) * 0.02
    rtn = float((rtn_quantize(w, spec).dequantize() - w).norm())
    res = hqq_quantize(w, spec)
    hqq = float((res.dequantize() - w).norm())
    assert hqq < 0.99 * rtn, (spec, hqq, rtn)
    assert torch.equal(res.to_tensor().dequantize(), res.dequantize())  # integer zero points, stored exactly
    if res.zero is not None:
        assert torch.equal(res.zero, res.zero.round())
    elif "narrow" not in spec:  # the full grid: refitted scales keep the sign that puts the extreme on -2^(b-1)
        assert bool((res.scale < 0).any()) and bool((res.scale > 0).any()) and int(res.codes.min()) == 0


def _lp(e: torch.Tensor, p: float) -> float:
    return float(e.abs().pow(p).mean())


@pytest.mark.parametrize("spec", ["int4-g64-asym-zfp16", "int3-g64-asym-zfp16", "int2-g64-asym-zfp16"])
def test_hqq_float_zeros_lower_lp_and_l1_error_than_rtn_on_heavy_tailed_weights(spec: str) -> None:
    torch.manual_seed(1)
    w = torch.distributions.StudentT(3.0).sample((128, 256)) * 0.02
    e_rtn = rtn_quantize(w, spec).dequantize() - w
    res = hqq_quantize(w, spec)
    e_hqq = res.dequantize() - w
    assert _lp(e_hqq, 0.7) < 0.99 * _lp(e_rtn, 0.7), spec
    assert _lp(e_hqq, 1.0) < 0.99 * _lp(e_rtn, 1.0), spec
    # the optimised zero points are floats, stored exactly in fp16; the scale is the min-max one
    assert torch.equal(res.zero, res.zero.half().float()) and not torch.equal(res.zero, res.zero.round())
    assert torch.equal(res.scale, rtn_quantize(w, spec).scale)
    assert torch.equal(res.to_tensor().dequantize(), res.dequantize())


@pytest.fixture(scope="module")
def smol_weights(smollm2_dir) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    names = ("model.layers.5.self_attn.q_proj.weight", "model.layers.5.mlp.down_proj.weight")
    with safe_open(str(next(smollm2_dir.glob("*.safetensors"))), framework="pt") as f:
        return {n: f.get_tensor(n).float() for n in names}


@pytest.mark.parametrize("spec", ["int4-g64-asym-zfp16", "int3-g64-asym-zfp16", "int2-g64-asym-zfp16",
                                  "int4-g64-asym", "int3-g64-asym", "int2-g64-asym"])
def test_hqq_lower_weight_error_than_rtn_on_smollm2(smol_weights, spec: str) -> None:
    for name, w in smol_weights.items():
        e_rtn = rtn_quantize(w, spec).to_tensor().dequantize() - w
        e_hqq = hqq_quantize(w, spec, name=name).to_tensor().dequantize() - w
        assert _lp(e_hqq, 0.7) < _lp(e_rtn, 0.7), (name, spec)
        assert _lp(e_hqq, 1.0) < 0.99 * _lp(e_rtn, 1.0), (name, spec)
        if not spec.endswith("zfp16"):  # integer zeros: the final least-squares scale also lowers the l_2 error
            assert _lp(e_hqq, 2.0) < 0.97 * _lp(e_rtn, 2.0), (name, spec)


def test_gptq_refuses_float_zeros_and_names_the_fix() -> None:
    from fewbits.methods.common import MethodError, check_method_format

    for method in ("gptq", "awq+gptq"):
        with pytest.raises(MethodError, match=r"int4-g64-asym-zfp16.*use int4-g64-asym"):
            check_method_format(method, "int4-g64-asym-zfp16")
    for method in ("rtn", "hqq", "awq"):
        assert check_method_format(method, "int4-g64-asym-zfp16").float_zeros
