"""GPU fast paths against the reference path (run only where CUDA is present).

Bounds: Triton weight-only (bf16 activations and tile products, fp32 accumulation): 1e-2 relative;
FP8 W8A8 via _scaled_mm (E4M3 activations, 3 mantissa bits): 6e-2 relative.
"""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels import prepare_linear, reference_linear
from fewbits.tensor import quantize_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("spec", ["int8", "int8-asym", "int4-g128", "int4-g64-asym", "int3-g64", "int2-g32-asym",
                                  "fp8-e4m3", "int4-g64-asym-zfp16", "int3-g64-asym-zfp16"])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_triton_weight_only_matches_reference(spec, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(320, 384, generator=g)
    qt = quantize_tensor(w, spec)
    x = torch.randn(m, 384, generator=g)
    kern = prepare_linear(qt, device="cuda")
    assert kern.name == "cuda_triton_weight_only", kern.reason
    y = kern(x.cuda().bfloat16()).float().cpu()
    assert rel_err(y, reference_linear(x, qt)) < 1e-2


@pytest.mark.parametrize("spec", ["int8", "int4-g128", "int4-g64-asym", "int3-g64", "int4", "fp8-e4m3",
                                  "fp8-e4m3-g64"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_one_row_kernel_matches_reference(spec, m):
    # decode rows run `_wq_gemv`: products and sums in fp32, so activations given in bf16 meet the reference to
    # the order of the sums
    from fewbits.kernels.gpu import GemvTiles

    g = torch.Generator().manual_seed(m)
    qt = quantize_tensor(torch.randn(1000, 1536, generator=g), spec)
    x = torch.randn(m, 1536, generator=g).bfloat16()
    kern = prepare_linear(qt, device="cuda")
    assert kern.name == "cuda_triton_weight_only", kern.reason
    y = kern(x.cuda().float()).cpu()
    assert isinstance(kern._tiles[m], GemvTiles)
    assert rel_err(y, reference_linear(x.float(), qt)) < 1e-5


@pytest.mark.parametrize("m", [1, 33])
def test_fp8_scaled_mm_matches_reference(m):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability >= 8.9")
    g = torch.Generator().manual_seed(m)
    qt = quantize_tensor(torch.randn(256, 512, generator=g), "fp8-e4m3")
    x = torch.randn(m, 512, generator=g)
    kern = prepare_linear(qt, device="cuda", activations="fp8")
    assert kern.name == "cuda_fp8_scaled_mm", kern.reason
    y = kern(x.cuda().bfloat16()).float().cpu()
    assert rel_err(y, reference_linear(x, qt)) < 6e-2


@pytest.mark.parametrize("spec", ["int8", "int4-g128", "int4-g64-asym", "fp8-e4m3"])
def test_triton_split_k_matches_reference(spec):
    # 1024 x 5504 has >= 4M weights, so a decode row splits K in 8; 43 K-blocks of 128 in splits of 6
    # leave the last split running past K (its groups must not be read)
    from fewbits.kernels.gpu import choose_tiles

    g = torch.Generator().manual_seed(0)
    qt = quantize_tensor(torch.randn(1024, 5504, generator=g), spec)
    kern = prepare_linear(qt, device="cuda")
    assert kern.name == "cuda_triton_weight_only", kern.reason
    assert choose_tiles(1, 1024, 5504, kern.group, kern.ng == 1, kern.programs)[3] > 1
    for m in (1, 4):
        x = torch.randn(m, 5504, generator=g)
        y = kern(x.cuda().bfloat16()).float().cpu()
        assert torch.isfinite(y).all()
        assert rel_err(y, reference_linear(x, qt)) < 1e-2
