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
@pytest.mark.parametrize("K", [576, 77, 2051])
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
@pytest.mark.parametrize("K", [576, 77, 2051])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_equals_dequantised_matmul(impl: str, asym: bool, K: int, dtype: torch.dtype) -> None:
    """x in fp32 (path 1 at one row, where the vector builds' default takes int16 blocks of x: tested below)."""
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
        _close(ops.int8_mm(x, q, s, corr, 1 if M == 1 else 0), ref, dtype)


@needs_ops
@pytest.mark.parametrize("impl", ["native", "portable"])
def test_calls_of_every_size_in_turn_keep_their_own_results(impl: str) -> None:
    """The operators' temporaries live in per-thread buffers kept between calls (up to 4 MB, larger ones are
    their own): a call after a larger one, after one past that limit (8 x 140,000 fp32 outputs: 4.5 MB), with
    and without corrections, with bf16 scales, fp32 ones and a strided bf16 view, in both
    operators, each equals its own reference, and an earlier call's output is not overwritten by a later call's."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(7)
    K = 64
    outs = []
    for M, N, asym in [(1, 960, False), (8, 3072, True), (1, 40, False), (8, 140_000, False), (2, 576, True),
                       (1, 140_000, True), (3, 7, False)]:
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
        s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
        if asym:  # the scales as fp32, or as a strided bf16 view
            s = s.float() if M < 8 else torch.stack([s, s], 1)[:, 0]
        corr = torch.randn(N, generator=g) * 0.01 if asym else None
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        ref = x.float() @ (q.float() * s.float()[:, None]).T
        if corr is not None:
            ref = ref + x.float().sum(-1, keepdim=True) * corr
        y = ops.int8_mm(x, q, s, corr, 0)
        _close(y, ref, torch.bfloat16)
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        d = ops.dense_mm(x, w)
        _close(d, x.float() @ w.float().T, torch.bfloat16)
        outs.append((y, ref, d, x.float() @ w.float().T))
    for y, ref, d, dref in outs:
        _close(y, ref, torch.bfloat16)
        _close(d, dref, torch.bfloat16)


def _takes_x16(impl: str, K: int) -> bool:
    """Whether int8_mm at one row multiplies int16 blocks of x on this implementation (the AVX2 and AVX-512 builds,
    K a multiple of 32)."""
    return K % 32 == 0 and (impl == "avx2" or (impl == "native" and rows.built_isa() >= 1))


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("K", [576, 96, 1536, 2051])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_one_row_is_the_int16_blocks_times_the_weight(impl: str, asym: bool, K: int, dtype: torch.dtype) -> None:
    """int8_mm at one row: on the AVX2 and AVX-512 builds (K a multiple of 32) the product of
    `act8.int16_blocks`' values, not x's; elsewhere, and on ``path=1`` everywhere, x's own.  To fp32 summation
    (2^-20 of sum |x w|) and one rounding of the output, against an x whose blocks span 2^16 in magnitude, so
    rounding the int16 blocks moves an fp32 x's product past that bound, and one code off by a step or two columns
    swapped move either."""
    from fewbits.kernels.act8 import int16_blocks

    ops = _ops(impl)
    g = torch.Generator().manual_seed(K + 2 * asym)
    N = 101
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    q[::5, ::3] = -128
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    corr = torch.randn(N, generator=g) * 0.01 if asym else None
    w = q.double() * s.double()[:, None]
    x = (torch.randn(1, K, generator=g) * torch.logspace(-4, 1, K)[torch.randperm(K, generator=g)]).to(dtype)

    def check(y: torch.Tensor, xr: torch.Tensor) -> None:
        ref = xr @ w.T
        if corr is not None:
            ref = ref + x.double().sum(-1, keepdim=True) * corr.double()
        bound = torch.finfo(dtype).eps * ref.abs() + 2.0**-20 * (xr.abs() @ w.abs().T) + 1e-9
        assert y.dtype == dtype and y.shape == (1, N)
        assert ((y.double() - ref).abs() - bound).max() <= 0, (impl, K, dtype)

    y = ops.int8_mm(x, q, s, corr)
    if _takes_x16(impl, K):
        xq, d = int16_blocks(x)
        xr = (xq.double().view(1, K // 32, 32) * d.double()[..., None]).view(1, K)
        if dtype == torch.float32:
            assert not torch.equal(xr, x.double()), "the case should round some activations"
        check(y, xr)
    else:
        check(y, x.double())
    check(ops.int8_mm(x, q, s, corr, 1), x.double())


@needs_ops
def test_amx_is_used_where_the_cpu_has_it() -> None:
    """`rows_amx` (int8_mm's tile path for 2+ rows of a bf16 x) answers for the CPU's AMX flags: none without
    them; with them, the path is built and its answer is the OS's grant of the tiles, as `q4_mm`'s AMX path
    (built and asked apart) finds it."""
    from fewbits.kernels import cpu_int4

    flags = set(native.cpu_flags().split())
    has = {"amx_tile", "amx_int8", "avx512_bf16"} <= flags and rows.built_isa() == 2
    amx = torch.ops.fewbits_rows.rows_amx()
    if not has:
        assert amx is False
    elif cpu_int4.available():
        assert amx == (int(torch.ops.fewbits_q4.q4_isa()) & 3 == 2)


@needs_ops
@pytest.mark.parametrize("impl", ["native", "portable"])
@pytest.mark.parametrize("K", [77, 576, 2051])
def test_int8_many_rows_of_a_bf16_x_are_the_exact_products_summed(impl: str, K: int) -> None:
    """int8_mm on 2 to 35 rows of a bf16 x (the native build: dpbf16, or AMX tiles where the CPU has them, in
    passes of 16 rows, 17 as 16 + 1; N and K not multiples of the tiles'): every product exact, so the error is fp32
    summation's (K * 2^-24 of sum |x w|) and one rounding of the output.  A code read from the wrong column or
    channel moves an output by about sum |x w| / K, past that bound."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(K)
    N = 45
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    w = q.double() * s.double()[:, None]
    for M in (2, 3, 8, 16, 17, 18, 35):
        x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 1, K)[torch.randperm(K, generator=g)])
        x = x.to(torch.bfloat16)
        ref = x.double() @ w.T
        bound = torch.finfo(torch.bfloat16).eps * ref.abs() + K * 2.0**-24 * (x.double().abs() @ w.abs().T)
        y = ops.int8_mm(x, q, s, None)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert ((y.double() - ref).abs() - bound).max() <= 0, (impl, K, M)


