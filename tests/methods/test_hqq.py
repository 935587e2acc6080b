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


@pytest.mark.parametrize("spec", ["int4-g64-asym", "int3-g64-asym", "int2-g32-asym", "int3-g64"])
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
