"""The reference path every fast kernel is tested against: dequantise the weight, then a dense matmul.

It keeps only the packed QuantizedTensor in memory and dequantises on every call, so it is exact for
every format the numeric core knows but reads the weight at full precision (slow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fewbits.tensor import QuantizedTensor


def reference_linear(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(qt).T + bias in the dtype of `x`; x (..., in_features), qt (out, in)."""
    if len(qt.shape) != 2:
        raise ValueError(f"linear weight must be 2-D (out, in), got shape {qt.shape} in format {qt.fmt.spec}")
    if x.shape[-1] != qt.shape[1]:
        raise ValueError(f"input last dimension {x.shape[-1]} does not match weight shape {qt.shape} "
                         f"(format {qt.fmt.spec})")
    w = qt.dequantize(torch.float32).to(device=x.device, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


class ReferenceKernel:
    """Prepared reference path: holds the QuantizedTensor and dequantises per call."""

    name = "reference"

    def __init__(self, qt: QuantizedTensor, reason: str = "") -> None:
        self.qt = qt
        self.reason = reason
        self.shape = qt.shape

    @property
    def nbytes(self) -> int:
        return self.qt.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return reference_linear(x, self.qt, bias)

    def __repr__(self) -> str:
        return f"ReferenceKernel({self.qt.fmt.spec}, {self.qt.shape})"
