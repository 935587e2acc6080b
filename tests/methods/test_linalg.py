"""The recursive inverse-Hessian factor against LAPACK in float64."""

from __future__ import annotations

import pytest
import torch

from fewbits.methods.linalg import LEAF, inverse_upper_factor


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g) * torch.rand(n, generator=g) * 3  # uneven channel scales
    return x.T @ x / (4 * n)


@pytest.mark.parametrize("n", [7, LEAF, LEAF + 1, 577, 1100])
def test_factor_of_the_inverse_matches_float64(n: int) -> None:
    h = _spd(n)
    shift = 0.01 * float(h.diagonal().mean())
    before = h.clone()
    U, info = inverse_upper_factor(h, shift)
    assert info == 0
    assert torch.equal(h, before)  # the input is left alone
    assert torch.equal(U, U.triu())  # nothing below the diagonal
    hd = h.double() + shift * torch.eye(n, dtype=torch.float64)
    inv = torch.linalg.inv(hd)
    # the factor is unique (positive diagonal): compare with float64's, then check U^T U = (h + shift I)^-1
    ref = torch.linalg.cholesky(inv, upper=True)  # upper U with inv = U^T U, as the GPTQ paper takes it
    assert float((U.double() - ref).norm() / ref.norm()) < 1e-5
    assert float((U.double().T @ U.double() - inv).norm() / inv.norm()) < 1e-5


@pytest.mark.parametrize("bad", [3, LEAF + 50, 700])
def test_not_positive_definite_is_reported(bad: int) -> None:
    h = _spd(800, seed=1)
    h[bad, bad] = -1.0
    assert int(torch.linalg.cholesky_ex(h.double())[1]) > 0
    assert inverse_upper_factor(h, 0.01)[1] > 0
    assert inverse_upper_factor(_spd(800, seed=1), 0.01)[1] == 0


@pytest.mark.parametrize("n", [577, 1536])
def test_the_factor_has_the_same_bits_on_any_thread_count(n: int) -> None:
    """GPTQ codes at rounding ties follow the factor's last bit, so a lone process and torchrun ranks
    (fewer threads each) must compute the same factor; only the LAPACK leaves need one thread for that."""
    h = _spd(n, seed=2)
    shift = 0.01 * float(h.diagonal().mean())
    one = inverse_upper_factor(h, shift)[0]
    n_before = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(inverse_upper_factor(h, shift)[0], one), threads
    finally:
        torch.set_num_threads(n_before)
