"""llama.cpp's block types (Q4_0 ... Q6_K): quantise, dequantise, and the bytes of a GGUF block.

Storage in a `QuantizedTensor` (format kind "ggml", see ggml_types.py for the table):
    codes   the unsigned codes, packed as every fewbits format packs them (one bit stream per row)
    scales  uint8 (rows, blocks per row * header_bytes): each block's header bytes as GGUF stores them
            (d [, m] for the 32-weight types; d, dmin, 12 bytes of 6-bit scales and mins for Q4_K / Q5_K;
            16 int8 scales then d for Q6_K)
so `nbytes` is exactly the GGUF tensor's size and `to_gguf_blocks` only reorders the codes.

Dequantisation computes s * (c - offset) [+ m] in float32 in the order gguf-py's `dequantize_blocks` does,
so the values are bit for bit the ones gguf-py (and llama.cpp's reference) produce.

Round-to-nearest follows llama.cpp's reference quantisers (ggml-quants.c, `quantize_row_*_ref`; the same
arithmetic as gguf-py's `quants.quantize` for the 32-weight types): absmax or min-max per block for the
32-weight types, and for the K-quants the per-sub-block searches `make_qkx2_quants` (Q4_K, Q5_K: a
weighted least-squares fit of scale and min over 20 / 15 candidate grids) and `make_qx_quants` (Q6_K:
19 candidate scales), then 6- or 8-bit sub-block scales under one fp16 super-block scale.  Every sum is
accumulated element by element in float32, as the C loops do, so that ties and near-ties round the same
way; `nearest_int` is round-half-even, as torch.round.
"""

from __future__ import annotations

import numpy as np
import torch

from fewbits.formats.format import Format, FormatError
from fewbits.formats.ggml_types import GGML_TYPES, GGMLType

F32 = torch.float32


def gtype(fmt: Format) -> GGMLType:
    if fmt.kind != "ggml":
        raise FormatError(f"{fmt.spec} is not a llama.cpp block type")
    return GGML_TYPES[fmt.element]


def _f32(v: float) -> torch.Tensor:
    """A float32 scalar, so that constants such as 0.1f enter the arithmetic rounded as C rounds them."""
    return torch.tensor(np.float32(v), dtype=F32)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 (...,) -> fp16 (round to nearest even) as 2 little-endian bytes (..., 2)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(*v.shape, 2)


def _fp16_from(b: torch.Tensor) -> torch.Tensor:
    """2 bytes (..., 2) -> float32 (...,)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _seq_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension one element after another (the C loops' order), float32."""
    acc = terms[..., 0].clone()
    for i in range(1, terms.shape[-1]):
        acc = acc + terms[..., i]
    return acc


# ---------------------------------------------------------------------- the 32-weight types
def _quantize_legacy(x: torch.Tensor, t: GGMLType) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, 32) float32 -> codes (n, 32) uint8, header (n, header_bytes) uint8."""
    if t.has_min:  # Q4_1 / Q5_1: d = (max - min) / (2^b - 1), codes from the unrounded d
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        d = (hi - lo) / (2**t.bits - 1)
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        c = torch.trunc((x - lo) * inv + _f32(0.5)).clamp(0, 2**t.bits - 1)
        return c.to(torch.uint8), torch.cat([_fp16_bytes(d[:, 0]), _fp16_bytes(lo[:, 0])], 1)
    if t.name == "q8_0":  # d = amax / 127, codes roundf (half away from zero)
        d = x.abs().amax(1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        v = x * inv
        c = _roundf(v)
        return (c + 128).to(torch.uint8), _fp16_bytes(d[:, 0])
    # Q4_0 / Q5_0: the signed extreme maps to -2^(b-1): d = max / -2^(b-1), c = trunc(x / d + 2^(b-1) + 0.5)
    half = 2 ** (t.bits - 1)
    mx = torch.gather(x, 1, x.abs().argmax(1, keepdim=True))  # first largest magnitude, with its sign
    d = mx / -half
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    c = torch.trunc(x * inv + _f32(half + 0.5)).clamp(0, 2**t.bits - 1)
    return c.to(torch.uint8), _fp16_bytes(d[:, 0])


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (gguf-py's np_roundf)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.sign(v) * (fl + torch.floor(2 * (a - fl)))


# ---------------------------------------------------------------------- K-quant searches
def _make_qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-quants.c make_qkx2_quants over sub-blocks x, w (m, n): (scale (m,), the_min (m,) >= 0, L (m, n))
    with x ~ scale * L - the_min; candidate grids (rmin + rdelta * is + nmax) / (max - min), is = 0..nstep,
    each refitted by weighted least squares, the best weighted squared error kept."""
    lo, hi = x.amin(1), x.amax(1)
    sum_w, sum_x = _seq_sum(w), _seq_sum(w * x)
    lo = lo.clamp(max=0)
    flat = hi == lo
    rng = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = nmax / rng
    scale = 1 / iscale
    mn = lo
    L = torch.round(iscale[:, None] * (x - mn[:, None])).clamp(0, nmax)
    diff = scale[:, None] * L + mn[:, None] - x
    best = _seq_sum(w * (diff * diff))
    for step in range(nstep + 1):
        cand = (_f32(rmin) + _f32(rdelta) * step + nmax) / (hi - mn)  # mn: the best fit so far, as in C
        la = torch.round(cand[:, None] * (x - mn[:, None])).clamp(0, nmax)
        wl = w * la
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * la), _seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        diff = this_scale[:, None] * la + this_min[:, None] - x
        cur = _seq_sum(w * (diff * diff))
        take = (D > 0) & (cur < best) & ~flat
        L = torch.where(take[:, None], la, L)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    L = torch.where(flat[:, None], torch.zeros_like(L), L)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -mn, L


