"""SmoothQuant: the scale formula by hand, and W8A8 with smoothing beats plain W8A8 when the
activations have outlier channels."""

from __future__ import annotations

import torch
from torch import nn

from fewbits.formats.quant import fake_quantize
from fewbits.methods.smoothquant import ActQuantLinear, quantize_per_token, smooth_scales


def test_scales_by_hand() -> None:
    act = torch.tensor([16.0, 1.0, 4.0])
    w = torch.tensor([[0.25, 1.0, 0.5], [-1.0, 0.5, 0.25]])  # column abs-max 1, 1, 0.5
    s = smooth_scales(act, [w], alpha=0.5)
    assert torch.allclose(s, torch.tensor([4.0, 1.0, 2.0 / 0.5**0.5]))
    s75 = smooth_scales(act, [w], alpha=0.75)
    assert torch.allclose(s75, torch.tensor([8.0, 1.0, 4**0.75 / 0.5**0.25]))


def test_per_token_quantisation() -> None:
    x = torch.tensor([[127.0, 1.2, -0.4], [0.5, -0.25, 0.0]])
    q = quantize_per_token(x)
    assert torch.equal(q[0], torch.tensor([127.0, 1.0, -0.0]))
    assert torch.allclose(q[1], torch.tensor([0.5, -0.25, 0.0]), atol=0.5 / 127 / 2 + 1e-7)


def test_smoothing_beats_plain_w8a8_on_outlier_channels() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g)
    x[:, [3, 77, 400]] *= 40  # outlier channels, as in large models
    w = torch.randn(384, 512, generator=g) * 0.02
    ref = x @ w.T

    def w8a8(xx: torch.Tensor, ww: torch.Tensor) -> float:
        y = quantize_per_token(xx) @ fake_quantize(ww, "int8").T
        return float((y - ref).norm() / ref.norm())

    plain = w8a8(x, w)
    s = smooth_scales(x.abs().amax(0), [w], alpha=0.5)
    smoothed = w8a8(x / s, w * s)
    assert smoothed < 0.5 * plain, (smoothed, plain)
    lin = nn.Linear(512, 384, bias=False)
    lin.weight.data.copy_(w * s)
    wrapped = ActQuantLinear(lin)
    assert torch.allclose(wrapped(x / s), quantize_per_token(x / s) @ (w * s).T, atol=1e-4)
