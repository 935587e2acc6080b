"""Round-to-nearest: the baseline every other method must beat.

Each weight is mapped to the nearest code of its group's grid, with the scale (and zero point) taken
from the group's range (the signed extreme on the full symmetric grid, absmax on the narrow one, min-max
for asymmetric formats).  No data is used.  Symmetric integers are rounded as llama.cpp's reference
quantisers do (`fewbits.formats.quant.round_to_nearest`): int4-g32 is GGUF Q4_0 and int8-g32-narrow is
Q8_0, byte for byte.
"""

from __future__ import annotations

import torch

from fewbits.formats import ggml
from fewbits.formats.format import Format
from fewbits.formats.quant import all_finite, round_to_nearest
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
        codes, scale, zero = round_to_nearest(w, fmt)
    return QuantResult(codes, scale, zero, fmt, {"method": "rtn"})
