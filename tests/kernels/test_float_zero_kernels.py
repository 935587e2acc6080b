"""CPU fast paths for integer codes with floating zero points (`-zfp16` formats) against the reference path.

The int4 operator's (scale, offset) table holds any float zero point; for <= 3-bit codes the kernel shifts
the codes by round(z) so the table only carries the fractional part (a truncated shift would be off by a
fraction of a step, i.e. a relative error of several percent, far above the bound below).
"""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels import prepare_linear, reference_linear
from fewbits.kernels.cpu import Int4PackKernel, Int8PackKernel
from fewbits.kernels.cpu_int4 import Q4Kernel
from fewbits.kernels.cpu_rows import Int8RowsKernel
from fewbits.tensor import quantize_tensor

BOUND = 1e-2  # as for the integer-zero formats (bf16 activations, scales and output)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize(("spec", "kernel"), [
    ("int4-g64-asym-zfp16", Int4PackKernel), ("int3-g64-asym-zfp16", Int4PackKernel),
    ("int2-g32-asym-zfp16", Int4PackKernel), ("int3-asym-zbf16", Int4PackKernel),
    ("int4-t-asym-zfp32", Int4PackKernel), ("int8-asym-zfp16", Int8PackKernel),
])
def test_float_zero_fast_path_matches_reference(spec: str, kernel: type) -> None:
    g = torch.Generator().manual_seed(7)
    # rows shifted away from 0 so that zero points are far from integers and from the middle code
    w = torch.randn(64, 256, generator=g) * 0.05 + torch.rand(64, 1, generator=g) * 0.04
    x = torch.randn(5, 256, generator=g)
    qt = quantize_tensor(w, spec)
    assert qt.zeros is not None and not torch.equal(qt.zero_values(), qt.zero_values().round())
    kern = prepare_linear(qt)
    if kernel is Int4PackKernel:  # fewbits' own operator where it can run, and torch's as well
        assert kern.name in (Q4Kernel.name, Int4PackKernel.name), kern.reason
        assert _rel(Int4PackKernel(qt)(x), reference_linear(x, qt)) < BOUND
    elif kernel is Int8PackKernel:  # the few-row int8 operator where it is built (a subclass), else torch's
        assert kern.name in (Int8RowsKernel.name, Int8PackKernel.name), kern.reason
        assert _rel(Int8PackKernel(qt)(x), reference_linear(x, qt)) < BOUND
    else:
        assert kern.name == kernel.name, kern.reason
    assert _rel(kern(x), reference_linear(x, qt)) < BOUND
