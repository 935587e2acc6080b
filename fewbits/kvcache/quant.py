"""Quantise and dequantise blocks of keys and values (pure functions over tensors).

Shapes: x is (B, H, T, D) = (batch, KV heads, tokens, head dim).  Scales are stored as fp16.

- per token (fp8-e4m3, int8): one absmax scale per (b, h, t):  s = amax_d |x| / q_max,
  codes = round(x / s) (int8) or E4M3(x / s) (fp8);  x^ = codes * s.
- KIVI keys, per channel (Liu et al. 2024, eq. 2 applied along tokens): T is a multiple of the group G;
  for each group of G tokens and each channel d, min-max:  s = (max - min) / (2^b - 1), m = min,
  codes = round((x - m) / s) in [0, 2^b - 1];  x^ = codes * s + m.
- KIVI values, per token: the same min-max over groups of G channels of one token.
Integer codes of 2/4 bits are packed along D (formats/packing.py layout).
"""

from __future__ import annotations

import torch

from fewbits.formats.packing import pack_bits, unpack_bits

FP8_MAX = 448.0
TINY = 2.0**-24  # smallest positive fp16 (subnormal): scales never round to zero


def _fp16_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales as fp16, never zero (an all-zero block gets scale 1)."""
    s16 = s.to(torch.float16)
    return torch.where(s16 > 0, s16, torch.ones_like(s16))


def int8_token_scale(xf: torch.Tensor) -> torch.Tensor:
    """fp32 (..., D) -> the fp16 scale (..., 1) of `quant_int8_per_token`."""
    return _fp16_scale(xf.abs().amax(-1, keepdim=True) / 127)


def int8_codes(xf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 (..., D) and its fp16 scale (..., 1) -> int8 codes."""
    return torch.round(xf / s.float()).clamp_(-127, 127).to(torch.int8)


def quant_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> codes int8 (..., D), scale fp16 (..., 1)."""
    xf = x.float()
    s = int8_token_scale(xf)
    return int8_codes(xf, s), s


def dequant_int8_per_token(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in (torch.bfloat16, torch.float16):  # codes are exact in 16 bits; one pass, no fp32 copy
        return codes.to(dtype) * scale.to(dtype)
    return (codes.float() * scale.float()).to(dtype)


def fp8_token_scale(xf: torch.Tensor) -> torch.Tensor:
    """fp32 (..., D) -> the fp16 scale (..., 1) of `quant_fp8_per_token`."""
    return _fp16_scale((xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(TINY))


def fp8_codes(xf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 (..., D) and its fp16 scale (..., 1) -> E4M3 bit patterns (uint8)."""
    return (xf / s.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) -> E4M3 bit patterns uint8 (..., D), scale fp16 (..., 1)."""
    xf = x.float()
    s = fp8_token_scale(xf)
    return fp8_codes(xf, s), s


def e4m3_as_bf16_bits(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 bit patterns (uint8) -> bf16 values 2^-120 times the E4M3 values, by moving bits.

    E4M3 s.eeee.mmm maps to bf16 s.0000eeee.mmm0000: the exponent bias differs by 127 - 7 = 120, so the
    bf16 number is the E4M3 value / 2^120 (E4M3 subnormals become bf16 subnormals, exactly).  Much faster
    on CPU than torch's float8 -> bf16 cast; the 2^120 goes into the scale.  (NaN codes never occur:
    the quantiser saturates at +-448.)
    """
    u = codes.to(torch.int16)
    return (((u & 0x80) << 8) | ((u & 0x7F) << 4)).view(torch.bfloat16)


def dequant_fp8_per_token(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return e4m3_as_bf16_bits(codes) * (scale.float() * 2.0**120).to(torch.bfloat16)
    return (codes.view(torch.float8_e4m3fn).float() * scale.float()).to(dtype)


def _minmax_codes(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max codes of x along `dim`: codes uint8 (shape of x), scale and min fp16 (dim kept as 1)."""
    qmax = 2**bits - 1
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    s = _fp16_scale((hi - lo) / qmax)
    m = lo.to(torch.float16)
    codes = torch.round((x - m.float()) / s.float()).clamp_(0, qmax).to(torch.uint8)
    return codes, s, m


def quant_kivi_keys(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys (B, H, T, D), T a multiple of `group` -> packed codes (B, H, T, D*bits/8) uint8,
    scale and min (B, H, T/group, D) fp16 (one per channel per group of tokens)."""
    B, H, T, D = x.shape
    g = x.float().reshape(B, H, T // group, group, D)  # (B, H, groups, G, D)
    codes, s, m = _minmax_codes(g, 3, bits)
    packed = pack_bits(codes.reshape(B, H, T, D), bits)
    return packed, s.squeeze(3), m.squeeze(3)


def unpack_small(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """2- or 4-bit codes packed along the last dim (formats/packing.py layout) -> uint8, 8/bits per byte."""
    if bits == 4:
        parts = [packed & 15, packed >> 4]
    elif bits == 2:
        parts = [packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6]
    else:
        return unpack_bits(packed, bits, packed.shape[-1] * 8 // bits)
    return torch.stack(parts, -1).reshape(*packed.shape[:-1], -1)


def _affine(c: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """c * scale + min in `dtype` (fp32 arithmetic for fp32, else one fused 16-bit pass)."""
    work = torch.float32 if dtype == torch.float32 else dtype
    return torch.addcmul(minv.to(work), c.to(work), scale.to(work)).to(dtype)


def dequant_kivi_keys(packed: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bits: int, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    B, H, T, _ = packed.shape
    D = scale.shape[-1]
    c = unpack_small(packed, bits).reshape(B, H, T // group, group, D)
    x = _affine(c, scale.unsqueeze(3), minv.unsqueeze(3), dtype)
    return x.reshape(B, H, T, D)


def quant_kivi_values(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values (B, H, T, D), D a multiple of `group` -> packed codes (B, H, T, D*bits/8) uint8,
    scale and min (B, H, T, D/group) fp16 (one per token per group of channels)."""
    B, H, T, D = x.shape
    g = x.float().reshape(B, H, T, D // group, group)  # (B, H, T, groups, G)
    codes, s, m = _minmax_codes(g, 4, bits)
    packed = pack_bits(codes.reshape(B, H, T, D), bits)
    return packed, s.squeeze(4), m.squeeze(4)


def dequant_kivi_values(packed: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bits: int, group: int,
                        dtype: torch.dtype) -> torch.Tensor:
    B, H, T, _ = packed.shape
    n_groups = scale.shape[-1]
    D = n_groups * group
    c = unpack_small(packed, bits).reshape(B, H, T, n_groups, group)
    x = _affine(c, scale.unsqueeze(-1), minv.unsqueeze(-1), dtype)
    return x.reshape(B, H, T, D)
