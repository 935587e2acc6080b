"""fewbits.kernels.rows: the few-row matmuls against an fp32 matmul of the same (dequantised) weights."""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels import native, rows

needs_ops = pytest.mark.skipif(not rows.available(), reason=f"no operators: {native.why(rows.NAME)}")


def _tol(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rounding of the output to `dtype` (half an ulp, with room for fp32 summation order)."""
    eps = torch.finfo(dtype).eps
    return ref.abs() * eps + 1e-3


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.float() - ref).abs()
    bad = err > _tol(ref, dtype)
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {float(err.max())}"


def _ops(impl: str):  # noqa: ANN202
    if impl == "portable":
        if not rows.build_portable():
            pytest.skip(f"portable variant did not build: {native.why(rows.PORTABLE_NS)}")
        return getattr(torch.ops, rows.PORTABLE_NS)
    if impl == "avx2":
        if rows.built_isa() < 1:
            pytest.skip("this CPU has no AVX2 + FMA + F16C")
        if rows.built_isa() == 1:
            return torch.ops.fewbits_rows  # the native build is the AVX2 one
        if not rows.build_avx2():
            pytest.skip(f"AVX2 variant did not build: {native.why(rows.AVX2_NS)}")
        return getattr(torch.ops, rows.AVX2_NS)
    return torch.ops.fewbits_rows


IMPLS = ["native", "avx2", "portable"]


@needs_ops
def test_built_path_is_the_one_the_cpu_flags_name() -> None:
    """`built_isa` (read from /proc/cpuinfo, used to pick dispatch limits before anything is built) names the
    path the library was compiled with; the variants are what they claim."""
    assert torch.ops.fewbits_rows.rows_isa() == rows.built_isa()
    if rows.build_portable():
        assert getattr(torch.ops, rows.PORTABLE_NS).rows_isa() == 0
    if rows.built_isa() == 2 and rows.build_avx2():
        assert getattr(torch.ops, rows.AVX2_NS).rows_isa() == 1


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [576, 77])
def test_dense_equals_fp32_matmul(impl: str, dtype: torch.dtype, K: int) -> None:
    ops = _ops(impl)
    g = torch.Generator().manual_seed(K)
    w = torch.randn(203, K, generator=g).to(dtype)  # 203: not a multiple of the channel blocks
    for M in range(1, 10):
        x = torch.randn(M, K, generator=g).to(dtype)
        _close(ops.dense_mm(x, w), x.float() @ w.float().T, dtype)


@needs_ops
def test_dense_reads_row_views_in_place() -> None:
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(96, 80, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    part = whole[10:50, 20:60]  # rows of stride 80: a view, not a copy
    _close(torch.ops.fewbits_rows.dense_mm(x, part), x.float() @ part.float().T, torch.bfloat16)


@needs_ops
def test_dense_rejects_mixed_dtypes() -> None:
    x, w = torch.randn(1, 32), torch.randn(4, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 or both fp16"):
        torch.ops.fewbits_rows.dense_mm(x, w)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.fewbits_rows.dense_mm(x.to(torch.bfloat16), torch.randn(4, 16).to(torch.bfloat16))


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("K", [576, 77])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_equals_dequantised_matmul(impl: str, asym: bool, K: int, dtype: torch.dtype) -> None:
    ops = _ops(impl)
    g = torch.Generator().manual_seed(K + asym)
    N = 133
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    corr = torch.randn(N, generator=g) * 0.01 if asym else None
    w = q.float() * s.float()[:, None]  # the dequantised weight
    for M in range(1, 10):
        x = torch.randn(M, K, generator=g).to(dtype)
        ref = x.float() @ w.T
        if corr is not None:
            ref = ref + x.float().sum(-1, keepdim=True) * corr
        _close(ops.int8_mm(x, q, s, corr), ref, dtype)


def _a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The product as specified: act8's codes times the int8 weight summed exactly per block of 32, times the
    block's d, summed over blocks, times the channel's scale (float64)."""
    from fewbits.kernels.act8 import quantize_blocks

    xq, d = quantize_blocks(x)
    M, K = x.shape
    prod = (xq.long().reshape(M, 1, K // 32, 32) * q.long().reshape(1, -1, K // 32, 32)).sum(-1)
    return (prod.double() * d.double().reshape(M, 1, -1)).sum(-1) * scales.double()


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [576, 96])
def test_int8_a8_is_the_integer_product_of_the_activation_blocks(impl: str, K: int) -> None:
    """int8_mm_a8: within one bf16 rounding of the exact integer products (K = 96 ends on half a 64-column
    step); the correction of asymmetric formats adds sum(x) * corr as int8_mm does.  The weights include -128 (the
    asymmetric formats' shifted codes reach it; the AVX2 path takes its magnitude as an unsigned 128)."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(K)
    q = torch.randint(-128, 128, (203, K), generator=g, dtype=torch.int8)
    q[::7, ::5] = -128
    scales = torch.rand(203, generator=g) * 0.01
    corr = torch.randn(203, generator=g) * 0.01
    for M in (1, 2, 5, 9):
        x = (torch.randn(M, K, generator=g) * 3).to(torch.bfloat16)
        ref = _a8_reference(x, q, scales)
        y = ops.int8_mm_a8(x, q, scales, None)
        assert y.dtype == torch.bfloat16 and y.shape == (M, 203)
        assert ((y.double() - ref).abs() - 2.0**-8 * ref.abs() - 1e-9).max() <= 0, (impl, K, M)
        ref_c = ref + x.double().sum(1, keepdim=True) * corr.double()
        y_c = ops.int8_mm_a8(x, q, scales, corr).double()
        assert ((y_c - ref_c).abs() - 2.0**-8 * ref_c.abs() - 1e-6).max() <= 0, (impl, K, M)


@needs_ops
def test_int8_a8_refuses_a_width_not_of_whole_blocks() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.fewbits_rows.int8_mm_a8(torch.randn(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.ones(4),
                                          None)
