"""Value grids: rounding onto and encoding the element formats.

* Minifloats (OCP FP8 E4M3 / E5M2, FP4 E2M1): round-to-nearest-even onto the grid, optional saturation,
  and the exact bit patterns.  E4M3 here is the "fn" variant (no infinities, max 448, S.1111.111 = NaN);
  E5M2 is IEEE-like (max 57344, infinities).  OCP 8-bit Floating Point Specification (OFP8) rev 1.0.
* NF4: the 16 NormalFloat levels of QLoRA (Dettmers et al. 2023, appendix E).
* E8M0: the power-of-two scale of the OCP Microscaling (MX) formats v1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniFloat:
    """A sign-exponent-mantissa element format."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float  # largest finite magnitude
    has_inf: bool  # IEEE-style infinities (e5m2) or not (e4m3fn, e2m1)
    has_nan: bool

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest binade (OCP MX calls it emax_elem)."""
        return int(torch.tensor(self.max).log2().floor().item())


E4M3 = MiniFloat("e4m3", 4, 3, 7, 448.0, has_inf=False, has_nan=True)
E5M2 = MiniFloat("e5m2", 5, 2, 15, 57344.0, has_inf=True, has_nan=True)
E2M1 = MiniFloat("e2m1", 2, 1, 1, 6.0, has_inf=False, has_nan=False)
MINIFLOATS = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}

#: QLoRA NormalFloat-4 levels (quantiles of N(0,1) normalised to [-1, 1], with an exact zero)
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def round_minifloat(x: torch.Tensor, fmt: MiniFloat, saturate: bool = True) -> torch.Tensor:
    """Round float values to the nearest representable value of `fmt` (ties to even), in float32.

    Values whose rounded magnitude exceeds `fmt.max` saturate to +-max, or, with saturate=False, become
    NaN (formats without infinities) or +-inf, as hardware conversions without saturation do.
    """
    x = x.float()
    a = x.abs()
    # exponent of each value's binade, never below the smallest normal one (subnormals share its step)
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** fmt.min_normal_exp)))
    step = torch.exp2(e - fmt.mbits)
    r = torch.round(a / step) * step  # a / step is exact: step is a power of two; torch.round is RNE
    over = r > fmt.max
    if saturate:
        r = torch.where(over, torch.full_like(r, fmt.max), r)
    else:
        r = torch.where(over, torch.full_like(r, float("inf") if fmt.has_inf else float("nan")), r)
    r = torch.where(torch.isnan(x), x, r)
    if not saturate and fmt.has_inf:
        r = torch.where(torch.isinf(x), a, r)
    return torch.copysign(r, x)


def encode_minifloat(v: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Bit patterns (uint8, low bits) of values already on the grid of `fmt` (see `round_minifloat`)."""
    v = v.float()
    sign = (torch.signbit(v)).to(torch.int32) << (fmt.ebits + fmt.mbits)
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** fmt.min_normal_exp)))
    normal = a >= 2.0 ** fmt.min_normal_exp
    exp_field = torch.where(normal, e + fmt.bias, torch.zeros_like(e))
    sub_step = 2.0 ** (fmt.min_normal_exp - fmt.mbits)
    mant = torch.where(normal, a / torch.exp2(e - fmt.mbits) - 2**fmt.mbits, a / sub_step)
    # round, not truncate: a value a float rounding below its grid point (e.g. (s * t) / t) keeps its code;
    # a mantissa that rounds up to 2^mbits carries into the exponent field, which is the next code
    bits = (exp_field.to(torch.int32) << fmt.mbits) + torch.round(mant).to(torch.int32)
    all_ones = (1 << (fmt.ebits + fmt.mbits)) - 1
    if fmt.has_inf:
        bits = torch.where(torch.isinf(a), torch.full_like(bits, ((1 << fmt.ebits) - 1) << fmt.mbits), bits)
        bits = torch.where(torch.isnan(a), torch.full_like(bits, all_ones), bits)
    elif fmt.has_nan:
        bits = torch.where(torch.isnan(a), torch.full_like(bits, all_ones), bits)
    return (bits | sign).to(torch.uint8)


