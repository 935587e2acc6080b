"""fewbits.kernels.cpu_rows: the int8 kernel class for decode sizes, as the dispatcher builds it, against the
reference dequantise-then-matmul path; torch's operator for more rows and when the operators are unavailable."""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels import choose_kernel, native, prepare_linear, reference_linear, rows
from fewbits.kernels.cpu import Fp8DequantKernel, Int8PackKernel
from fewbits.kernels.cpu_rows import Fp8RowsKernel, Int8RowsKernel
from fewbits.tensor import quantize_tensor

needs_ops = pytest.mark.skipif(not rows.available(), reason=f"no operators: {native.why(rows.NAME)}")


def _qt(spec: str, n: int = 96, k: int = 208, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    return quantize_tensor(torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g)), spec)


@needs_ops
@pytest.mark.parametrize("spec", ["int8", "int8-asym", "int8-t"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_kernel_equals_reference(spec: str, dtype: torch.dtype) -> None:
    qt = _qt(spec)
    kern = prepare_linear(qt)
    assert isinstance(kern, Int8RowsKernel)
    g = torch.Generator().manual_seed(1)
    b = torch.randn(qt.shape[0], generator=g)
    for m in range(1, 10):  # 9 rows: torch's operator on the same tensors
        x = torch.randn(2, m, qt.shape[1], generator=g).to(dtype)
        y, ref = kern(x, b), reference_linear(x.float(), qt, b)
        assert y.shape == (2, m, qt.shape[0]) and y.dtype == dtype
        # one bf16 rounding of x (torch's path) and of the output
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
        most = Int8RowsKernel.max_rows_bf16 if dtype == torch.bfloat16 else Int8RowsKernel.max_rows
        if 2 * m <= most:  # the few-row operator, then the bias as the kernel classes add it
            direct = torch.ops.fewbits_rows.int8_mm(x.reshape(-1, qt.shape[1]), kern.q, kern.scales, kern.corr)
            assert torch.equal(y.reshape(-1, qt.shape[0]), direct + b.to(dtype))


@needs_ops
def test_more_rows_run_torch_operator_on_the_same_codes() -> None:
    qt = _qt("int8-asym")
    kern, pack = prepare_linear(qt), Int8PackKernel(qt)
    for n, dtype in ((Int8RowsKernel.max_rows_bf16, torch.bfloat16), (Int8RowsKernel.max_rows, torch.float32)):
        x = torch.randn(n + 1, qt.shape[1]).to(dtype)
        assert torch.equal(kern(x), pack(x)), dtype


def test_without_the_operators_the_dispatcher_picks_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native._BUILT, rows.NAME, False)
    monkeypatch.setitem(native._WHY, rows.NAME, "no compiler (test)")
    builder, reason = choose_kernel("int8", (96, 208))
    assert builder is Int8PackKernel, reason
    assert "no compiler (test)" in Int8RowsKernel.supports(_qt("int8").fmt, (96, 208))


def test_switch_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEWBITS_CPU_ROWS", "torch")
    assert not rows.enabled()
    builder, _ = choose_kernel("int8", (96, 208))
    assert builder is Int8PackKernel


@needs_ops
@pytest.mark.parametrize("spec", ["fp8-e4m3", "fp8-e5m2", "fp8-e4m3-t"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_rows_kernel_equals_reference(spec: str, dtype: torch.dtype) -> None:
    """Per-channel and per-tensor FP8 at decode sizes: the few-row operator, within one rounding of the output of
    the reference (which dequantises in fp32); 9 rows and more: the decode-to-bf16 path on the same codes."""
    qt = _qt(spec)
    kern = prepare_linear(qt)
    assert isinstance(kern, Fp8RowsKernel)
    g = torch.Generator().manual_seed(2)
    b = torch.randn(qt.shape[0], generator=g)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, qt.shape[1], generator=g).to(dtype)
        y, ref = kern(x, b), reference_linear(x.float(), qt, b)
        assert y.shape == (m, qt.shape[0]) and y.dtype == dtype
        tol = max(2 * torch.finfo(dtype).eps, 1e-5)  # fp32: room for the summation order
        assert float((y.float() - ref).norm() / ref.norm()) < tol, (spec, m)
    x = torch.randn(Fp8RowsKernel.max_rows + 1, qt.shape[1]).to(torch.bfloat16)
    assert torch.equal(kern(x), Fp8DequantKernel(qt)(x))


def test_grouped_fp8_stays_with_the_dequantising_kernel() -> None:
    qt = _qt("fp8-e4m3-g64", k=192)
    assert "grouped scales" in Fp8RowsKernel.supports(qt.fmt, tuple(qt.shape))
    assert isinstance(prepare_linear(qt), Fp8DequantKernel) and not isinstance(prepare_linear(qt), Fp8RowsKernel)


@needs_ops
@pytest.mark.parametrize("spec", ["int8", "int8-asym"])
def test_a_bound_rows_kernel_reads_its_block_by_offsets_bit_for_bit(spec: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`bind` (`fewbits.kernels.arena`): `int8_mm_at` reads the codes, scales and corrections from the block they
    were placed in, with the same output as `int8_mm` over the tensors, at 1 and 3 rows in bf16 and fp32; copies
    are not bound; a kernel whose tensors moved since unbinds at its next call; one outside the block is not bound."""
    import copy

    from fewbits.decode import pages

    if pages.why_not_huge(huge=False) is not None:
        pytest.skip(pages.why_not_huge(huge=False))
    monkeypatch.setattr(pages, "HUGE", 4096)  # one kernel's tensors fill less than one huge page
    qt = _qt(spec, 48, 256, seed=4)
    kern = prepare_linear(qt)
    assert isinstance(kern, Int8RowsKernel) and (kern.corr is not None) == (spec == "int8-asym")
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(m, 256, generator=g).to(dt) for m in (1, 3) for dt in (torch.bfloat16, torch.float32)]
    want = [kern(x) for x in xs]
    placed = pages.place([kern], huge=False, min_bytes=0)
    assert placed.block is not None and kern.bind(placed.block) and kern._at is not None
    for x, w in zip(xs, want, strict=True):
        assert torch.equal(kern(x), w)
    assert all(t is not placed.block for t in pages.tensors_of([kern]))
    c = copy.deepcopy(kern)
    assert c._at is None and torch.equal(c(xs[0]), want[0])
    pages.place([kern], huge=False, again=True, min_bytes=0)
    assert torch.equal(kern(xs[0]), want[0]) and kern._at is None
    assert not prepare_linear(qt).bind(placed.block)


@needs_ops
def test_rows_reads_outside_the_block_are_refused() -> None:
    x = torch.randn(1, 64)
    block = torch.zeros(1000, dtype=torch.uint8)  # 8 x 64 int8 codes are 512 bytes, their bf16 scales 16
    torch.ops.fewbits_rows.int8_mm_at(x, block, 0, 512, -1, 8, 0)  # inside: runs
    for q, s, c in ((600, 0, -1), (0, 990, -1), (0, 512, 980), (0, 513, -1)):
        with pytest.raises(RuntimeError, match="outside the arena"):
            torch.ops.fewbits_rows.int8_mm_at(x, block, q, s, c, 8, 0)
