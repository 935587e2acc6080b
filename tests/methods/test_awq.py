"""AWQ: folding is exact, the scale search never loses to round-to-nearest and wins when a few input
channels carry large activations, and clipping lowers the output error."""

from __future__ import annotations

import torch
from torch import nn

from fewbits.formats.quant import fake_quantize
from fewbits.methods.awq import apply_clip, awq_search_scales, fold_scales, search_clip


def _salient(tokens: int = 512, cols: int = 128, rows: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g)
    x[:, :4] *= 25  # salient input channels
    w = torch.randn(rows, cols, generator=g) * 0.02
    return x, w


def _err(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ wq.T - x @ w.T) ** 2).mean())


def test_scale_search_beats_rtn_when_channels_are_salient() -> None:
    x, w = _salient()
    w2 = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    res = awq_search_scales(x, [w, w2], "int3-g32")
    assert len(res.losses) == 20
    assert res.alpha > 0
    assert res.best_loss < 0.8 * res.rtn_loss
    # the loss the search reports is the real output error of the scaled, quantised weight
    s = res.scales
    wq = fake_quantize(w * s, "int3-g32") / s
    wq2 = fake_quantize(w2 * s, "int3-g32") / s
    assert abs(_err(w, wq, x) + _err(w2, wq2, x) - res.best_loss) < 1e-6 * res.rtn_loss + 1e-12
    # alpha = 0 is exactly round-to-nearest
    assert abs(res.rtn_loss - _err(w, fake_quantize(w, "int3-g32"), x) - _err(w2, fake_quantize(w2, "int3-g32"), x)) \
        < 1e-6 * res.rtn_loss


class _RMSNorm(nn.Module):
    def __init__(self, n: int, plus_one: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.1 + (0 if plus_one else 1))
        self.plus_one = plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * ((1 + self.weight) if self.plus_one else self.weight)


def test_folding_keeps_the_float_function() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    s = torch.rand(32) * 3 + 0.2
    for plus_one in (False, True):
        norm, a, b = _RMSNorm(32, plus_one), nn.Linear(32, 8), nn.Linear(32, 8, bias=False)
        with torch.no_grad():
            ref = (a(norm(x)), b(norm(x)))
            fold_scales(norm.weight.data, None, [a.weight.data, b.weight.data], s, "norm", plus_one)
            assert torch.allclose(a(norm(x)), ref[0], atol=1e-5) and torch.allclose(b(norm(x)), ref[1], atol=1e-5)
    up, down = nn.Linear(32, 48), nn.Linear(48, 8)
    s = torch.rand(48) + 0.5
    with torch.no_grad():
        ref = down(torch.relu(up(x)))  # a positive-homogeneous activation commutes with positive scales
        fold_scales(up.weight.data, up.bias.data, [down.weight.data], s, "linear")
        assert torch.allclose(down(torch.relu(up(x))), ref, atol=1e-5)


def test_clip_search_lowers_output_error() -> None:
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 128)) * 0.02
    x = torch.randn(256, 128)
    mx = search_clip(w, x, "int3-g32")
    assert mx.shape == (64, 4)
    assert (mx <= w.abs().reshape(64, 4, 32).amax(-1) + 1e-7).all()
    clipped = fake_quantize(apply_clip(w, mx, "int3-g32"), "int3-g32")
    assert _err(w, clipped, x) < 0.95 * _err(w, fake_quantize(w, "int3-g32"), x)
