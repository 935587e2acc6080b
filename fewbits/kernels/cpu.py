"""CPU fast paths for quantised linear layers, built on torch's own packed-weight operators.

* W8A16 (`Int8PackKernel`): ``aten._weight_int8pack_mm`` multiplies bf16 activations by int8 weights with
  one scale per output channel.  Asymmetric 8-bit codes c with zero point z are run as (c - 128) and the
  rank-1 correction  sum_k(x_k) * s * (128 - z)  is added (exact algebra, one extra vector op).
* W4A16 (`Int4PackKernel`): ``aten._weight_int4pack_mm_for_cpu`` computes  w = (c - 8) * s + m  per group
  of 32/64/128/256 input columns from 4-bit codes c and a (K/g, N, 2) table of (s, m) pairs.  Any integer
  format of <= 4 bits maps onto it: with the numeric core's codes (w = s * (c - o), o = 2^(b-1) or the
  zero point, an integer or a float for `-zfp16` formats) the codes are shifted by an integer k to
  c' = c - k + 8 (k = 8 for 4-bit codes, else round(o) clamped so that c' stays in [0, 15]) and the pair
  is (s, (k - o) * s): exact for integer offsets of <= 3-bit codes (m = 0), otherwise m carries the
  bf16 rounding of the table.  Per-channel scales are repeated over the groups.
* W8A8 (`W8A8IntMMKernel`): dynamic per-token int8 activations (LLM.int8()/SmoothQuant style absmax,
  Dettmers et al. 2022 eq. 1) times int8 weights through ``torch._int_mm`` (int32 accumulation), used
  when there are enough rows for the integer GEMM to beat the W8A16 path; fewer rows go to W8A16.

* FP8 weights (`Fp8DequantKernel`): E4M3/E5M2 codes; each call decodes and scales them into a bf16 weight
  in one compiled pass (a table of the 256 code values) and runs a bf16 matmul (a dequantise-then-multiply
  path; torch's own float8 -> bf16 cast is ~4x slower on CPU).

The operators need bf16 activations to be fast (fp32 activations fall into a slow generic loop), so
inputs are cast to bf16 and the result back to the input dtype.  Each kernel's `supports(fmt, shape)`
returns None or the reason it cannot run; the operators crash the process (not raise) on shapes they
do not handle, so these checks are strict.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit

from fewbits.formats.format import Format
from fewbits.kernels import ops
from fewbits.tensor import QuantizedTensor

INT4_GROUPS = (256, 128, 64, 32)  # group sizes the int4 CPU operator accepts, largest first
W8A8_MIN_ROWS = 16  # below this many rows of x, W8A16 is faster than quantising the activations


def _has(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def _op(name: str):  # the resolved overload: calling it skips torch.ops' per-call name lookup (~10 us)
    return getattr(torch.ops.aten, name).default if _has(name) else None


_INT8_MM = _op("_weight_int8pack_mm")
_INT4_MM = _op("_weight_int4pack_mm_for_cpu")


def _int_offset(qt: QuantizedTensor) -> torch.Tensor:
    """Offset o of the codes (w = s * (c - o)): the zero points, or 2^(bits-1) for symmetric codes."""
    z = qt.zero_values()
    if z is None:
        return torch.full((qt.rows, 1), float(2 ** (qt.fmt.bits - 1)))
    return z


def _as_bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) as a (M, K) bf16 matrix, without copies when it already is one."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Add the bias and restore x's leading dimensions: (M, N) -> (..., N)."""
    if bias is not None:
        y = y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _per_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, 1) or (1, 1) per-channel/per-tensor values -> (rows,)."""
    return t.reshape(-1).expand(rows).contiguous() if t.numel() == 1 else t.reshape(rows)


class Int8PackKernel:
    """int8 weights (per channel or per tensor, symmetric or asymmetric) x bf16 activations."""

    name = "cpu_int8pack"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if not _has("_weight_int8pack_mm"):
            return "torch has no aten._weight_int8pack_mm"
        if fmt.kind != "int" or fmt.bits != 8:
            return f"needs 8-bit integer codes, format is {fmt.spec}"
        if fmt.granularity not in ("channel", "tensor"):
            return f"needs one scale per channel or tensor, {fmt.spec} has groups"
        if len(shape) != 2 or shape[1] % 16:
            return f"needs in_features divisible by 16, weight shape is {tuple(shape)}"
        return None

    def __init__(self, qt: QuantizedTensor) -> None:
        rows, _ = qt.shape
        codes = qt.unpacked_codes().to(torch.int16)
        self.q = (codes - 128).to(torch.int8).contiguous()  # (N, K), w = s * (q + 128 - o)
        s = _per_row(qt.scale_values(), rows)  # (N,) fp32
        self.scales = s.to(torch.bfloat16)
        off = _per_row(_int_offset(qt), rows)
        self.corr = None if bool((off == 128).all()) else ((128 - off) * s).float()  # (N,)
        self.shape = qt.shape

    @property
    def nbytes(self) -> int:
        extra = 0 if self.corr is None else self.corr.numel() * 4
        return self.q.numel() + self.scales.numel() * 2 + extra

    def unpacked_codes(self) -> torch.Tensor:
        """The codes as the quantised tensor holds them, uint8 (N, K) (q + 128): this kernel is their only copy
        in a `QuantLinear` (`fewbits.models.qlinear`)."""
        return (self.q.to(torch.int16) + 128).to(torch.uint8)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = _as_bf16_rows(x)  # (M, K)
        if torch.compiler.is_compiling():  # one opaque node of the compiled graph
            y = ops.int8pack_mm(x2, self.q, self.scales)
        else:
            y = _INT8_MM(x2, self.q, self.scales)  # (M, N) bf16
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.corr is not None:
            y = y + x2.float().sum(-1, keepdim=True).to(x.dtype) * self.corr.to(x.dtype)
        return _finish(y, x, bias)


def int4_op_group(fmt: Format, in_features: int) -> int | None:
    """The operator group size that represents `fmt` exactly on `in_features` columns, or None: the group
    itself where the operator takes it, else the largest operator group that divides it (each scale then
    repeated: g512 as two groups of 256, a regrouped g96 as three of 32)."""
    if fmt.granularity == "group":
        g = fmt.group_size
        return next((h for h in INT4_GROUPS if g % h == 0 and in_features % h == 0), None)
    return next((h for h in INT4_GROUPS if in_features % h == 0), None)


class Int4PackKernel:
    """2-, 3- and 4-bit integer codes in groups (or per channel) x bf16 activations."""

    name = "cpu_int4pack"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if not (_has("_weight_int4pack_mm_for_cpu") and _has("_convert_weight_to_int4pack_for_cpu")):
            return "torch has no aten._weight_int4pack_mm_for_cpu"
        if fmt.kind != "int" or fmt.bits > 4:
            return f"needs integer codes of at most 4 bits, format is {fmt.spec}"
        if len(shape) != 2:
            return f"needs a 2-D weight, shape is {tuple(shape)}"
        if shape[0] % 16:
            return f"needs out_features divisible by 16, weight shape is {tuple(shape)}"
        if int4_op_group(fmt, shape[1]) is None:
            return (f"group size of {fmt.spec} on in_features {shape[1]} is not one of the operator's "
                    f"{INT4_GROUPS} (nor a multiple of one that divides in_features)")
        return None

    def __init__(self, qt: QuantizedTensor) -> None:
        rows, cols = qt.shape
        g = int4_op_group(qt.fmt, cols)
        assert g is not None
        codes = qt.unpacked_codes().to(torch.int32)  # (N, K) in [0, 2^bits)
        s = qt.scale_values().float()  # (N, n_groups) or (1, 1)
        o = _int_offset(qt).float()
        if s.numel() == 1:
            s = s.expand(rows, 1)
            o = o.expand(rows, 1)
        # shift the codes by an integer k so that c' = c - k + 8 fits the operator's [0, 15]: for <= 3-bit
        # codes k = round(o) leaves m = (k - o) * s zero (integer o) or under half a step (float o), so the
        # bf16 table rounds a small number instead of (8 - o) * s (2^-9 relative error per group)
        k = torch.round(o).clamp(2**qt.fmt.bits - 8, 8)  # (N, n_groups); 4-bit codes: k = 8
        k_full = k.repeat_interleave(cols // k.shape[1], dim=1)  # (N, K)
        codes = (codes - k_full.to(torch.int32) + 8).contiguous()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        m = (k - o) * s  # (N, n_groups): w = (c' - 8) * s + m
        rep = cols // g // s.shape[1]  # operator groups per format group
        s = s.repeat_interleave(rep, dim=1)  # (N, K/g)
        m = m.repeat_interleave(rep, dim=1)
        self.scales_zeros = torch.stack([s, m], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.group = g
        self.shape = qt.shape

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = _as_bf16_rows(x)  # (M, K)
        if torch.compiler.is_compiling():  # one opaque node of the compiled graph
            y = ops.int4pack_mm(x2, self.packed, self.group, self.scales_zeros)
        else:
            y = _INT4_MM(x2, self.packed, self.group, self.scales_zeros)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return _finish(y, x, bias)


class W8A8IntMMKernel:
    """Symmetric per-channel int8 weights x dynamically quantised per-token int8 activations."""

    name = "cpu_w8a8_int_mm"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if not hasattr(torch, "_int_mm"):
            return "torch has no _int_mm"
        if fmt.kind != "int" or fmt.bits != 8 or not fmt.symmetric or fmt.granularity == "group":
            return f"needs symmetric per-channel int8 weights, format is {fmt.spec}"
        return Int8PackKernel.supports(fmt, shape)

    def __init__(self, qt: QuantizedTensor, min_rows: int = W8A8_MIN_ROWS) -> None:
        from fewbits.kernels.cpu_rows import Int8RowsKernel

        # decode-sized inputs: W8A16, on the few-row operator where it is built
        rows = Int8RowsKernel.supports(qt.fmt, tuple(qt.shape)) is None
        self.small = Int8RowsKernel(qt) if rows else Int8PackKernel(qt)
        self.qT = self.small.q.t()  # (K, N) view, column-major as _int_mm prefers
        self.scales = _per_row(qt.scale_values(), qt.shape[0]).float()  # (N,)
        self.min_rows = min_rows
        self.shape = qt.shape

    @property
    def nbytes(self) -> int:
        return self.small.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] < self.min_rows:
            return self.small(x, bias)
        xf = x2.float()
        sx = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)  # (M, 1) per-token scale
        xq = torch.round(xf / sx).clamp_(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.qT)  # (M, N) int32
        y = (acc.float() * sx * self.scales).to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y.reshape(*lead, y.shape[-1])


_FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_SCRATCH = threading.local()  # per thread: {weight shape: bf16 buffer} for the fp8 decode


@njit(cache=True, nogil=True)
def _fp8_dequantize_bits(w8: np.ndarray, lut: np.ndarray, scales: np.ndarray, group: int, out: np.ndarray) -> None:
    """out[n, k] = the bf16 bits of lut[w8[n, k]] * scales[n (or 0), k // group], rounded to nearest even.

    lut holds the exact value of every code and scales the bf16 scales as float32, so the float32 product
    is exact (at most 4 + 8 significant bits) and one rounding gives the bf16 that multiplying the two as
    bf16 tensors gives."""
    N, K = w8.shape
    per_row = scales.shape[0] > 1
    tmp = np.empty(K, dtype=np.float32)
    bits = tmp.view(np.uint32)
    for n in range(N):
        srow = scales[n if per_row else 0]
        codes = w8[n]
        for g in range(K // group):
            sg = srow[g]
            for k in range(g * group, (g + 1) * group):
                tmp[k] = lut[codes[k]] * sg
        o = out[n]
        for k in range(K):
            b = bits[k]
            o[k] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


class Fp8DequantKernel:
    """FP8 (E4M3/E5M2) weights: each call decodes and scales the codes into a bf16 weight, then a bf16
    matmul.  The decoding is one compiled pass (a table of the 256 code values, times the scale, rounded
    once) into a buffer kept per weight shape and thread: a decode from torch operations made a handful
    of weight-sized temporaries per call, and their page faults took the SmolLM2 fp8 linears of one
    decode step from ~205 to 240-400 ms here, depending on the allocator's state."""

    name = "cpu_fp8_dequant"

    @staticmethod
    def supports(fmt: Format, shape: tuple[int, ...]) -> str | None:
        if fmt.kind != "fp8" or fmt.element not in _FP8_DTYPES:
            return f"needs fp8 codes, format is {fmt.spec}"
        if not hasattr(torch, _FP8_DTYPES[fmt.element]):
            return f"torch has no {_FP8_DTYPES[fmt.element]}"
        if len(shape) != 2:
            return f"needs a 2-D weight, shape is {tuple(shape)}"
        return None

    def __init__(self, qt: QuantizedTensor) -> None:
        self.element = qt.fmt.element
        self.w8 = qt.unpacked_codes().contiguous()  # (N, K) uint8, one byte per weight
        s = qt.scale_values().float()  # (N, n_groups) or (1, 1)
        self.groups = 1 if s.numel() == 1 else s.shape[1]
        self.shape = tuple(qt.shape)
        # the scales as bf16 (what a bf16 multiply would use), held as float32 for the compiled pass
        self.scales = s.to(torch.bfloat16).float().reshape(-1, self.groups).contiguous()
        every = torch.arange(256, dtype=torch.uint8).view(getattr(torch, _FP8_DTYPES[self.element]))
        self.lut_t = every.float()  # the exact value of each code
        self.lut = self.lut_t.numpy()

    @property
    def nbytes(self) -> int:
        return self.w8.numel() + self.scales.numel() * 2

    def weight(self) -> torch.Tensor:
        """The dequantised bf16 weight (N, K), in this thread's buffer for the shape."""
        return fp8_weight(self.w8, self.lut, self.scales, self.shape[1] // self.groups)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # numba is opaque to the compiler: one registered operator
            x2 = _as_bf16_rows(x)
            y = ops.fp8_dequant_mm(x2, self.w8, self.lut_t, self.scales, self.shape[1] // self.groups)
            y = _finish(y if y.dtype == x.dtype else y.to(x.dtype), x, None)
        else:
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight()).to(x.dtype)
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y


def fp8_weight(w8: torch.Tensor, lut: np.ndarray, scales: torch.Tensor, group: int) -> torch.Tensor:
    """FP8 codes w8 (N, K) decoded through `lut` and scaled per (row, group) into this thread's bf16 buffer
    for the shape (valid until the next call for the same shape on this thread)."""
    shape = tuple(w8.shape)
    buffers = _SCRATCH.__dict__.setdefault("fp8", {})
    buf = buffers.get(shape)
    if buf is None:
        buf = buffers[shape] = torch.empty(shape, dtype=torch.bfloat16)
    _fp8_dequantize_bits(w8.numpy(), lut, scales.numpy(), group, buf.view(torch.int16).numpy().view(np.uint16))
    return buf
