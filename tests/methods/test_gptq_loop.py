"""The compiled GPTQ column loop against the same loop written with torch operations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits.methods.gptq_loop import obs_columns


def _torch_loop(W, S, lo, hi, Hs, start, stop):
    """Reference: round with torch.round (half to even), clamp, spread the error over later columns."""
    n = W.shape[0]
    for i in range(start, min(stop, n - 1)):
        q = torch.clamp(torch.round(W[i] / S[i]), lo[i], hi[i])
        err = W[i] - q * S[i]
        W[i + 1:] -= Hs[i, i + 1:, None] * err[None, :]


@pytest.mark.parametrize("per_element", [False, True])
def test_matches_torch_loop_including_ties(per_element: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n, rows = 24, 40
    S = 2.0 ** torch.randint(-5, -2, (n, rows), generator=g).float()  # powers of two: ties stay exact
    W = torch.randn(n, rows, generator=g) * 0.3
    W[0] = (torch.randint(-6, 6, (rows,), generator=g) + 0.5) * S[0]  # column 0: every weight a tie
    assert torch.equal(W[0] / S[0], torch.floor(W[0] / S[0]) + 0.5)
    U = torch.linalg.cholesky(torch.eye(n) + 0.3 * torch.ones(n, n)).T.contiguous()  # upper, dense rows
    Hs = U / U.diagonal()[:, None]
    if per_element:  # asymmetric: the clamp range moves with a zero point per element
        z = torch.randint(0, 16, (n, rows), generator=g).float()
        lo, hi = (0 - z).contiguous(), (15 - z).contiguous()
    else:
        lo, hi = torch.full((n, rows), -7.0), torch.full((n, rows), 7.0)
    ref = W.clone()
    _torch_loop(ref, S, lo, hi, Hs, 0, n)
    got = W.clone()
    none = np.zeros((1, 1), dtype=np.float32)
    LO, HI = (lo.numpy(), hi.numpy()) if per_element else (none, none)
    for a in range(0, n, 8):  # in segments, as group scales split a block
        obs_columns(got.numpy(), S.numpy(), LO, HI, Hs.numpy(), a, a + 8, np.float32(-7), np.float32(7), per_element)
    assert torch.equal(got[0], W[0])  # a column is never changed once it is quantised
    assert torch.allclose(got, ref, rtol=0, atol=1e-5)
    # a tie rounded the other way moves the later columns by a whole step times Hs: far outside atol
    assert float(Hs[0, 1:].abs().min()) * float(S[0].min()) > 1e-3