def _make_qx(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml-quants.c make_qx_quants(n, nmax, x, L, rmse_type=1): signed scales with weights x^2 over
    sub-blocks x (m, n): (scale (m,), L (m, n) in 0..2 nmax - 1); the extreme of either sign maps to -nmax."""
    amax_i = x.abs().argmax(1, keepdim=True)  # first largest magnitude, as the strict > of the C loop
    mx = torch.gather(x, 1, amax_i)[:, 0]
    zero = x.abs().amax(1) < 1e-15  # GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lv = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        return lv, _seq_sum(w * x * lv), _seq_sum(w * lv * lv)

    lv, sumlx, suml2 = fit(-nmax / mx)
    L = lv + nmax
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        lv, sumlx, suml2 = fit(-(nmax + _f32(0.1) * step) / mx)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(take[:, None], lv + nmax, L)
        scale = torch.where(take, sumlx / suml2, scale)
        best = torch.where(take, scale * sumlx, best)
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero[:, None], torch.zeros_like(L), L)


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins (n, 8) -> the 12 bytes of Q4_K / Q5_K (ggml's get_scale_min_k4 reads them)."""
    ls, lm = ls.to(torch.uint8), lm.to(torch.uint8)
    b0 = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    b1 = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    b2 = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([b0, b1, b2], 1)


def _unpack_scale_min_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes (n, 12) -> 6-bit scales and mins (n, 8)."""
    d, m, md = b[:, :4], b[:, 4:8], b[:, 8:]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], 1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], 1)
    return sc, mn


def _quantize_k(x: torch.Tensor, t: GGMLType) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, 256) float32 -> codes (n, 256) uint8, header (n, header_bytes) uint8 (quantize_row_q{4,5,6}_K_ref)."""
    n = x.shape[0]
    nsub = t.block // t.sub
    xs = x.reshape(n * nsub, t.sub)  # (sub-blocks, sub)
    if t.name == "q6_k":
        scales, L = _make_qx(xs, 32)
        scales, L = scales.reshape(n, nsub), L.reshape(n, t.block)
        i = scales.abs().argmax(1, keepdim=True)
        max_scale = torch.gather(scales, 1, i)[:, 0]
        zero = scales.abs().amax(1) < 1e-15
        max_scale = torch.where(zero, torch.ones_like(max_scale), max_scale)
        iscale = -128 / max_scale
        d16 = (1 / iscale).to(torch.float16)
        sc = torch.round(iscale[:, None] * scales).clamp(max=127)  # int8: -128..127
        d_eff = (d16.float()[:, None] * sc).repeat_interleave(t.sub, 1)  # (n, 256)
        fresh = torch.round(x / d_eff).clamp(-32, 31) + 32
        L = torch.where(d_eff == 0, L, fresh)
        L = torch.where(zero[:, None], torch.zeros_like(L), L)
        sc = torch.where(zero[:, None], torch.zeros_like(sc), sc)
        d16 = torch.where(zero, torch.zeros_like(d16), d16)
        header = torch.cat([sc.to(torch.int8).view(torch.uint8), d16.contiguous().view(torch.uint8).reshape(n, 2)], 1)
        return L.to(torch.uint8), header
    nmax = 2**t.bits - 1
    av_x = torch.sqrt(_seq_sum(xs * xs) / 32)
    weights = av_x[:, None] + xs.abs()
    rmin, nstep = (-1.0, 20) if t.name == "q4_k" else (-0.5, 15)
    scales, mins, L = _make_qkx2(xs, weights, nmax, rmin, 0.1, nstep)
    scales, mins, L = scales.reshape(n, nsub), mins.reshape(n, nsub), L.reshape(n, t.block)
    max_scale, max_min = scales.amax(1), mins.amax(1)  # C starts both at +0 and takes only larger values
    max_scale = torch.where(max_scale > 0, max_scale, torch.zeros_like(max_scale))
    max_min = torch.where(max_min > 0, max_min, torch.zeros_like(max_min))
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), 0)
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), 0)
    ls = torch.round(inv_scale[:, None] * scales).clamp(max=63)
    lm = torch.round(inv_min[:, None] * mins).clamp(max=63)
    d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    d_eff = (d16.float()[:, None] * ls).repeat_interleave(t.sub, 1)
    dm = (dmin16.float()[:, None] * lm).repeat_interleave(t.sub, 1)
    fresh = torch.round((x + dm) / d_eff).clamp(0, nmax)
    L = torch.where(d_eff == 0, L, fresh)
    header = torch.cat([d16.contiguous().view(torch.uint8).reshape(n, 2),
                        dmin16.contiguous().view(torch.uint8).reshape(n, 2), _pack_scale_min_k4(ls, lm)], 1)
    return L.to(torch.uint8), header


