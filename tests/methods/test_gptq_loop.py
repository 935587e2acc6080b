"""The compiled GPTQ column loop against the same loop written with torch operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits.methods.gptq_loop import quantize_block_columns


def _torch_loop(W, scale, zero, group_of, Hs, d, b0, start, stop, qlo, qhi, off, codes, E):
    """Reference (natural layout, all rows at once): round with torch.round (half to even), clamp, spread
    the error over the block's later columns."""
    nb = Hs.shape[0]
    for j in range(start, stop):
        i, gi = j - b0, int(group_of[j])
        s = scale[:, gi]
        z = zero[:, gi] if zero is not None else torch.zeros_like(s)
        q = torch.maximum(torch.minimum(torch.round(W[:, j] / s), qhi - z), qlo - z)
        e = W[:, j] - q * s
        codes[:, j] = (q + z + off).to(torch.uint8)
        E[:, i] = e / d[i]
        W[:, b0 + i + 1:b0 + nb] -= e[:, None] * Hs[i, i + 1:][None, :]


def _problem(asym: bool):
    g = torch.Generator().manual_seed(0)
    rows, cols, b0, nb, gs = 40, 48, 8, 32, 16  # block of 32 columns at 8, groups of 16
    n_groups = cols // gs
    scale = 2.0 ** torch.randint(-5, -2, (rows, n_groups), generator=g).float()  # powers of two: exact ties
    W = torch.randn(rows, cols, generator=g) * 0.3
    group_of = torch.arange(cols) // gs
    W[:, b0] = (torch.randint(-6, 6, (rows,), generator=g) + 0.5) * scale[:, group_of[b0]]  # all ties
    U = torch.linalg.cholesky(torch.eye(nb) + 0.3 * torch.ones(nb, nb)).T.contiguous()  # upper, dense rows
    d = U.diagonal().contiguous()
    Hs = (U / d[:, None]).contiguous()
    zero = torch.randint(0, 16, (rows, n_groups), generator=g).float() if asym else None
    return W, scale, zero, group_of, Hs, d, b0, nb


def _compiled(W, scale, zero, group_of, Hs, d, b0, nb, qlo, qhi, off):
    """The kernel on the transposed block, in two segments (as group scales split a block); results
    returned in the natural layout."""
    WT = W.T.contiguous()
    codesT = torch.zeros(W.shape[1], W.shape[0], dtype=torch.uint8)
    ET = torch.zeros(nb, W.shape[0])
    loss = torch.zeros(W.shape[0])
    z = zero.numpy() if zero is not None else np.zeros((1, 1), dtype=np.float32)
    for a in (b0, b0 + nb // 2):
        quantize_block_columns(WT[b0:b0 + nb].numpy(), scale.numpy(), z, zero is not None, group_of.numpy(),
                               Hs.numpy(), d.numpy(), b0, a, a + nb // 2, np.float32(qlo), np.float32(qhi),
                               np.float32(off), codesT.numpy(), ET.numpy(), loss.numpy())
    return WT.T, codesT.T, ET.T, loss


@pytest.mark.parametrize("asym", [False, True])
def test_matches_torch_loop_including_ties(asym: bool) -> None:
    W, scale, zero, group_of, Hs, d, b0, nb = _problem(asym)
    qlo, qhi, off = (0.0, 15.0, 0.0) if asym else (-7.0, 7.0, 8.0)
    ref_w, ref_c, ref_e = W.clone(), torch.zeros(W.shape, dtype=torch.uint8), torch.zeros(W.shape[0], nb)
    for a in (b0, b0 + nb // 2):
        _torch_loop(ref_w, scale, zero, group_of, Hs, d, b0, a, a + nb // 2, qlo, qhi, off, ref_c, ref_e)
    got_w, got_c, got_e, got_loss = _compiled(W, scale, zero, group_of, Hs, d, b0, nb, qlo, qhi, off)
    assert torch.equal(got_c[:, b0:b0 + nb], ref_c[:, b0:b0 + nb])
    assert torch.equal(got_w[:, :b0], W[:, :b0]) and torch.equal(got_w[:, b0 + nb:], W[:, b0 + nb:])  # block only
    assert torch.allclose(got_w, ref_w, rtol=0, atol=1e-5)
    assert torch.allclose(got_e, ref_e, rtol=0, atol=1e-5)
    assert torch.allclose(got_loss, (ref_e**2).sum(1) / 2, rtol=1e-5, atol=0)  # the OBS loss of each row
    # a tie rounded the other way would move the later columns by a whole step times Hs: far outside atol
    assert float(Hs[0, 1:].abs().min()) * float(scale.min()) > 1e-3
