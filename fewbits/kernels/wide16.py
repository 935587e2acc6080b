"""16-bit matrix products on CPUs without fast 16-bit GEMMs, computed in fp32.

torch multiplies bf16 matrices on a CPU through oneDNN where the CPU has AVX-512 BW/VL/DQ, and fp16 ones where it
has AVX512-FP16 or AMX-FP16; elsewhere (AVX2 CPUs: AMD Zen 1-3, Intel client parts, Intel before Skylake-SP) it
runs generic loops. On an AVX2 EPYC those ran 4-6.5x slower than widening both operands to fp32 and using the
fp32 GEMM, at 128-1536 rows of a (1536, 576) weight; at 1-4 rows the widening (the weight converted on every call)
costs more than it saves (``benchmarks/bench_wide16.py``).

Widening gives the 16-bit product's numbers: a bf16 or fp16 product is exact in fp32 (8 + 8 or 11 + 11
significand bits in fp32's 24), the sums are fp32 as in torch's 16-bit GEMM, and the result is rounded to 16 bits
once at the end; only the order of the sums may differ, as between any two GEMM libraries.

`widened()` is a context in which `F.linear`, `matmul`, `mm` and `bmm` of 16-bit CPU tensors with at least
`MIN_ROWS` rows take that route; it is entered around fewbits' eager whole-model forwards (evaluation,
calibration, prefill), never around compiled or one-row decode steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fewbits.kernels.native import cpu_flags

#: rows of the left operand from which widening pays, about (an AVX2 EPYC, (1536, 576) weight, an ad-hoc run and
#: `benchmarks/bench_wide16.py`: bf16 0.2-0.5x at 1-2 rows, 0.4-0.7x at 4, 0.7-1.1x at 8, 1.4-2.3x at 16, 4.2-4.5x
#: at 128, 6.5x at 1536; fp16 1.1x at 8, 1.8x at 16)
MIN_ROWS = 8
HALF = (torch.bfloat16, torch.float16)


@functools.cache
def native_gemm(dtype: torch.dtype) -> bool:
    """Whether torch has a fast CPU GEMM for `dtype` on this CPU (oneDNN's conditions); fp32 and other
    dtypes: True. Non-x86 CPUs are taken as having one (not measured there)."""
    if dtype not in HALF:
        return True
    flags = set(cpu_flags().split())
    if "avx2" not in flags and "sse2" not in flags:  # not an x86 CPU (or flags unreadable): leave torch's path
        return True
    if dtype == torch.bfloat16:
        return {"avx512bw", "avx512vl", "avx512dq"} <= flags
    return bool({"avx512_fp16", "amx_fp16"} & flags)


def needed() -> bool:
    """Whether some 16-bit dtype lacks a fast CPU GEMM here (`widened` does something)."""
    return not all(native_gemm(d) for d in HALF)


def _widen(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the product of `a` (rows on its second-to-last axis) and `b` should be computed in fp32."""
    return (a.device.type == "cpu" and a.dtype in HALF and b.dtype == a.dtype and not native_gemm(a.dtype)
            and a.dim() >= 1 and a.numel() // max(a.shape[-1], 1) >= MIN_ROWS)


def fp32_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` computed in fp32 and rounded to x's dtype once."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)`, as `fp32_linear` where `_widen` says so."""
    return fp32_linear(x, w, bias) if _widen(x, w) else F.linear(x, w, bias)


_LINEAR = {F.linear, torch._C._nn.linear}
_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
             torch.Tensor.bmm}


class _Widening(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        if func in _LINEAR and len(args) >= 2 and not kwargs.get("out"):
            x, w = args[0], args[1]
            if _widen(x, w):
                return linear(x, w, args[2] if len(args) > 2 else kwargs.get("bias"))
        elif func in _PRODUCTS and len(args) == 2 and not kwargs:
            a, b = args
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _widen(a, b):
                return func(a.float(), b.float()).to(a.dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def widened() -> Iterator[None]:
    """Within: 16-bit CPU matrix products of `MIN_ROWS` rows or more in fp32 where torch has no fast 16-bit
    GEMM (a no-op context on CPUs that have one)."""
    if not needed():
        yield
        return
    with _Widening():
        yield


def widening(fn):  # noqa: ANN001, ANN201 (a decorator keeps fn's signature)
    """Decorator: run `fn` inside `widened()`."""
    @functools.wraps(fn)
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with widened():
            return fn(*args, **kwargs)
    return run
