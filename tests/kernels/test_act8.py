"""fewbits.kernels.act8: the int8 and int16 activation blocks' specifications in torch (the operators' references)."""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels.act8 import dequantize_blocks, int16_blocks, quantize_blocks


def test_codes_and_scales_as_specified() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g) * 5
    q, d = quantize_blocks(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and d.shape == (3, 3)
    blocks = x.reshape(3, 3, 32)
    assert torch.equal(d, blocks.abs().amax(-1) / 127)
    assert int(q.abs().max()) == 127 and bool((q.reshape(3, 3, 32).abs().amax(-1) == 127).all())
    err = (dequantize_blocks(q, d) - x).abs().reshape(3, 3, 32)
    assert bool((err <= d.unsqueeze(-1) / 2 * (1 + 1e-6)).all())  # within half a step of the block's grid


def test_ties_round_to_even_and_a_zero_block_stays_zero() -> None:
    x = torch.zeros(1, 64)
    x[0, 0] = 127.0  # d = 1: the codes are x itself, rounded
    x[0, 1:5] = torch.tensor([0.5, 1.5, 2.5, -2.5])
    q, d = quantize_blocks(x)
    assert q[0, :5].tolist() == [127, 0, 2, 2, -2]
    assert float(d[0, 1]) == 0.0 and not bool(q[0, 32:].any())


def test_a_width_not_of_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the block of 32"):
        quantize_blocks(torch.zeros(2, 48))


def test_int16_blocks_are_exact_near_the_block_maximum() -> None:
    """The specification of the AVX2 one-row paths' activations: the step is 2^-14 of the block's leading power of
    two, elements within 2^-7 of the largest come back exactly, the rest within half a step; a block of zeros
    or of magnitudes below 2^-112 reads as zero."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 96, generator=g) * torch.logspace(-4, 2, 96)).to(torch.bfloat16)
    x[1, 32:64] = 0
    x[2, 64:96] = 2.0**-120
    q, d = int16_blocks(x)
    xf = x.float().view(3, 3, 32)
    amax = xf.abs().amax(-1)
    lead = 2.0 ** torch.floor(torch.log2(amax.clamp_min(2.0**-126)))
    assert torch.equal(d[amax >= 2.0**-112], lead[amax >= 2.0**-112] * 2.0**-14)
    assert (d[1, 1] == 0) and (d[2, 2] == 0) and not q.view(3, 3, 32)[1, 1].any() and not q.view(3, 3, 32)[2, 2].any()
    back = q.view(3, 3, 32).float() * d[..., None]
    live = (d > 0)[..., None].expand_as(xf)
    near = (xf.abs() >= amax[..., None] * 2.0**-7) & live
    assert near.sum() > 32 and torch.equal(back[near], xf[near])
    assert ((back - xf).abs() <= d[..., None] / 2)[live].all() and not back[~live].any()
    assert q.abs().max() <= 255 * 128


def test_int16_blocks_saturate_an_fp32_value_that_rounds_to_two_to_the_fifteen() -> None:
    """An fp32 element just below 2^(e+1) is 32767.99... steps: it rounds to 2^15, one past int16, and is held at
    32767 (as the operators' saturating pack); the negative side reaches -32768 without saturating."""
    x = torch.zeros(1, 32)
    x[0, 0] = float(torch.nextafter(torch.tensor(2.0), torch.tensor(0.0)))  # the largest fp32 below 2
    x[0, 1] = -1.0
    q, d = int16_blocks(x)
    assert float(d[0, 0]) == 2.0**-14 and int(q[0, 0]) == 32767 and int(q[0, 1]) == -16384
    q, _ = int16_blocks(-x)
    assert int(q[0, 0]) == -32768
    with pytest.raises(ValueError, match="multiple of the block of 32"):
        int16_blocks(torch.zeros(1, 48))
