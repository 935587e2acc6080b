"""LLM.int8() (Dettmers, Lewis, Belkada, Zettlemoyer 2022, "LLM.int8(): 8-bit Matrix Multiplication
for Transformers at Scale").

Vector-wise int8 matmul with mixed-precision decomposition (paper section 3.2, eq. 7):
    O = sum_{h in O} X_{:,h} W_{h,:}  (16-bit)  +  S * sum_{h not in O} Xq_{:,h} Wq_{h,:}  (int8)
The outlier set O = feature dimensions h where any |X_{t,h}| >= threshold (6 by default), decided
anew for every forward pass from the activations at hand.  X is quantised per row (token), W per
output channel, both absmax to [-127, 127]; the int8 product is rescaled by the outer product of the
two scale vectors.  Weights of the outlier dimensions are used at the precision given (the original
16-bit weights, or the dequantised int8 weights when only those are stored).
"""

from __future__ import annotations

import torch
from torch import nn

from fewbits.methods.common import MethodError
from fewbits.methods.rtn import rtn_quantize


def _absmax_int8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise absmax int8 codes (as float) and the scales (rows, 1)."""
    scale = a.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(a / scale).clamp_(-127, 127), scale


def outlier_dims(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """Indices of feature dimensions (last axis) where any |x| >= threshold."""
    return torch.nonzero((x.abs() >= threshold).reshape(-1, x.shape[-1]).any(0)).flatten()


def int8_matmul(
    x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, w_outlier: torch.Tensor,
    threshold: float = 6.0,
) -> torch.Tensor:
    """y = x W^T by LLM.int8(): x (..., in); w_codes (out, in) integer values in [-127, 127] (float or
    int), w_scale (out, 1); w_outlier (out, in) the weights used for outlier dimensions."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1]).double() if x.dtype == torch.float64 else x.reshape(-1, shape[-1]).float()
    cols = outlier_dims(xf, threshold)
    x_reg = xf.clone()
    x_reg[:, cols] = 0
    xq, xs = _absmax_int8(x_reg)
    # the int8 x int8 product with int32 accumulation is exact in float64 for these sizes
    y = (xq.double() @ w_codes.double().T) * (xs.double() * w_scale.double().reshape(1, -1))
    y = y.to(xf.dtype)
    if cols.numel():
        y = y + xf[:, cols] @ w_outlier[:, cols].to(xf.dtype).T
    return y.reshape(*shape[:-1], -1).to(x.dtype)


def llm_int8_matmul(x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """LLM.int8() product of activations x (..., in) and a float weight w (out, in): the outlier
    dimensions multiply the original weights, the rest goes through vector-wise int8."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise MethodError(f"llm-int8: activations {tuple(x.shape)} do not match weight {tuple(w.shape)}")
    wq, ws = _absmax_int8(w.double() if w.dtype == torch.float64 else w.float())
    return int8_matmul(x, wq, ws, w, threshold)


class Int8OutlierLinear(nn.Module):
    """A linear layer running LLM.int8(): int8 per-channel weight codes, activations split per forward
    pass into outlier dimensions (16-bit) and the rest (int8 per token)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, threshold: float = 6.0) -> None:
        super().__init__()
        w = weight.detach().float()
        res = rtn_quantize(w, "int8")  # the stored int8 per-channel codes: value = code - 128
        self.register_buffer("w_codes", (res.codes.to(torch.int16) - 128).to(torch.int8))
        self.register_buffer("w_scale", res.scale)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.threshold = float(threshold)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """Dequantised int8 weight (what the outlier dimensions multiply)."""
        return self.w_codes.float() * self.w_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.w_codes, self.w_scale, self.weight, self.threshold)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 vector-wise, threshold={self.threshold}"
