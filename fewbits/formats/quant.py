"""Quantise and dequantise a 2-D weight (rows = output channels, cols = input features) for any Format.

Three steps that methods can use separately (GPTQ picks its codes column by column with fixed scales):

    scale, zero = compute_scales(w2d, fmt)          # (rows, n_groups), zero None when symmetric
    codes = quantize_codes(w2d, scale, zero, fmt)   # uint8 (rows, cols), unpacked
    w_hat = dequantize_codes(codes, scale, zero, fmt)

Scales are returned as float32 values already rounded to the precision they are stored in (fp16, bf16,
E8M0 powers of two, E4M3 block scales times the FP32 tensor scale), so codes and dequantisation agree
exactly with what a `QuantizedTensor` holds.

Integer codes are unsigned: symmetric b-bit codes store q + 2^(b-1).  On the full grid (the default)
q lies in [-2^(b-1), 2^(b-1)-1] and the scale is signed, s = x_e / -2^(b-1) for the group's value x_e of
largest magnitude (the first one on a tie), so x_e gets q = -2^(b-1) whatever its sign; on the narrow grid
(`-narrow`) q lies in [-L, L], L = 2^(b-1)-1, with the absmax scale s = max|w| / L.  Asymmetric codes store
round(w/s) + z in [0, 2^b-1] with s = (max - min) / (2^b - 1), z = round(-min / s) (min-max with the
range widened to include 0).

Round-to-nearest of symmetric integers (`round_to_nearest`) is llama.cpp's reference quantiser on both
grids, so that fewbits' RTN is byte-exact with GGUF's: codes are taken from the scale before it is rounded
to its storage dtype, multiplying by its reciprocal, with ties away from zero (ggml's quantize_row_q4_0:
floor(x / d + 8.5), d = x_e / -8; quantize_row_q8_0: roundf(x / d), d = max|x| / 127); the stored scale is
d rounded to the scale dtype.  `quantize_codes` rounds against a given (stored) scale, half to even, as
methods that choose their own scales need.

Floating zero points (`-zfp16` formats): the same decoding w = (c - z) * s, but z is any float, rounded
to its storage dtype.  Round-to-nearest then takes the group's exact range (no widening to include 0):
s = (max - min) / (2^b - 1) and z = -min / s, so the codes 0 and 2^b - 1 decode to min and max (up to the
rounding of s and z); codes are c = clamp(round(w / s + z), 0, 2^b - 1).  This is GGUF Q4_1's
w = c * d + m with d = s and m = -z * s, written in HQQ's zero-point form.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fewbits.formats import ggml
from fewbits.formats.format import Format, FormatError, parse_format
from fewbits.formats.grids import (
    E2M1,
    E4M3,
    MINIFLOATS,
    e8m0_exponent,
    from_codes,
    nf4_round,
    nf4_values,
    round_minifloat,
    to_codes,
)

#: largest |zero point| compute_scales lets an fp16 zero reach (fp16's largest finite value is 65504)
FP16_ZERO_LIMIT = 2.0**14
_TORCH_SCALE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def all_finite(x: torch.Tensor) -> bool:
    """True when x holds no NaN or inf.  The extremes propagate NaN and show inf, so one min/max reduction
    answers it; ~10x cheaper than ``torch.isfinite(x).all()``, which writes a mask as large as x."""
    if x.numel() == 0 or not (x.is_floating_point() or x.is_complex()):
        return True
    lo, hi = torch.aminmax(x.detach().reshape(-1))
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (exact reference experiments), everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def n_groups(fmt: Format, cols: int) -> int:
    """Scales per row: cols / group size, 1 per channel (per tensor: one for the whole tensor)."""
    return cols // fmt.group_size if fmt.granularity == "group" else 1


def _grouped(w2d: torch.Tensor, fmt: Format) -> torch.Tensor:
    """(rows, cols) -> (rows, n_groups, group) for group/channel, (1, 1, rows*cols) per tensor."""
    rows, cols = w2d.shape
    if fmt.granularity == "tensor":
        return w2d.reshape(1, 1, rows * cols)
    return w2d.reshape(rows, n_groups(fmt, cols), -1)


def _expand(s: torch.Tensor, w2d: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Broadcast a (rows, n_groups) tensor of per-group values to (rows, n_groups, group)."""
    return s.unsqueeze(-1)


