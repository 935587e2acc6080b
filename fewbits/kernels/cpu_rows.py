"""int8 and FP8 per-channel weights at decode sizes on a CPU: `fewbits_rows::int8_mm` / `fp8_mm`
(`fewbits.kernels.rows`) for up to `rows.MAX_ROWS` rows of activations (int8 with a bf16 x:
`rows.INT8_BF16_MAX_ROWS`), torch's ``aten._weight_int8pack_mm`` / the decode-to-bf16-then-matmul of
`Fp8DequantKernel` for more.

`Int8RowsKernel` is `fewbits.kernels.cpu.Int8PackKernel` with another operator for few rows: the same
tensors (int8 codes shifted by 128, bf16 scales, the asymmetric formats' fp32 correction), held once and
read by both operators, so `fewbits.decode.fuse` concatenates it as it does `Int8PackKernel`.  The few-row
operator sums in fp32 and rounds once to the activations' dtype (the correction included); torch's rounds
the product to bf16 before the correction is added.
"""

from __future__ import annotations

import torch

from fewbits.formats.format import Format
from fewbits.kernels import rows
from fewbits.kernels.arena import Bindable
from fewbits.kernels.cpu import Fp8DequantKernel, Int8PackKernel, _finish
from fewbits.tensor import QuantizedTensor


class Int8RowsKernel(Bindable, Int8PackKernel):
    """int8 weights (per channel or per tensor, symmetric or asymmetric) x up to `max_rows` rows of
    activations through the few-row operator (bound to a block, `fewbits_rows::int8_mm_at`:
    `fewbits.kernels.arena`), more rows through ``aten._weight_int8pack_mm``."""

    name = "cpu_int8_rows"
    max_rows = rows.MAX_ROWS
    max_rows_bf16 = rows.INT8_BF16_MAX_ROWS  # the same for a bf16 x (more where the operator's AMX path runs)
    # the few-row operator's path: 0 the fastest built (on AVX2 one row of x in int16 blocks, `act8.int16_blocks`),
    # 1 x in fp32 at every row count (tests, benchmarks); read at each call, so a compiled graph keeps the value
    # it traced
    path = 0

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        why = Int8PackKernel.supports(fmt, shape)  # the many-row operator's conditions: it runs prefill
        return why if why is not None else rows.why_not()

    def _bind_tensors(self) -> tuple[torch.Tensor | None, ...] | None:
        if self.q.dtype != torch.int8 or self.scales.dtype != torch.bfloat16 or (
                self.corr is not None and self.corr.dtype != torch.float32):
            return None
        return self.q, self.scales, self.corr

    def _bind_args(self, block: torch.Tensor, offsets: tuple[int, ...]) -> tuple:
        return (block, *offsets, self.shape[0])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] > (self.max_rows_bf16 if x2.dtype == torch.bfloat16 else self.max_rows):
            return super().__call__(x, bias)
        at = self._bound()
        if at is not None:
            return _finish(torch.ops.fewbits_rows.int8_mm_at(x2, *at, self.path), x, bias)
        return _finish(torch.ops.fewbits_rows.int8_mm(x2, self.q, self.scales, self.corr, self.path), x, bias)


class Int8RowsA8Kernel(Int8RowsKernel):
    """int8 weights x int8 activations (`fewbits_rows::int8_mm_a8`): x rounded per row and block of 32 columns
    (`fewbits.kernels.act8`, llama.cpp's Q8_0 x Q8_0 numerics) and multiplied in integers (``vpdpbusd`` with
    AVX512-VNNI, ``vpmaddubsw`` with AVX2), at
    every row count (passes of 8 rows over the weight), so a prefill and a decode step round alike.  Offered only
    in the dispatcher's opt-in "q8" activation mode."""

    name = "cpu_int8_rows_a8"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        why = Int8RowsKernel.supports(fmt, shape)
        if why is not None:
            return why
        if shape[1] % 32:
            return f"needs in_features divisible by 32 (the activations' blocks), weight shape is {tuple(shape)}"
        if not torch.ops.fewbits_rows.a8_fast():
            return "this CPU has neither AVX512-VNNI nor AVX2 (the int8-activation path)"
        return None

    def _bind_tensors(self) -> None:
        return None  # `int8_mm_a8` has no block variant

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        return _finish(torch.ops.fewbits_rows.int8_mm_a8(x2, self.q, self.scales, self.corr), x, bias)


class Fp8RowsKernel(Fp8DequantKernel):
    """FP8 (E4M3 / E5M2) weights with one scale per output channel or per tensor x up to `max_rows` rows of
    activations through `fewbits_rows::fp8_mm`: the codes are read as they are stored (one byte a weight) and
    widened to fp32 on the fly, where `Fp8DequantKernel` first writes a bf16 weight (a numba pass: one byte a
    weight read, two written, then read again by the matmul).  The products are exact (an FP8 value has at most
    4 significant bits, x is widened from its dtype), the sums fp32, times the fp32 scale once at the end;
    `Fp8DequantKernel` rounds each scaled weight to bf16 first, so the two differ by that rounding.  More rows (a
    prefill) go through `Fp8DequantKernel`, whose decode is paid once for a large matmul.  Grouped FP8 scales
    (``-gN``) stay with `Fp8DequantKernel`."""

    name = "cpu_fp8_rows"
    max_rows = rows.MAX_ROWS

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        why = Fp8DequantKernel.supports(fmt, shape)
        if why is not None:
            return why
        if fmt.granularity == "group":
            return f"needs one scale per channel or per tensor, format is {fmt.spec} (grouped scales)"
        return rows.why_not()

    def __init__(self, qt: QuantizedTensor) -> None:
        super().__init__(qt)
        self.e5m2 = self.element == "e5m2"
        self.channel_scales = qt.scale_values().float().reshape(-1).contiguous()  # (N,) or (1,), fp32 as stored

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.shape[0] > self.max_rows:
            return super().__call__(x, bias)
        y = torch.ops.fewbits_rows.fp8_mm(x2, self.w8, self.channel_scales, self.e5m2)
        return _finish(y, x, bias)
