"""fewbits.kernels.act8: the int8 activation blocks' specification in torch (the operators' reference)."""

from __future__ import annotations

import pytest
import torch

from fewbits.kernels.act8 import dequantize_blocks, quantize_blocks


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
