"""fewbits.kernels.wide16: 16-bit products in fp32 on CPUs without a fast 16-bit GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fewbits.kernels import wide16

AVX2 = "flags : fpu sse2 avx avx2 fma f16c"


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags wide16 reads (and forget its cached answers)."""
    def set_flags(text: str) -> None:
        monkeypatch.setattr(wide16, "cpu_flags", lambda: text)
        wide16.native_gemm.cache_clear()
    yield set_flags
    wide16.native_gemm.cache_clear()


@pytest.fixture
def no_native(monkeypatch):
    """As on an AVX2 CPU: no fast bf16 or fp16 GEMM."""
    monkeypatch.setattr(wide16, "native_gemm", lambda dtype: dtype not in wide16.HALF)


def test_native_gemm_follows_onednn_conditions(flags):
    flags(AVX2)
    assert not wide16.native_gemm(torch.bfloat16) and not wide16.native_gemm(torch.float16)
    assert wide16.native_gemm(torch.float32) and wide16.needed()
    flags(AVX2 + " avx512f avx512bw avx512vl avx512dq")  # Skylake-SP .. Ice Lake: oneDNN bf16, no fp16
    assert wide16.native_gemm(torch.bfloat16) and not wide16.native_gemm(torch.float16)
    flags(AVX2 + " avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_fp16 amx_tile")  # Sapphire Rapids
    assert wide16.native_gemm(torch.bfloat16) and wide16.native_gemm(torch.float16) and not wide16.needed()
    flags("aarch64")  # not x86 (no flags line): torch's own path is left alone
    assert wide16.native_gemm(torch.bfloat16) and not wide16.needed()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widened_products_are_the_fp32_products_rounded_once(no_native, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 40, generator=g).to(dtype)  # 18 rows >= MIN_ROWS
    w, b = torch.randn(24, 40, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
    want = (x.float() @ w.float().T + b.float()).to(dtype)
    exact = (x.double() @ w.double().T + b.double())
    lin = torch.nn.Linear(40, 24, dtype=dtype)
    lin.weight.data, lin.bias.data = w, b
    with torch.no_grad(), wide16.widened():
        got = {"F.linear": F.linear(x, w, b), "nn.Linear": lin(x), "linear kw": F.linear(x, w, bias=b),
               "matmul": torch.matmul(x, w.T) + b, "@": (x @ w.T) + b, "bmm": torch.bmm(x, w.T.expand(2, 40, 24)) + b,
               "mm": torch.mm(x[0], w.T) + b}
    for name, y in got.items():
        assert y.dtype == dtype, name
        ref = want if "linear" in name.lower() else ((x.float() @ w.float().T).to(dtype) + b)  # bias added in 16 bits
        ref = ref[0] if name == "mm" else ref
        assert torch.equal(y, ref), name
    # one rounding of fp32's sum: within half a 16-bit step of the exact value (plus fp32's own error)
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(1)
    assert ((got["F.linear"].double() - exact).abs() <= ulp).all()


def test_few_rows_and_fp32_are_left_to_torch(no_native, monkeypatch):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=g).bfloat16()
    few = torch.randn(wide16.MIN_ROWS - 1, 32, generator=g).bfloat16()
    x32, w32 = torch.randn(20, 32, generator=g), w.float()
    with wide16.widened():
        y_few, y32 = F.linear(few, w), F.linear(x32, w32)
    assert torch.equal(y_few, F.linear(few, w)) and torch.equal(y32, F.linear(x32, w32))
    calls = []
    orig = F.linear
    monkeypatch.setattr(wide16.F, "linear", lambda *a, **k: calls.append(a[0].dtype) or orig(*a, **k))
    wide16.linear(few, w)
    wide16.linear(torch.randn(20, 32).bfloat16(), w)
    assert calls == [torch.bfloat16, torch.float32]  # the dtype each product ran in


def test_nothing_is_widened_outside_the_context_or_where_the_cpu_has_the_gemm(flags, monkeypatch):
    x, w = torch.randn(32, 64).bfloat16(), torch.randn(48, 64).bfloat16()
    native = F.linear(x, w)
    flags(AVX2 + " avx512f avx512bw avx512vl avx512dq avx512_fp16")
    entered = []
    monkeypatch.setattr(wide16._Widening, "__enter__", lambda self: entered.append(1))
    with wide16.widened():
        assert torch.equal(F.linear(x, w), native)
    assert entered == []  # a CPU with both GEMMs: the context is a no-op


def test_gradients_flow_through_widened_products(no_native):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 16, generator=g).bfloat16()
    w = torch.randn(8, 16, generator=g).bfloat16().requires_grad_(True)
    with wide16.widened():
        F.linear(x, w).float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad, (torch.ones(8, 12) @ x.float()).bfloat16())


def test_widening_decorator_enters_the_context(no_native):
    seen = []

    @wide16.widening
    def f(a, b):
        seen.append(torch._C._is_torch_function_mode_enabled())
        return F.linear(a, b)

    x, w = torch.randn(10, 8).half(), torch.randn(4, 8).half()
    assert torch.equal(f(x, w), (x.float() @ w.float().T).half()) and seen == [True]
    assert not torch._C._is_torch_function_mode_enabled()