def quantize(w2d: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest as llama.cpp's reference: (codes uint8 (rows, cols), header bytes uint8
    (rows, blocks * header_bytes))."""
    t = gtype(fmt)
    rows, cols = w2d.shape
    if cols % t.block:
        raise FormatError(f"{fmt.spec}: {cols} columns are not whole blocks of {t.block}")
    x = w2d.detach().to(F32).reshape(-1, t.block)  # (blocks, block)
    codes, header = (_quantize_k if t.block == 256 else _quantize_legacy)(x, t)
    return codes.reshape(rows, cols), header.reshape(rows, -1)


def sub_scales(header: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Header bytes (rows, blocks * header_bytes) -> per-sub-block float32 s and m (rows, sub-blocks), m None
    for types without a min: w = s * (c - offset) + m."""
    t = gtype(fmt)
    rows = header.shape[0]
    h = header.reshape(-1, t.header_bytes)
    if t.block == 32:
        s = _fp16_from(h[:, 0:2])
        m = _fp16_from(h[:, 2:4]) if t.has_min else None
    elif t.name == "q6_k":
        sc = h[:, :16].contiguous().view(torch.int8).float()
        s = _fp16_from(h[:, 16:18])[:, None] * sc
        m = None
    else:
        sc, mn = _unpack_scale_min_k4(h[:, 4:16])
        s = _fp16_from(h[:, 0:2])[:, None] * sc.float()
        m = -(_fp16_from(h[:, 2:4])[:, None] * mn.float())
    return s.reshape(rows, -1), (m.reshape(rows, -1) if m is not None else None)


def dequantize(codes: torch.Tensor, header: torch.Tensor, fmt: Format, dtype: torch.dtype = F32) -> torch.Tensor:
    """codes (rows, cols) uint8 and header bytes -> values (rows, cols), as gguf-py computes them."""
    t = gtype(fmt)
    rows, cols = codes.shape
    s, m = sub_scales(header, fmt)
    v = (codes.reshape(rows, -1, t.sub).to(torch.int16) - t.offset).float() * s[..., None]
    if m is not None:
        v = v + m[..., None]
    return v.reshape(rows, cols).to(dtype)


