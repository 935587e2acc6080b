"""Round-to-nearest: the baseline every other method must beat.

Each weight is mapped to the nearest code of its group's grid, with the scale (and zero point) taken
from the group's range (absmax for symmetric, min-max for asymmetric formats).  No data is used.
"""

from __future__ import annotations

import torch

from fewbits.formats import ggml
from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, compute_scales, quantize_codes
from fewbits.methods.common import QuantResult, check_method_format, naming


def rtn_quantize(w: torch.Tensor, fmt: Format | str, name: str = "weight") -> QuantResult:
    """Round-to-nearest codes for a 2-D weight (rows = outputs, cols = inputs)."""
    fmt = check_method_format("rtn", fmt)
    if w.dim() != 2:
        raise ValueError(f"{name}: rtn expects a 2-D weight, got shape {tuple(w.shape)}")
    fmt.check_shape(tuple(w.shape), name)
    w = w.detach().float()
    if not all_finite(w):
        raise ValueError(f"{name}: weight of shape {tuple(w.shape)} contains NaN or inf")
    if fmt.kind == "ggml":  # llama.cpp's reference picks codes and block headers in one pass
        codes, header = ggml.quantize(w, fmt)
        return QuantResult(codes, header.float(), None, fmt, {"method": "rtn"})
    with naming(name):
        scale, zero = compute_scales(w, fmt)
    return QuantResult(quantize_codes(w, scale, zero, fmt), scale, zero, fmt, {"method": "rtn"})
