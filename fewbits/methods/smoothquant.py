"""SmoothQuant (Xiao, Lin, Seznec, Wu, Demouth, Han 2022, "SmoothQuant: Accurate and Efficient
Post-Training Quantization for Large Language Models").

Activation outliers live in a few input channels; weights are easy to quantise.  Migrate the difficulty:
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)                                 (paper eq. 4)
    Y = (X diag(s)^-1) (diag(s) W)                                               (paper eq. 3)
with alpha = 0.5 by default.  The division of X is folded into the producing norm / linear
(`fewbits.methods.awq.fold_scales` does the same folding), the multiplication into W's columns.
Then W8A8: int8 per-channel weights (round-to-nearest) and int8 per-token dynamic activations,
the activation rounding simulated in the forward pass (`ActQuantLinear`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from fewbits.formats.quant import all_finite
from fewbits.methods.common import MethodError


def smooth_scales(
    act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5, name: str = "linears"
) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max_i,k |W_i[k, j]|^(1-alpha) for linears sharing the input X."""
    if not 0.0 <= alpha <= 1.0:
        raise MethodError(f"{name}: SmoothQuant alpha must lie in [0, 1], got {alpha}")
    a = act_absmax.float()
    if not all_finite(a):
        raise MethodError(f"{name}: activation statistics contain NaN or inf")
    w_absmax = torch.stack([w.detach().abs().amax(0).to(a.device, torch.float32) for w in weights]).amax(0)
    if w_absmax.shape != a.shape:
        raise MethodError(f"{name}: {a.shape[0]} activation channels but weights have {w_absmax.shape[0]} inputs")
    s = a.clamp_min(1e-5).pow(alpha) / w_absmax.clamp_min(1e-5).pow(1 - alpha)
    # channels the calibration never excited keep scale 1 (no information to move)
    return torch.where(a > 0, s.clamp_min(1e-5), torch.ones_like(s))


def quantize_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Simulated symmetric per-token dynamic quantisation: one absmax scale per row of the last dim."""
    L = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / L
    return (torch.round(xf / scale).clamp_(-L, L) * scale).to(x.dtype)


class ActQuantLinear(nn.Module):
    """Wraps a linear-like module (nn.Linear or a quantised linear): its input is rounded to `bits`-bit
    per-token codes before the wrapped module runs (W8A8 simulation).

    Saved as layer kind "act_quant" with its `act_bits`; the wrapped module is saved as its child."""

    layer_kind: ClassVar[str] = "act_quant"

    def __init__(self, inner: nn.Module, bits: int = 8) -> None:
        super().__init__()
        if not 2 <= bits <= 8:
            raise MethodError(f"activation bits must be 2..8, got {bits}")
        self.inner = inner
        self.act_bits = bits

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def in_features(self) -> int:
        return self.inner.in_features

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(quantize_per_token(x, self.act_bits))

    def layer_meta(self) -> dict[str, Any]:
        return {"act_bits": self.act_bits}

    @classmethod
    def from_layer_meta(cls, meta: dict[str, Any], source: Any) -> ActQuantLinear:
        """Rebuild over the already rebuilt child "inner" (`source` is a models.qlinear.LayerSource)."""
        if "inner" not in source.children:
            raise MethodError(f"{source.prefix}: the wrapped layer 'inner' is not described")
        return cls(source.children["inner"], int(meta["act_bits"]))

    def extra_repr(self) -> str:
        return f"act=int{self.act_bits} per-token dynamic"
