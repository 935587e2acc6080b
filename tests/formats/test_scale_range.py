"""Scales that the scale dtype cannot hold are refused, naming the tensor and suggesting -sfp32.

References: IEEE binary16 (fp16) holds at most 65504 and rounds values from 65520 up to inf; its smallest
positive (subnormal) value is 2^-24 ~ 5.96e-8, and values below 2^-25 round to 0.  bf16 shares fp32's
exponent range (largest ~3.39e38).  A symmetric b-bit integer scale is max|w| / (2^(b-1) - 1); NF4's is max|w|.
"""

from __future__ import annotations

import pytest
import torch

from fewbits.formats.quant import ScaleRangeError, compute_scales
from fewbits.methods.gptq import gptq_quantize
from fewbits.methods.hqq import hqq_quantize
from fewbits.methods.rtn import rtn_quantize
from fewbits.tensor import quantize_tensor


def _row(value: float, n: int = 64) -> torch.Tensor:
    w = torch.randn(2, n, generator=torch.Generator().manual_seed(0)) * 0.02
    w[1].fill_(value)
    return w


@pytest.mark.parametrize(("amax", "spec", "ok"), [
    (7 * 65504.0, "int4-g64-narrow", True),   # scale exactly fp16's largest value (absmax / 7)
    (7 * 65520.0, "int4-g64-narrow", False),  # rounds to inf in fp16
    (8 * 65504.0, "int4-g64", True),      # the full grid: scale = extreme / -8, fp16's largest magnitude
    (8 * 65520.0, "int4-g64", False),
    (65504.0, "nf4-g64", True),
    (7e4, "nf4-g64", False),
    (1e6, "int4-g64", False),
    (1e6, "int4-g64-sfp32", True),
    (1e6, "int4-g64-sbf16", True),
    (127 * 2.0**-24, "int8-narrow", True),  # scale = fp16's smallest subnormal
    (128 * 2.0**-24, "int8", True),
    (1e-9, "int8", False),                # full grid: a negative scale underflows as well
    (1e-9, "int4-g64", False),            # scale 1.4e-10 rounds to 0
    (1e-9, "int4-g64-sfp32", True),
    (1e-9, "int4-g64-asym", False),
])
def test_fp16_scale_limits(amax: float, spec: str, ok: bool) -> None:
    w = _row(amax)
    if ok:
        q = quantize_tensor(w, spec, name="blk.lin")
        assert torch.isfinite(q.scale_values()).all() and (q.scale_values() != 0).all()
        assert torch.allclose(q.dequantize()[1], w[1], rtol=1e-2)
    else:
        with pytest.raises(ScaleRangeError, match=r"^blk\.lin: .*(overflow|underflow).*-sfp32"):
            quantize_tensor(w, spec, name="blk.lin")


def test_all_zero_group_is_not_an_underflow() -> None:
    w = torch.zeros(2, 64)
    scale, _ = compute_scales(w, "int4-g32")
    assert torch.equal(scale, torch.ones(2, 2))  # the all-zero convention, no error


def test_bf16_scales_take_1e38_fp16_do_not() -> None:
    w = _row(1e38)
    with pytest.raises(ScaleRangeError, match="overflow fp16"):
        quantize_tensor(w, "int8")
    assert torch.isfinite(quantize_tensor(w, "int8-sbf16").dequantize()).all()


def test_every_method_names_the_tensor() -> None:
    w = _row(1e6)
    h = torch.eye(64)
    for quantise in (lambda: rtn_quantize(w, "int4-g32", name="L7"),
                     lambda: hqq_quantize(w, "int4-g32", name="L7"),
                     lambda: gptq_quantize(w, h, "int4-g32", name="L7", act_order=False),
                     lambda: gptq_quantize(w, h, "int4-g32", name="L7", act_order=True)):
        with pytest.raises(ScaleRangeError, match=r"^L7: .*overflow fp16.*-sfp32"):
            quantise()
