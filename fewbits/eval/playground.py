"""64 weights through one quantiser, every stored value kept: the experiment of `fewbits try` and the page.

The weights are N(0, 0.02) from numpy's default_rng(seed) (or 64 values the caller gives); the "outlier"
sets weight 5 to 0.16, about five times the largest, so that one scale stretched over it rounds the small
weights to zero.  The codes and scales are those `fewbits.tensor.quantize_tensor` stores, so the figures
are the library's own, not a re-derivation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

N_WEIGHTS = 64
OUTLIER_INDEX = 5
OUTLIER_VALUE = 0.16

#: format families of the playground -> whether bits / groups / asym apply
FAMILIES: dict[str, dict[str, bool]] = {
    "int": {"bits": True, "group": True, "asym": True},
    "fp8-e4m3": {"bits": False, "group": True, "asym": False},
    "fp8-e5m2": {"bits": False, "group": True, "asym": False},
    "fp4": {"bits": False, "group": True, "asym": False},
    "nf4": {"bits": False, "group": True, "asym": False},
    "mxfp4": {"bits": False, "group": False, "asym": False},  # fixed blocks of 32, E8M0 scales
    "mxfp8": {"bits": False, "group": False, "asym": False},
    "nvfp4": {"bits": False, "group": False, "asym": False},  # fixed blocks of 16, E4M3 scales
}
GROUPS = (64, 32, 16, 8)


def playground_spec(family: str = "int", bits: int = 4, group: int = 64, asym: bool = False,
                    full_grid: bool = False) -> str:
    """The format spec for a family, bits (int only), weights per scale (64 = one scale for all) and asym.
    Symmetric integers default to the reference documents' textbook grid -L..L (`-narrow`); `full_grid`
    gives fewbits' default -2^(b-1)..2^(b-1)-1."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    if group not in GROUPS:
        raise ValueError(f"group must be one of {', '.join(map(str, GROUPS))}, got {group}")
    if family == "int":
        if not 2 <= bits <= 8:
            raise ValueError(f"bits must be 2..8, got {bits}")
        grid = "-asym" if asym else "" if full_grid else "-narrow"
        return f"int{bits}" + ("" if group == N_WEIGHTS else f"-g{group}") + grid
    if asym:
        raise ValueError(f"{family} has no asymmetric (zero point) variant; asym is for int only")
    if family.startswith("fp8"):
        return family + ("" if group == N_WEIGHTS else f"-g{group}")
    if family in ("fp4", "nf4"):
        return f"{family}-g{group}"
    return family


def default_weights(seed: int = 0, outlier: bool = False) -> np.ndarray:
    """The 64 seeded weights ~ N(0, 0.02), weight 5 set to 0.16 with `outlier`."""
    w = np.random.default_rng(seed).normal(0, 0.02, N_WEIGHTS)
    if outlier:
        w[OUTLIER_INDEX] = OUTLIER_VALUE
    return w


@dataclass(frozen=True)
class TryResult:
    """Every stored value of one quantisation of 64 weights."""

    spec: str
    original: list[float]
    codes: list[int]
    stored: list[float]
    errors: list[float]  # |stored - original|
    scales: list[float]
    weights_per_scale: int
    rel_error: float  # ||stored - original|| / ||original||
    max_error: float
    zeros: int  # weights that were not zero and are stored as zero
    zero_index: list[int]
    bits_per_weight: float  # codes + scales (+ zero points), as stored
    stored_bytes: int
    bf16_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def try_quantiser(spec: str, weights: Sequence[float] | np.ndarray | None = None, seed: int = 0,
                  outlier: bool = False) -> TryResult:
    """Quantise 64 weights (the seeded ones unless given) to `spec` and return every stored value."""
    import torch

    from fewbits.formats.format import parse_format
    from fewbits.tensor import quantize_tensor

    fmt = parse_format(spec)
    if weights is None:
        w = default_weights(seed, outlier)
    else:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.size != N_WEIGHTS:
            raise ValueError(f"give exactly {N_WEIGHTS} weights, got {w.size}")
        if not np.isfinite(w).all():
            raise ValueError("weights must be finite numbers")
        if not np.any(w):
            raise ValueError("weights are all zero: there is nothing to quantise")
        if outlier:
            w = w.copy()
            w[OUTLIER_INDEX] = OUTLIER_VALUE
    fmt.check_shape((1, N_WEIGHTS), "the 64 weights")
    qt = quantize_tensor(torch.from_numpy(w).float().reshape(1, N_WEIGHTS), fmt.spec, "weights")
    hat = qt.dequantize().reshape(N_WEIGHTS).double().numpy()
    scales = [float(s) for s in qt.scale_values().reshape(-1).tolist()]
    err = np.abs(hat - w)
    zero = (hat == 0) & (w != 0)
    return TryResult(
        spec=qt.fmt.spec, original=w.tolist(), codes=[int(c) for c in qt.unpacked_codes().reshape(-1).tolist()],
        stored=hat.tolist(), errors=err.tolist(), scales=scales,
        weights_per_scale=N_WEIGHTS // max(1, len(scales)),
        rel_error=float(np.linalg.norm(hat - w) / np.linalg.norm(w)), max_error=float(err.max()),
        zeros=int(zero.sum()), zero_index=[int(i) for i in np.flatnonzero(zero)],
        bits_per_weight=float(qt.fmt.bits_per_weight((1, N_WEIGHTS))), stored_bytes=int(qt.nbytes),
        bf16_bytes=2 * N_WEIGHTS)


def format_try_text(r: TryResult, outlier: bool = False) -> str:
    """The table `fewbits try` prints: each original, code, stored value and error, then the summary."""
    n = len(r.scales)
    lines = [f"format {r.spec}: {n} scale(s) of {r.weights_per_scale} weights, scale{'s' if n > 1 else ''} "
             + ", ".join(f"{s:.5f}" for s in r.scales),
             f"{'#':>3} {'original':>9} {'code':>5} {'stored':>9} {'error':>8}"]
    for i in range(N_WEIGHTS):
        w, hat = r.original[i], r.stored[i]
        mark = "  <- zero" if hat == 0 and w != 0 else ("  <- outlier" if outlier and i == OUTLIER_INDEX else "")
        lines.append(f"{i:3d} {w:9.5f} {r.codes[i]:5d} {hat:9.5f} {r.errors[i]:8.5f}{mark}")
    extra = " + zero points" if "asym" in r.spec else ""
    lines += ["", f"relative error {r.rel_error:.2%}, max error {r.max_error:.5f}, {r.zeros} of {N_WEIGHTS} "
              "weights became zero",
              f"bits per weight: {r.bits_per_weight:.3f} (codes + scales{extra}); {r.stored_bytes} bytes stored "
              f"vs {r.bf16_bytes} in bf16"]
    return "\n".join(lines)
