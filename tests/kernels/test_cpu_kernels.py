"""Every CPU fast path against the reference dequantise-then-matmul path, on random shapes and inputs.

Error bounds (relative Frobenius norm of y - y_ref, y_ref computed in fp32 from the same codes):
  W8A16 / W4A16 / FP8 dequant (bf16 activations, bf16 scales, bf16 output): 1e-2  (measured ~3e-3)
  W8A8 int8 activations (per-token absmax, 127 levels):             3e-2  (measured ~1e-2)
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fewbits.kernels import choose_kernel, linear, prepare_linear, reference_linear, rows
from fewbits.kernels.cpu import Fp8DequantKernel, Int4PackKernel, Int8PackKernel, W8A8IntMMKernel
from fewbits.kernels.cpu_int4 import Q4Kernel
from fewbits.kernels.cpu_rows import Int8RowsKernel
from fewbits.tensor import quantize_tensor

INT8_FAST = Int8RowsKernel if rows.enabled() else Int8PackKernel  # the int8 class the dispatcher picks first
W16_BOUND = 1e-2
W8A8_BOUND = 3e-2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def _case(spec: str, n: int, k: int, m: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g))  # uneven row scales
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g)
    return quantize_tensor(w, spec), x, b


INT8_SPECS = ["int8", "int8-asym", "int8-t", "int8-narrow"]
INT4_SPECS = ["int4-g128", "int4-g64", "int4-g32-asym", "int4", "int4-t", "int3-g64", "int3-g64-asym",
              "int2-g32", "int2-g64-asym", "int4-g512", "int4-g96", "int3-g192-asym", "int4-g64-narrow",
              "int3-g64-narrow"]


@pytest.mark.parametrize("spec,kernel", [("int8", INT8_FAST), ("int8-t", INT8_FAST),
                                         ("int4-g64", Int4PackKernel), ("int4", Int4PackKernel),
                                         ("int3-g32", Int4PackKernel), ("int2-g64", Int4PackKernel)])
def test_full_grid_end_codes_and_negative_scales_reach_the_kernels(spec, kernel):
    """The full symmetric grid stores code 0 (q = -2^(b-1)) and negative scales (a positive extreme): the
    packed operators take both, so they agree with the reference on exactly such weights."""
    qt, x, b = _case(spec, 64, 256, 5, 7)
    assert int(qt.unpacked_codes().min()) == 0 and bool((qt.scale_values() < 0).any())
    if spec != "int8-t":  # one scale per tensor has one sign
        assert bool((qt.scale_values() > 0).any())
    kern = prepare_linear(qt)
    if kernel is Int4PackKernel:  # the dispatcher runs fewbits' own operator where it can; torch's too here
        assert kern.name in (Q4Kernel.name, Int4PackKernel.name)
        assert rel_err(Int4PackKernel(qt)(x, b), reference_linear(x, qt, b)) < W16_BOUND
    else:
        assert kern.name == kernel.name
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < W16_BOUND


@settings(max_examples=12, deadline=None)
@given(spec=st.sampled_from(INT8_SPECS), n=st.integers(1, 12).map(lambda i: 16 * i),
       k=st.integers(1, 24).map(lambda i: 16 * i), m=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_int8pack_matches_reference(spec, n, k, m, seed):
    qt, x, b = _case(spec, n, k, m, seed)
    kern = prepare_linear(qt)
    assert kern.name == INT8_FAST.name
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < W16_BOUND


@settings(max_examples=16, deadline=None)
@given(spec=st.sampled_from(INT4_SPECS), n=st.integers(1, 8).map(lambda i: 16 * i),
       kg=st.integers(1, 4), m=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_int4pack_matches_reference(spec, n, kg, m, seed):
    k = {"int4-g512": 512, "int4-g96": 192, "int3-g192-asym": 192}.get(spec, 128) * kg  # g96: the regrouped g128
    qt, x, b = _case(spec, n, k, m, seed)
    assert Int4PackKernel.supports(qt.fmt, qt.shape) is None
    kern = Int4PackKernel(qt)  # torch's operator (the dispatcher may prefer fewbits' own: test_cpu_int4.py)
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < W16_BOUND


@pytest.mark.parametrize("spec", ["int4-g96", "int4-g96-asym", "int4-g192"])
def test_int4pack_takes_groups_that_are_multiples_of_its_own(spec):
    """int4-g128 regrouped on SmolLM2's 576 columns is int4-g96: the operator runs it as groups of 32 (each
    scale repeated three times) instead of leaving it to the reference path."""
    qt, x, b = _case(spec, 64, 576, 3, 11)
    assert Int4PackKernel.supports(qt.fmt, qt.shape) is None
    kern = Int4PackKernel(qt)
    assert kern.group == {"int4-g192": 64}.get(spec, 32)
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < W16_BOUND


@pytest.mark.parametrize("spec", ["fp8-e4m3", "fp8-e5m2", "fp8-e4m3-t", "fp8-e4m3-g64"])
def test_fp8_dequant_matches_reference(spec):
    qt, x, b = _case(spec, 48, 192, 5, 3)
    kern = prepare_linear(qt)
    assert isinstance(kern, Fp8DequantKernel)  # or its few-row subclass (tests/kernels/test_cpu_rows.py)
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < W16_BOUND
    assert rel_err(Fp8DequantKernel(qt)(x, b), reference_linear(x, qt, b)) < W16_BOUND


@pytest.mark.parametrize("spec", ["fp8-e4m3", "fp8-e5m2", "fp8-e4m3-t", "fp8-e5m2-g64"])
def test_fp8_decode_is_torchs_float8_value_times_the_bf16_scale_rounded_once(spec):
    """The compiled decode against torch's own float8 dtypes: bf16(value x bf16 scale), bit for bit,
    codes of both signs, E4M3's subnormal codes included."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 128, generator=g) * torch.rand(40, 1, generator=g)
    qt = quantize_tensor(w, spec)
    kern = Fp8DequantKernel(qt)
    fp8 = torch.float8_e4m3fn if "e4m3" in spec else torch.float8_e5m2
    values = qt.unpacked_codes().view(fp8).float()
    s = qt.scale_values().float().to(torch.bfloat16).float()
    ref = (values.reshape(40, s.shape[-1], -1) * s.reshape(-1, s.shape[-1], 1)).reshape(40, 128).bfloat16()
    assert torch.equal(kern.weight().view(torch.int16), ref.view(torch.int16))
    if "e4m3" in spec:
        c = qt.unpacked_codes() & 0x7F
        assert int(((c > 0) & (c < 8)).sum()) > 0  # subnormal codes (exponent field 0) were exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_paths_keep_input_dtype_and_leading_dims(dtype):
    for spec in ("int8", "int4-g64"):
        qt, x, b = _case(spec, 64, 192, 6, 1, dtype)
        x3 = x.reshape(2, 3, 192)
        y = prepare_linear(qt)(x3, b)
        assert y.dtype == dtype and y.shape == (2, 3, 64)
        assert rel_err(y, reference_linear(x3.float(), qt, b)) < 2 * W16_BOUND