needs_amx = pytest.mark.skipif(not (rows.available() and torch.ops.fewbits_rows.rows_amx()),
                               reason="int8_mm has no AMX path on this CPU")


@needs_ops
@needs_amx
@pytest.mark.parametrize("K", [64, 100, 576, 2051])
def test_int8_amx_rows_are_the_fixed_point_product_rounded_once(K: int) -> None:
    """Where the AMX path runs (2-16 rows of a bf16 x), each row of x is a 24-bit fixed point (`act8.fixed24_rows`)
    and the output is that fixed point's exact dot product with the codes, rounded once to fp32, then scaled and
    rounded to bf16 as every path ends: bit for bit, for x spread over 2^33 (so that its smallest elements round),
    N and K not multiples of the tiles' 16 channels and 64 columns, a row of zeros, a row of tiny values (its
    2^(23 - e) past fp32's range) and 17 rows (16 through the tiles, 1 through the one-row path: not compared)."""
    from fewbits.kernels.act8 import fixed24_rows

    g = torch.Generator().manual_seed(K)
    N = 45
    q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    for M in (2, 5, 8, 16, 17):
        x = torch.randn(M, K, generator=g) * torch.logspace(-8, 2, K)[torch.randperm(K, generator=g)]
        x[1] = 0.0
        if M > 2:
            x[2] *= 2.0**-110
        x = x.to(torch.bfloat16)
        v, step = fixed24_rows(x)
        exact = (v.double() @ q.double().T) * step[:, None]
        ref = (exact.float() * s.float()).to(torch.bfloat16)
        y = torch.ops.fewbits_rows.int8_mm(x, q, s, None)
        rows_ = slice(0, min(M, 16))
        assert torch.equal(y[rows_], ref[rows_]), (K, M)
        assert (y[1] == 0).all()
        # the smallest elements did round: the fixed point is not x itself
        assert not torch.equal(v[0].double() * step[0], x[0].double())


