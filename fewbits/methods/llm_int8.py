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

from typing import Any, ClassVar

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
    pass into outlier dimensions (16-bit) and the rest (int8 per token).

    Saved as layer kind "int8_outlier" with its `outlier_threshold` and shape; codes, scales and bias
    are state-dict tensors."""

    layer_kind: ClassVar[str] = "int8_outlier"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, threshold: float = 6.0) -> None:
        super().__init__()
        w = weight.detach().float()
        res = rtn_quantize(w, "int8")  # the stored int8 per-channel codes: value = code - 128
        self._store((res.codes.to(torch.int16) - 128).to(torch.int8), res.scale, bias, threshold)

    def _store(self, w_codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               threshold: float) -> None:
        self.register_buffer("w_codes", w_codes)
        self.register_buffer("w_scale", w_scale)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.threshold = float(threshold)
        self.out_features, self.in_features = (int(d) for d in w_codes.shape)

    @classmethod
    def from_codes(cls, w_codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   threshold: float = 6.0) -> Int8OutlierLinear:
        """The layer over stored int8 codes (out, in) and per-channel scales (out, 1), no requantisation."""
        if w_codes.dtype != torch.int8 or w_codes.dim() != 2:
            raise MethodError(f"llm-int8: codes must be 2-D int8, got {w_codes.dtype} {tuple(w_codes.shape)}")
        out = w_codes.shape[0]
        if tuple(w_scale.shape) != (out, 1) or (bias is not None and tuple(bias.shape) != (out,)):
            raise MethodError(f"llm-int8: codes {tuple(w_codes.shape)} do not match scales {tuple(w_scale.shape)}"
                              + ("" if bias is None else f" / bias {tuple(bias.shape)}"))
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._store(w_codes, w_scale, bias, threshold)
        return layer

    def layer_meta(self) -> dict[str, Any]:
        return {"outlier_threshold": self.threshold, "shape": [self.out_features, self.in_features],
                "bias": self.bias is not None}

    @classmethod
    def from_layer_meta(cls, meta: dict[str, Any], source: Any) -> Int8OutlierLinear:
        """Rebuild from saved metadata (`source` is a models.qlinear.LayerSource)."""
        codes = source.tensor("w_codes")
        if list(codes.shape) != list(meta["shape"]):
            raise MethodError(f"{source.prefix}: saved codes have shape {tuple(codes.shape)}, "
                              f"the metadata says {tuple(meta['shape'])}")
        bias = source.tensor("bias") if meta.get("bias") else None
        return cls.from_codes(codes, source.tensor("w_scale"), bias, float(meta["outlier_threshold"]))

    @property
    def weight(self) -> torch.Tensor:
        """Dequantised int8 weight (what the outlier dimensions multiply)."""
        return self.w_codes.float() * self.w_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.w_codes, self.w_scale, self.weight, self.threshold)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 vector-wise, threshold={self.threshold}"
