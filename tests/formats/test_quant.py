"""The numeric core's helpers that are not a format: the finiteness screen."""

from __future__ import annotations

import torch


def test_all_finite_sees_every_nan_and_inf() -> None:
    from fewbits.formats.quant import all_finite

    x = torch.randn(37, 53)
    assert all_finite(x) and all_finite(x.bfloat16()) and all_finite(torch.zeros(0, 4))
    assert all_finite(torch.arange(10))  # integers are always finite
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (17, 29), (36, 52)):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (bad, where)
            assert not all_finite(y.bfloat16()), (bad, where)