# ---------------------------------------------------------------------- codes under fixed headers
def column_grid(header: torch.Tensor, fmt: Format, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Header bytes (rows, blocks * header_bytes) -> each column's s and m (rows, cols), m None without a min.

    For a calibrated method (GPTQ) writing a block type: it fixes a block's header when it reaches the
    block's first column (`quantize(W[:, j:j + 256])[1]` on the weights as updated so far), then takes each
    column's codes with `encode` against these s and m, so its codes land in the block without re-rounding."""
    t = gtype(fmt)
    s, m = sub_scales(header, fmt)
    rows = header.shape[0]
    expand = lambda v: v.reshape(rows, -1, 1).expand(-1, -1, t.sub).reshape(rows, -1)[:, :cols]  # noqa: E731
    return expand(s), (expand(m) if m is not None else None)


def encode(x: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    """The nearest codes (uint8, x's shape) of float32 weights x on the fixed grids s * (c - offset) + m:
    round((x - m) / s) for the types with a min, round(x / s) + offset for the others (round-half-even,
    clamped to the code range), the arithmetic llama.cpp's K-quant quantisers use once their scales are final.
    Where s is 0 every code decodes to the same value and code 0 is given (llama.cpp keeps its search's code
    there: same values, other bits).

    For the 32-weight types the grid is the stored one (fp16 d), while llama.cpp's reference rounds with the
    unrounded fp32 d (and halves up): the codes are then the nearest on the grid the file decodes, and differ
    from `quantize`'s only where a weight sits within the fp16 rounding of d of a rounding boundary."""
    t = gtype(fmt)
    x = x.to(F32)
    if t.has_min:
        c = torch.round((x - m) / s).clamp(0, 2**t.bits - 1)
    else:
        c = torch.round(x / s).clamp(-t.offset, 2**t.bits - 1 - t.offset) + t.offset
    return torch.where(s == 0, torch.zeros_like(c), c).to(torch.uint8)


def decode(c: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    """Codes c on the grids s, m (any matching shapes) -> float32 values, with `dequantize`'s arithmetic, so a
    column decoded here is bit for bit the column `dequantize` (and gguf-py) gives."""
    v = (c.to(torch.int16) - gtype(fmt).offset).float() * s
    return v + m if m is not None else v


# ---------------------------------------------------------------------- GGUF block bytes
def to_gguf_blocks(codes: torch.Tensor, header: torch.Tensor, fmt: Format) -> torch.Tensor:
    """codes (rows, cols) uint8 + header -> (rows, blocks * block_bytes) uint8: llama.cpp's block layout."""
    t = gtype(fmt)
    rows, cols = codes.shape
    c = codes.reshape(-1, t.block).to(torch.uint8)
    h = header.reshape(-1, t.header_bytes)
    n = c.shape[0]
    if t.block == 32:
        qs = (c[:, :16] & 0xF) | ((c[:, 16:] & 0xF) << 4) if t.bits <= 5 else c ^ 0x80  # Q8_0: int8 c - 128
        parts = [h]
        if t.bits == 5:  # bit 4 of code j is bit j of a little-endian uint32
            hi = ((c >> 4) & 1).reshape(n, 4, 8)
            parts.append((hi << torch.arange(8, dtype=torch.uint8)).sum(-1).to(torch.uint8))
        out = torch.cat(parts + [qs], 1)
    elif t.name == "q6_k":
        q = c.reshape(n, 2, 4, 32)  # (blocks, halves of 128, quarters of 32, 32)
        lo, hi = q & 0xF, q >> 4
        ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2)  # (n, 2, 64)
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # (n, 2, 32)
        out = torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), h], 1)
    else:
        q = c.reshape(n, 4, 2, 32)  # (blocks, chunks of 64, halves, 32)
        ql = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
        parts = [h]
        if t.bits == 5:  # qh[l]: bit 2k from code 64k + l, bit 2k+1 from code 64k + 32 + l
            hi = ((q >> 4) & 1).reshape(n, 8, 32)  # bit index 2k + half
            parts.append((hi << torch.arange(8, dtype=torch.uint8)[:, None]).sum(1).to(torch.uint8))
        out = torch.cat(parts + [ql], 1)
    return out.reshape(rows, -1)


def from_gguf_blocks(data: torch.Tensor, fmt: Format, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `to_gguf_blocks`: (rows, bytes) uint8 -> codes (rows, cols) uint8, header bytes."""
    t = gtype(fmt)
    rows = data.shape[0]
    b = data.reshape(-1, t.block_bytes).to(torch.uint8)
    n = b.shape[0]
    if t.block == 32:
        h, rest = b[:, :t.header_bytes], b[:, t.header_bytes:]
        if t.bits == 8:
            c = rest ^ 0x80
        else:
            hi = torch.zeros(n, 32, dtype=torch.uint8)
            if t.bits == 5:
                hi = ((rest[:, :4, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(n, 32) << 4
                rest = rest[:, 4:]
            c = torch.cat([rest & 0xF, rest >> 4], 1) | hi
    elif t.name == "q6_k":
        ql, qh, h = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32), b[:, 192:]
        lo = torch.stack([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
        hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)
        c = (lo | (hi << 4)).reshape(n, 256)
    else:
        h = b[:, :16]
        rest = b[:, 16:]
        qh = None
        if t.bits == 5:
            qh, rest = rest[:, :32], rest[:, 32:]
        ql = rest.reshape(n, 4, 32)
        c = torch.stack([ql & 0xF, ql >> 4], 2)  # (n, 4, 2, 32)
        if qh is not None:
            bits = (qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # (n, 8, 32)
            c = c | (bits.reshape(n, 4, 2, 32) << 4)
        c = c.reshape(n, 256)
    return c.reshape(rows, cols), h.reshape(rows, -1).contiguous()
