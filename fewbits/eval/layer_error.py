"""One linear layer y = W x, quantised several ways: how far does y move from the 16-bit answer?

The default experiment: W ~ N(0, 0.02) of shape (512, 512), x ~ N(0, 1), and an "outlier token" equal to
x with channel 7 set to 20 (numpy default_rng(0), drawn in that order).  Weight-only formats quantise W
and keep x exact; W8A8 quantises W per output channel and x per token (one scale for the whole vector);
the LLM.int8()-style split (Dettmers et al. 2022, sec. 3.2) multiplies the activation channels whose
magnitude exceeds a threshold in full precision and the rest in 8-bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fewbits.formats.format import parse_format
from fewbits.formats.quant import fake_quantize

DEFAULT_WEIGHTS = ("int8", "int4", "int4-g128", "int4-g32", "int3-g128")


@dataclass(frozen=True)
class LayerCase:
    """The layer and its two input tokens (float64)."""

    W: torch.Tensor  # (out, in)
    x: torch.Tensor  # (in,)
    x_outlier: torch.Tensor  # (in,)


def make_case(rows: int = 512, cols: int = 512, w_std: float = 0.02, outlier_channel: int | None = 7,
              outlier_value: float = 20.0, seed: int = 0) -> LayerCase:
    """Draw W, then x, from numpy's default_rng(seed); the outlier token is x with one channel replaced."""
    rng = np.random.default_rng(seed)
    W = rng.normal(0, w_std, (rows, cols))
    x = rng.normal(0, 1.0, cols)
    x_out = x.copy()
    if outlier_channel is not None:
        if not 0 <= outlier_channel < cols:
            raise ValueError(f"outlier channel {outlier_channel} is outside 0..{cols - 1}")
        x_out[outlier_channel] = outlier_value
    return LayerCase(torch.from_numpy(W), torch.from_numpy(x), torch.from_numpy(x_out))


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref||."""
    return float(torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref))


def weight_only_error(case: LayerCase, spec: str, outlier: bool = False) -> float:
    """Relative output error with W in `spec` and the activation exact."""
    x = case.x_outlier if outlier else case.x
    return rel_error(fake_quantize(case.W, spec) @ x, case.W @ x)


def w8a8_error(case: LayerCase, outlier: bool, threshold: float | None = None,
               weights: str = "int8", acts: str = "int8") -> float:
    """Relative error of W8A8 (weights per channel, activations per token); with `threshold`, channels
    with |x| > threshold are multiplied in full precision (LLM.int8()-style decomposition)."""
    x = case.x_outlier if outlier else case.x
    ref = case.W @ x
    keep = x.abs() > threshold if threshold is not None else torch.zeros_like(x, dtype=torch.bool)
    x8 = torch.where(keep, torch.zeros_like(x), x)
    y = fake_quantize(case.W, weights) @ fake_quantize(x8, acts) + case.W[:, keep] @ x[keep]
    return rel_error(y, ref)


def with_scales(spec: str, scale_dtype: str | None, grid: str | None = None) -> str:
    """`spec` with its scales computed in `scale_dtype` ("fp64" = exact) unless the spec names one, and, for
    symmetric integer formats, on `grid` ("narrow": the reference documents' -L..L; None: as spelled)."""
    fmt = parse_format(spec)
    if grid is not None and fmt.sym_int:
        fmt = replace(fmt, grid=grid)
    if scale_dtype is None or fmt.scale_dtype != fmt.default_scale_dtype or fmt.scale_dtype in ("e8m0", "e4m3"):
        return fmt.spec
    return replace(fmt, scale_dtype=scale_dtype).spec


def run(case: LayerCase, weights: tuple[str, ...] = DEFAULT_WEIGHTS, threshold: float = 6.0,
        scale_dtype: str | None = "fp64", grid: str | None = "narrow") -> dict[str, list[tuple[str, float, float]]]:
    """All rows of the experiment: {"weight-only": [(spec, stored bits/weight, err)], "w8a8": [...]}.

    Errors use scales in `scale_dtype` (default fp64: the exact textbook quantiser) and symmetric integers
    on `grid` (default "narrow", the textbook absmax grid -L..L; "full" for -2^(b-1)..2^(b-1)-1, None
    for each spec's own); the bits per weight are those of the format as stored (its default scale dtype).
    """
    shape = tuple(case.W.shape)
    wo = [(parse_format(spec).spec, parse_format(spec).bits_per_weight(shape),
           weight_only_error(case, with_scales(spec, scale_dtype, grid))) for spec in weights]
    w8, a8 = with_scales("int8", scale_dtype, grid), with_scales("int8", scale_dtype, grid)
    bpw8 = parse_format("int8").bits_per_weight(shape)
    w8a8 = [
        ("normal token", bpw8, w8a8_error(case, False, None, w8, a8)),
        ("outlier token", bpw8, w8a8_error(case, True, None, w8, a8)),
        (f"outlier kept in 16-bit (|x| > {threshold:g})", bpw8, w8a8_error(case, True, threshold, w8, a8)),
    ]
    return {"weight-only": wo, "w8a8": w8a8}


def weights_per_scale(spec: str, shape: tuple[int, int]) -> int:
    """How many weights of a (rows, cols) matrix share one scale in `spec` (0 for unquantised formats)."""
    fmt = parse_format(spec)
    rows, cols = shape
    return {"group": fmt.group_size, "channel": cols, "tensor": rows * cols}.get(fmt.granularity, 0)


def experiment(weights: tuple[str, ...] = DEFAULT_WEIGHTS, rows: int = 512, cols: int = 512, w_std: float = 0.02,
               outlier_channel: int | None = 7, outlier_value: float = 20.0, seed: int = 0, threshold: float = 6.0,
               scale_dtype: str | None = "fp64", grid: str | None = "narrow") -> dict[str, list[dict[str, object]]]:
    """The whole experiment as `fewbits layer-error --json` prints it (and `fewbits ui` shows it):
    {"weight-only": [{name, bits_per_weight, rel_error, weights_per_scale}], "w8a8": [...]}.
    A format whose groups do not divide `cols` is a ValueError naming it; `grid` as in `run`."""
    case = make_case(rows, cols, w_std, outlier_channel, outlier_value, seed)
    for s in weights:
        parse_format(s).check_shape((rows, cols), "W")
    result = run(case, weights, threshold, scale_dtype, grid)
    return {k: [{"name": n, "bits_per_weight": b, "rel_error": e,
                 "weights_per_scale": weights_per_scale(n if k == "weight-only" else "int8", (rows, cols))}
                for n, b, e in v] for k, v in result.items()}