@needs_ops
@needs_amx
def test_int8_amx_rows_carry_a_non_finite_activation() -> None:
    """A NaN or an Inf in one of 2-16 rows of a bf16 x (no fixed point for it): that row's outputs are not finite,
    as a plain product's, and the others are still the product (through the vector path)."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=g)
    q[q == 0] = 1
    s = torch.rand(64, generator=g) + 0.5
    w = q.double() * s.double()[:, None]
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 576, generator=g).to(torch.bfloat16)
        x[3, 301] = bad
        y = torch.ops.fewbits_rows.int8_mm(x, q, s, None)
        assert not torch.isfinite(y[3]).any(), bad
        ok = torch.arange(8) != 3
        _close(y[ok], (x[ok].double() @ w.T).float(), torch.bfloat16)


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
def test_int8_one_row_carries_a_non_finite_activation_to_every_output(impl: str) -> None:
    """A NaN or an Inf in the one row of x gives no finite output (the int16 path hands such a row to its fp32
    path, as a plain product carries them)."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (64, 576), dtype=torch.int8, generator=g)
    q[q == 0] = 1  # every product with the Inf non-zero
    s = torch.rand(64, generator=g) + 0.5
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 576, generator=g).to(torch.bfloat16)
        x[0, 301] = bad
        assert not torch.isfinite(ops.int8_mm(x, q, s, None)).any(), (impl, bad)


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
@pytest.mark.parametrize("impl", IMPLS)
def test_int8_a8_codes_are_act8s_exactly(impl: str) -> None:
    """The operator's own activation codes, read back through a one-hot weight (row n: 1 at column n, scale 1,
    fp32 x: y = d * code in one fp32 rounding) equal `act8.quantize_blocks`' bit for bit: ties to even (x = 0.5,
    1.5, 2.5, -2.5 at d = 1), a zero block, the block's maximum at each position, rows of random scale (the
    vector and the scalar block code of every build)."""
    from fewbits.kernels.act8 import quantize_blocks

    ops = _ops(impl)
    K = 128
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, K, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[0, :32] = 0.0
    x[0, 0], x[0, 1:5] = 127.0, torch.tensor([0.5, 1.5, 2.5, -2.5])  # d = 1: the codes are x, rounded
    x[1, 32:64] = 0.0  # a block of zeros: d = 0, codes 0
    for m in range(2, 9):
        x[m, (m * 5) % 32] = 50.0 * m  # the maximum at a different position of the first block
    q, d = quantize_blocks(x)
    y = ops.int8_mm_a8(x, torch.eye(K, dtype=torch.int8), torch.ones(K), None)
    assert torch.equal(y, q.float() * d.repeat_interleave(32, dim=1))
    assert q[0, :5].tolist() == [127, 0, 2, 2, -2]


@needs_ops
def test_int8_a8_refuses_a_width_not_of_whole_blocks() -> None:
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.fewbits_rows.int8_mm_a8(torch.randn(1, 40), torch.zeros(4, 40, dtype=torch.int8), torch.ones(4),
                                          None)


_FP8 = {False: torch.float8_e4m3fn, True: torch.float8_e5m2}


def _fp8_finite_codes(e5m2: bool) -> torch.Tensor:
    """Every FP8 code that is a number: E4M3 drops its NaN codes (0x7F, 0xFF), E5M2 its exponent-31 codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return codes[torch.isfinite(codes.view(_FP8[e5m2]).float())]


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e5m2", [False, True])
def test_fp8_reads_every_code_as_torchs_float8_value(impl: str, e5m2: bool) -> None:
    """Each finite code (subnormals and -0 included) alone in its row, at a column that walks the whole width (the
    vector steps and the scalar tail of K = 77): the output is torch's own float8 value of the code, exactly."""
    ops = _ops(impl)
    codes = _fp8_finite_codes(e5m2)
    N, K = codes.numel(), 77
    w = torch.zeros(N, K, dtype=torch.uint8)
    cols = (torch.arange(N) * 7) % K
    w[torch.arange(N), cols] = codes
    expect = codes.view(_FP8[e5m2]).float()
    for M in (1, 3):
        y = ops.fp8_mm(torch.ones(M, K), w, torch.ones(1), e5m2)
        assert y.dtype == torch.float32 and y.shape == (M, N)
        assert torch.equal(y, expect.expand(M, N)), (impl, M)


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("e5m2", [False, True])
@pytest.mark.parametrize("K", [576, 77, 2051])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_equals_dequantised_matmul(impl: str, e5m2: bool, K: int, dtype: torch.dtype) -> None:
    ops = _ops(impl)
    g = torch.Generator().manual_seed(K + e5m2)
    finite = _fp8_finite_codes(e5m2)
    N = 133
    w = finite[torch.randint(0, finite.numel(), (N, K), generator=g)]
    s = torch.rand(N, generator=g) * 0.02 + 0.001
    ref_w = w.view(_FP8[e5m2]).double() * s.double()[:, None]

    def check(y: torch.Tensor, x: torch.Tensor, ref_w: torch.Tensor) -> None:
        # fp32 sums of terms spanning FP8's whole range: their order's error is relative to the sum of the
        # terms' magnitudes (K steps of 2^-24 each at most), then one rounding to the output dtype
        ref = x.double() @ ref_w.T
        bound = (x.double().abs() @ ref_w.abs().T) * K * 2.0**-24 + ref.abs() * torch.finfo(dtype).eps + 1e-6
        assert y.dtype == dtype and y.shape == ref.shape
        assert ((y.double() - ref).abs() <= bound).all()
        # and the result is not trivially within that bound: the terms largely cancel in a few outputs at most
        assert float((y.double() - ref).norm() / ref.norm()) < 4 * torch.finfo(dtype).eps

    for M in range(1, 10):
        x = torch.randn(M, K, generator=g).to(dtype)
        check(ops.fp8_mm(x, w, s, e5m2), x, ref_w)
    check(ops.fp8_mm(x, w, s[:1], e5m2), x, w.view(_FP8[e5m2]).double() * float(s[0]))  # one scale for all


