"""The recursive Cholesky factor and triangular inverse against LAPACK in float64."""

from __future__ import annotations

import pytest
import torch

from fewbits.methods.linalg import LEAF, cholesky_lower, lower_inverse


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g) * torch.rand(n, generator=g) * 3  # uneven channel scales
    h = x.T @ x / (4 * n)
    return h + 0.01 * h.diagonal().mean() * torch.eye(n)


@pytest.mark.parametrize("n", [7, LEAF, LEAF + 1, 577, 1100])
def test_cholesky_and_inverse_match_float64(n):
    h = _spd(n)
    ref_l = torch.linalg.cholesky(h.double())
    L, info = cholesky_lower(h)
    assert info == 0
    assert torch.equal(L, L.tril())  # nothing above the diagonal
    assert float((L.double() - ref_l).norm() / ref_l.norm()) < 1e-6
    inv = lower_inverse(L)
    ref_inv = torch.linalg.inv(ref_l)
    assert torch.equal(inv, inv.tril())
    assert float((inv.double() - ref_inv).norm() / ref_inv.norm()) < 1e-5
    # and it is an inverse of the factor it was given
    assert float((inv.double() @ L.double() - torch.eye(n, dtype=torch.float64)).abs().max()) < 1e-4


@pytest.mark.parametrize("bad", [3, LEAF + 50, 700])
def test_not_positive_definite_reports_the_leading_minor_like_lapack(bad):
    n = 800
    h = _spd(n, seed=1)
    h[bad, bad] = -1.0  # leading minors of order > bad are not positive definite
    _, info = cholesky_lower(h)
    _, ref_info = torch.linalg.cholesky_ex(h.double())
    assert info == int(ref_info) == bad + 1