@pytest.mark.parametrize("m", [1, 4, 16, 40])
def test_w8a8_int_mm_matches_reference(m):
    qt, x, b = _case("int8", 96, 256, m, m)
    kern = prepare_linear(qt, activations="int8")
    assert kern.name == W8A8IntMMKernel.name
    bound = W16_BOUND if m < kern.min_rows else W8A8_BOUND  # few rows run as W8A16
    assert rel_err(kern(x, b), reference_linear(x, qt, b)) < bound


def test_exactness_on_integer_data():
    """Small integers and power-of-two scales are exact in bf16: the fast paths must agree exactly."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-7, 8, (32, 128), generator=g).float()
    x = torch.randint(-3, 4, (2, 128), generator=g).float()
    for spec in ("int8", "int4-g64", "int4-g128-asym"):
        qt = quantize_tensor(w, spec)
        ref = reference_linear(x, qt)
        y = prepare_linear(qt)(x)
        assert rel_err(y, ref) < 5e-3, spec  # bf16 output rounding only


@pytest.mark.parametrize("spec,shape,why", [
    ("nf4-g64", (64, 128), "integer codes"),
    ("fp4-g32", (64, 128), "integer codes"),
    ("int4-g12", (64, 96), "group size"),
    ("int4-g64", (40, 128), "out_features divisible by 16"),
    ("int8", (64, 72), "in_features divisible by 16"),
    ("int6-g64", (64, 128), "at most 4 bits"),
])
def test_fallback_is_reference_with_logged_reason(spec, shape, why, caplog):
    qt, x, b = _case(spec, *shape, 3, 0)
    with caplog.at_level(logging.INFO, logger="fewbits.kernels"):
        kern = prepare_linear(qt)
    assert kern.name == "reference"
    assert why in kern.reason and why in caplog.text
    torch.testing.assert_close(kern(x, b), reference_linear(x, qt, b))


def test_choose_kernel_reasons_and_dense():
    builder, reason = choose_kernel("int4-g128", (4096, 4096), "cpu")
    assert builder in (Q4Kernel, Int4PackKernel) and "fast path" in reason
    builder, reason = choose_kernel("bf16", (16, 16), "cpu")
    assert "not quantised" in reason
    with pytest.raises(ValueError, match="activations"):
        choose_kernel("int8", (16, 16), "cpu", activations="int4")
    w = torch.randn(32, 64)
    qt = quantize_tensor(w, "fp32")
    x = torch.randn(2, 64)
    torch.testing.assert_close(prepare_linear(qt)(x), x @ w.T)


def test_linear_caches_prepared_kernel_and_checks_shapes():
    qt, x, b = _case("int4-g64", 32, 128, 2, 5)
    y1 = linear(x, qt, b)
    y2 = linear(x, qt, b)
    torch.testing.assert_close(y1, y2)
    with pytest.raises(ValueError, match="does not match weight shape"):
        reference_linear(torch.randn(2, 100), qt)
    with pytest.raises(ValueError, match="2-D"):
        prepare_linear(quantize_tensor(torch.randn(2, 16, 64), "int8"))