@needs_ops
def test_fp8_refuses_wrong_codes_and_scales() -> None:
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.fewbits_rows.fp8_mm(x, torch.zeros(4, 32, dtype=torch.int8), torch.ones(4), False)
    with pytest.raises(RuntimeError, match="4 output channels but 3 scales"):
        torch.ops.fewbits_rows.fp8_mm(x, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(3), False)


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_output_is_the_fp32_result_rounded_once(impl: str, dtype: torch.dtype) -> None:
    """The same sums written as fp32 and as 16 bits: the 16-bit output is torch's rounding of the fp32 one, bit for
    bit, infinities included, NaNs where they are (scales of inf make them), at sizes whose outputs are split
    between threads mid-row (8 x 5003) and not (3 x 203)."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(3)
    for M, N in ((3, 203), (8, 5003)):
        q = torch.randint(-128, 128, (N, 64), dtype=torch.int8, generator=g)
        s = torch.rand(N, generator=g) * 0.02
        s[::97] = float("inf")
        q[::194] = 0  # inf x 0: NaN
        corr = torch.randn(N, generator=g) * 0.01
        x = torch.randn(M, 64, generator=g).to(dtype)
        for c in (None, corr):
            y32 = ops.int8_mm(x.float(), q, s, c)
            y16 = ops.int8_mm(x, q, s, c)
            assert y16.dtype == dtype and bool(y32.isnan().any()) and bool(y32.isinf().any())
            ref, nan = y32.to(dtype), y32.isnan()
            assert torch.equal(y16.isnan(), nan)  # NaN payloads differ between torch's own conversions
            assert torch.equal(y16[~nan].view(torch.int16), ref[~nan].view(torch.int16)), (impl, M, N)


@needs_ops
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_answers_as_torch_argmax(impl: str, dtype: torch.dtype) -> None:
    """`argmax_rows` against torch's own argmax: random rows of vocabulary sizes within and across its chunks of
    512 (and not multiples of its 16-wide steps), a maximum tied within a chunk and across chunks (the first wins),
    a NaN before and after the maximum and in a later chunk (the first NaN wins), infinities, a row of -inf only,
    signed zeros, and rows read through a view whose rows are not adjacent."""
    ops = _ops(impl)
    g = torch.Generator().manual_seed(5)
    for B, V in ((1, 49152), (8, 49152), (3, 1000), (2, 513), (1, 1), (4, 7), (5, 16)):
        x = torch.randn(B, V, generator=g).to(dtype)
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1)), (B, V)
    x = torch.zeros(7, 2000, dtype=dtype)
    x[0, [700, 1500]] = 3  # tied in two chunks
    x[1, [600, 601]] = 3  # tied within one
    x[2, [5, 1999]] = float("nan")
    x[2, 3] = float("inf")
    x[3, 1999] = float("nan")  # after the maximum, in the last chunk
    x[3, 10] = 5
    x[4, 100] = float("inf")
    x[5] = float("-inf")
    x[6, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    x[6, 4:] = -1
    ref = x.argmax(-1)
    assert ref.tolist() == [700, 600, 5, 1999, 100, 0, 0]  # what torch answers, the cases meant
    assert torch.equal(ops.argmax_rows(x), ref)
    wide = torch.randn(8, 3000, generator=g).to(dtype)
    view = wide[:, 100:2100]
    assert not view.is_contiguous()
    assert torch.equal(ops.argmax_rows(view), view.argmax(-1))


@needs_ops
def test_argmax_helper_uses_the_operator_only_where_it_fits() -> None:
    """`rows.argmax` is torch's answer for every input: the operator's (B, V) CPU rows, and torch's own argmax for
    a 3-D tensor, an integer one and a column view (rows not contiguous)."""
    assert rows.available()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 3000, generator=g).bfloat16()
    for t in (x, torch.randn(2, 3, 50, generator=g), torch.randint(0, 9, (3, 40), generator=g), x.t()):
        assert torch.equal(rows.argmax(t), t.argmax(-1))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.fewbits_rows.argmax_rows(x.t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.fewbits_rows.argmax_rows(torch.zeros(2, 3, dtype=torch.int32))