def elem_max(fmt: Format) -> float:
    """Largest magnitude of a code of the element grid before scaling (the end code -2^(b-1) on the full
    integer grid, L = 2^(b-1)-1 on the narrow one)."""
    if fmt.kind == "int":
        return float(-fmt.qmin)
    if fmt.kind in ("fp8", "mxfp8"):
        return MINIFLOATS[fmt.element].max
    if fmt.kind in ("fp4", "mxfp4", "nvfp4"):
        return E2M1.max
    if fmt.kind == "nf4":
        return 1.0
    raise FormatError(f"format {fmt.spec} is not quantised")


def round_zero(z: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round float zero points to `fmt.zero_dtype` (float formats); integer zeros are left as given."""
    if fmt.float_zeros:
        return z.to(_TORCH_SCALE[fmt.zero_dtype]).to(_work_dtype(z))
    return z


class ScaleRangeError(FormatError):
    """Scales that the format's scale dtype cannot hold (inf, or 0 for a group that is not all zero)."""


def check_scale_range(raw: torch.Tensor, rounded: torch.Tensor, fmt: Format) -> None:
    """Raise ScaleRangeError when a scale overflowed to inf/NaN in `fmt.scale_dtype`, or a nonzero scale
    (negative ones too: the full grid's) underflowed to 0 (its group would decode to zeros): either would
    store a silently wrong weight."""
    over = ~torch.isfinite(rounded)
    under = (rounded == 0) & (raw != 0)
    if not (bool(over.any()) or bool(under.any())):
        return
    wider = "fp32" if fmt.scale_dtype in ("fp16", "bf16", "e4m3") else None
    hint = (f"use a wider scale dtype (-s{wider}, e.g. {replace(fmt, scale_dtype=wider).spec})" if wider
            else "no scale dtype holds it; rescale the weights")
    if bool(over.any()):
        big = float(raw[over].abs().max()) if bool(torch.isfinite(raw[over]).any()) else float("inf")
        raise ScaleRangeError(f"{int(over.sum())} scale(s) overflow {fmt.scale_dtype} (largest {big:.3g}, weights "
                              f"too large for format {fmt.spec}); {hint}")
    small = float(raw[under].abs().min())
    raise ScaleRangeError(f"{int(under.sum())} scale(s) underflow to 0 in {fmt.scale_dtype} (smallest {small:.3g}: "
                          f"groups of tiny nonzero weights would decode to 0 in format {fmt.spec}); {hint}")


def round_scale(s: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Round float scales to the precision of `fmt.scale_dtype`; zeros become 1 (all-zero groups).
    Scales the dtype cannot hold raise ScaleRangeError (`check_scale_range`)."""
    raw = s
    if fmt.scale_dtype in _TORCH_SCALE:
        s = s.to(_TORCH_SCALE[fmt.scale_dtype]).to(_work_dtype(s))
    elif fmt.scale_dtype == "e4m3":
        s = round_minifloat(s, E4M3, saturate=True)
    check_scale_range(raw, s, fmt)
    return torch.where(s == 0, torch.ones_like(s), s)


def nvfp4_tensor_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 per-tensor FP32 scale: amax / (6 * 448), so block scales use E4M3's whole range."""
    amax = w.detach().abs().max().float()
    ts = amax / (E2M1.max * E4M3.max)
    return torch.where(ts == 0, torch.ones_like(ts), ts)


def signed_extreme(g: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude of each group (rows, n_groups, group) -> (rows, n_groups), with its
    sign; the first one when +x and -x share it (as ggml's quantisers pick it)."""
    lo, hi = g.amin(-1), g.amax(-1)
    ext = torch.where(hi >= -lo, hi, lo)
    tie = (hi == -lo) & (hi != 0)  # rare: look for which of the two comes first
    if bool(tie.any()):
        first = g[tie].abs().argmax(-1, keepdim=True)  # torch returns the first maximal index
        ext[tie] = g[tie].gather(-1, first).squeeze(-1)
    return ext


def compute_scales(
    w2d: torch.Tensor, fmt: Format | str, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales (and zero points) of round-to-nearest for `w2d`: float32 (rows, n_groups), (1, 1) per tensor.

    Zero points are float32 integers in [0, 2^b-1] for asymmetric integer formats, any float (rounded
    to the zero dtype) for formats with floating zeros, else None.
    """
    fmt = parse_format(fmt)
    if fmt.kind == "ggml":  # llama.cpp block types: the "scales" are each block's header bytes (formats/ggml.py)
        return ggml.quantize(w2d, fmt)[1].float(), None
    g = _grouped(w2d.detach(), fmt)  # reductions run in the input dtype; only their results are cast
    wd = _work_dtype(w2d)
    if fmt.float_zeros:  # exact group range: s = (max - min) / (2^b - 1), z = -min / s
        lo, hi = g.amin(-1).to(wd), g.amax(-1).to(wd)
        s = (hi - lo) / (2**fmt.bits - 1)
        if fmt.zero_dtype == "fp16":  # a near-constant group far from 0: keep |z| = |min| / s finite in fp16
            s = torch.maximum(s, lo.abs() / FP16_ZERO_LIMIT)
        s = round_scale(s, fmt)
        return s, round_zero(-lo / s, fmt)
    lo = g.amin(-1).to(wd).clamp(max=0)
    hi = g.amax(-1).to(wd).clamp(min=0)
    if fmt.kind == "int" and not fmt.symmetric:
        qmax = 2**fmt.bits - 1
        s = round_scale((hi - lo) / qmax, fmt)
        z = torch.round(-lo / s).clamp(0, qmax)
        return s, z
    if fmt.kind == "int" and fmt.grid == "full":
        return round_scale(signed_extreme(g).to(wd) / fmt.qmin, fmt), None
    amax = torch.maximum(hi, -lo)
    if fmt.kind in ("mxfp4", "mxfp8"):
        return torch.exp2(e8m0_exponent(amax, MINIFLOATS[fmt.element])), None
    if fmt.kind == "nvfp4":
        ts = nvfp4_tensor_scale(w2d) if tensor_scale is None else tensor_scale.float()
        block = round_minifloat(amax / E2M1.max / ts, E4M3, saturate=True)
        block = torch.where(block == 0, torch.ones_like(block), block)
        return block * ts, None
    return round_scale(amax / elem_max(fmt), fmt), None


def quantize_codes(
    w2d: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format | str
) -> torch.Tensor:
    """Codes (uint8, (rows, cols), unpacked) of `w2d` under the given scales and zero points."""
    fmt = parse_format(fmt)
    rows, cols = w2d.shape
    if fmt.kind == "ggml":  # llama.cpp chooses codes and block headers together
        codes, header = ggml.quantize(w2d, fmt)
        if not torch.equal(header.float(), scale.float().reshape(header.shape)):
            raise FormatError(f"{fmt.spec}: codes are chosen with their block headers; these headers are not "
                              f"the ones round-to-nearest gives")
        return codes
    g = _grouped(w2d.detach(), fmt)
    x = g.to(_work_dtype(g)) / scale.unsqueeze(-1)  # (rows, n_groups, group)
    if fmt.kind == "int" and zero is not None and fmt.float_zeros:  # the zero is not an integer: add, then round
        codes = torch.round(x.add_(zero.unsqueeze(-1))).clamp_(0, 2**fmt.bits - 1).to(torch.uint8)
    elif fmt.kind == "int":
        torch.round(x, out=x)
        if fmt.symmetric:
            x.clamp_(fmt.qmin, fmt.qmax).add_(2 ** (fmt.bits - 1))
        else:
            x.add_(zero.unsqueeze(-1)).clamp_(0, 2**fmt.bits - 1)
        codes = x.to(torch.uint8)
    elif fmt.kind == "nf4":
        codes = nf4_round(x.clamp(-1, 1))
    else:
        codes = to_codes(x, MINIFLOATS[fmt.element])
    return codes.reshape(rows, cols)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: Format | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float values (rows, cols) of codes under the given scales and zero points."""
    fmt = parse_format(fmt)
    if fmt.kind == "ggml":  # `scale` holds the block header bytes
        return ggml.dequantize(codes, scale.to(torch.uint8), fmt, dtype)
    rows, cols = codes.shape
    c = _grouped(codes, fmt)
    if fmt.kind == "int":
        v = c.to(scale.dtype if scale.dtype == torch.float64 else torch.float32)
        v.sub_(zero.unsqueeze(-1) if zero is not None else 2 ** (fmt.bits - 1))
    elif fmt.kind == "nf4":
        v = nf4_values(c)
    else:
        v = from_codes(c, MINIFLOATS[fmt.element])
    return v.mul_(scale.unsqueeze(-1)).reshape(rows, cols).to(dtype)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View any tensor as (rows, last dim); a 1-D tensor is one row."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 1 else x.reshape(1, -1)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero), in the steps of gguf-py's np_roundf so that float rounding agrees."""
    a = x.abs()
    f = torch.floor(a)
    return a.sub_(f).mul_(2).floor_().add_(f).copysign_(x)


def round_to_nearest(
    w2d: torch.Tensor, fmt: Format | str, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest of `w2d` (rows, cols): (codes, scale, zero) as `quantize_codes` and
    `compute_scales` lay them out.

    Symmetric integers follow llama.cpp's reference quantisers (module docstring): the codes come from
    the unrounded scale d (float32, float64 for float64 input) times 1 / d.  Where d rounds to zero in its
    storage dtype (the stored scale is then 1), the codes are taken against the stored scale instead.
    Every other format: `compute_scales` then `quantize_codes`.
    """
    fmt = parse_format(fmt)
    if not fmt.sym_int:
        scale, zero = compute_scales(w2d, fmt, tensor_scale)
        return quantize_codes(w2d, scale, zero, fmt), scale, zero
    rows, cols = w2d.shape
    g = _grouped(w2d.detach(), fmt).to(_work_dtype(w2d))  # (rows, n_groups, group)
    if fmt.grid == "full":
        d = signed_extreme(g) / fmt.qmin
    else:
        d = g.abs().amax(-1) / fmt.qmax
    scale = round_scale(d, fmt)
    d = torch.where(d.to(_TORCH_SCALE.get(fmt.scale_dtype, d.dtype)) == 0, scale, d)
    x = g * torch.reciprocal(d).unsqueeze(-1)  # (rows, n_groups, group); x / d in ggml's steps
    off = 2 ** (fmt.bits - 1)
    if fmt.grid == "full":  # floor(x + off + 1/2) = round half up; x + off + 1/2 >= 1/2, so trunc = floor
        q = x.add_(off + 0.5).floor_().clamp_(0, 2**fmt.bits - 1)
    else:
        q = _roundf(x).clamp_(fmt.qmin, fmt.qmax).add_(off)
    return q.to(torch.uint8).reshape(rows, cols), scale, None


def fake_quantize(w: torch.Tensor, fmt: Format | str) -> torch.Tensor:
    """Round-to-nearest quantise then dequantise; same shape and dtype as `w`."""
    fmt = parse_format(fmt)
    if not fmt.is_quantized:
        return w.to(_TORCH_SCALE.get(fmt.element, torch.float32)).to(w.dtype)
    fmt.check_shape(tuple(w.shape))
    w2d = as_2d(w)
    if fmt.kind == "ggml":
        codes, header = ggml.quantize(w2d, fmt)
        return ggml.dequantize(codes, header, fmt, w.dtype).reshape(w.shape)
    codes, scale, zero = round_to_nearest(w2d, fmt)
    return dequantize_codes(codes, scale, zero, fmt, dtype=w.dtype).reshape(w.shape)