def decode_minifloat(bits: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Float32 values of bit patterns of `fmt` (inverse of `encode_minifloat`)."""
    b = bits.to(torch.int32)
    sign = (b >> (fmt.ebits + fmt.mbits)) & 1
    exp_field = (b >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = (b & ((1 << fmt.mbits) - 1)).float()
    sub = exp_field == 0
    val = torch.where(
        sub,
        mant * 2.0 ** (fmt.min_normal_exp - fmt.mbits),
        (1 + mant / 2 ** fmt.mbits) * torch.exp2((exp_field - fmt.bias).float()),
    )
    top = exp_field == (1 << fmt.ebits) - 1
    if fmt.has_inf:
        val = torch.where(top & (mant == 0), torch.full_like(val, float("inf")), val)
        val = torch.where(top & (mant != 0), torch.full_like(val, float("nan")), val)
    elif fmt.has_nan:
        val = torch.where(top & (mant == 2 ** fmt.mbits - 1), torch.full_like(val, float("nan")), val)
    return torch.where(sign.bool(), -val, val)


def minifloat_grid(fmt: MiniFloat) -> torch.Tensor:
    """All finite non-negative values of `fmt`, ascending."""
    n = 1 << (fmt.ebits + fmt.mbits)
    vals = decode_minifloat(torch.arange(n, dtype=torch.int32), fmt)
    return torch.unique(vals[torch.isfinite(vals)])


def nf4_round(x: torch.Tensor) -> torch.Tensor:
    """Index (0..15) of the nearest NF4 level of each value of `x` (already scaled into [-1, 1])."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=x.device)
    mids = (levels[1:] + levels[:-1]) / 2  # decision boundaries between adjacent levels
    return torch.bucketize(x.float().contiguous(), mids).to(torch.uint8)


def nf4_values(codes: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=codes.device)
    return levels[codes.long()]


def e8m0_exponent(amax: torch.Tensor, elem: MiniFloat) -> torch.Tensor:
    """OCP MX shared exponent: floor(log2(amax)) - emax_elem, clamped to E8M0's range [-127, 127].

    All-zero blocks get the smallest exponent.  Returned as float32 holding integers.
    """
    a = amax.float()
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -127))) - elem.emax
    return e.clamp(-127, 127)


# ---------------------------------------------------------------------- fast paths
# The functions above are the readable reference.  The quantiser calls `to_codes` / `from_codes`, which
# use torch's own float8 casts (bit-identical: tests compare on every finite fp16 value) and a table
# for E2M1, and fall back to the reference for anything else.
_TORCH_FP8 = {"e4m3": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None)}


def _e2m1_boundaries(device: torch.device) -> torch.Tensor:
    """Decision boundaries between the 8 E2M1 magnitudes; a value equal to a boundary goes to the level
    with the even mantissa (round half to even), hence the nudged boundaries where ties go up."""
    levels = minifloat_grid(E2M1).tolist()  # 0, .5, 1, 1.5, 2, 3, 4, 6
    bounds = []
    for i in range(7):
        mid = (levels[i] + levels[i + 1]) / 2
        upper_is_even = (i + 1) % 2 == 0  # codes 0..7: even code = even mantissa
        bounds.append(float(torch.nextafter(torch.tensor(mid), torch.tensor(0.0))) if upper_is_even else mid)
    return torch.tensor(bounds, dtype=torch.float32, device=device)


def to_codes(x: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Saturating round-to-nearest-even of finite `x` onto `fmt`, as uint8 bit patterns."""
    fp8 = _TORCH_FP8.get(fmt.name)
    if fp8 is not None:
        return x.float().clamp(-fmt.max, fmt.max).to(fp8).view(torch.uint8)
    if fmt is E2M1:
        xf = x.float()
        mag = torch.bucketize(xf.abs().contiguous(), _e2m1_boundaries(x.device)).to(torch.uint8)
        return mag | (torch.signbit(xf).to(torch.uint8) << 3)
    return encode_minifloat(round_minifloat(x, fmt, saturate=True), fmt)


def from_codes(codes: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """float32 values of bit patterns (fast inverse of `to_codes`)."""
    fp8 = _TORCH_FP8.get(fmt.name)
    if fp8 is not None:
        return codes.to(torch.uint8).view(fp8).float()
    if fmt is E2M1:
        table = decode_minifloat(torch.arange(16, dtype=torch.int32), E2M1).to(codes.device)
        return table[codes.long()]
    return decode_minifloat(codes, fmt)
