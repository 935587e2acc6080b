"""The inverse-Hessian factor GPTQ needs, by recursive blocking on matrix products.

GPTQ wants the upper-triangular U with (H + lambda I)^-1 = U^T U.  With H = R R^T, R upper triangular (a
Cholesky factorisation that starts from the last row instead of the first), U = R^-1.  Both steps recurse
on 2 x 2 blocks until LAPACK takes a small leaf, so nearly all the work is matrix products:

    H = [[H11, H12], [H21, H22]]:  R22 = rchol(H22),  R12 = H12 R22^-T,  R11 = rchol(H11 - R12 R12^T)
    R = [[A, B], [0, D]]:          R^-1 = [[A^-1, -A^-1 B D^-1], [0, D^-1]]

GPTQ factors one Hessian per linear input (a 135M model: 120 of them, up to 1536 x 1536), and its codes
should not depend on the thread count: a one-ulp change of the factor moves codes at rounding ties.  LAPACK's
blocked `potrf` rounds differently on 1 and 2 threads (seen here at 192 x 192), the matrix products and
triangular solves of the recursion do not (they split rows and columns, never the sum: checked bit for bit,
1 vs 2 threads, tests/methods/test_linalg.py).  So the leaves run on one thread and the products on all of
them.  On one thread here LAPACK's float32 `potrf` reaches ~28 GFLOP/s and a triangular solve against the
identity ~80, a matrix product ~165: the recursive form takes ~31 ms for a 1536 x 1536 Hessian instead of
~80 (~19 ms on two threads), to the same accuracy (checked against float64).  Everything is done in place
in one buffer.  All of it is plain torch and runs on the matrix's device (on CUDA the thread pinning is
skipped: it concerns the CPU's thread pool only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fewbits.methods import workspace

LEAF = 192  # at or below this size the blocks go to LAPACK


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """torch (and LAPACK under it) on one thread inside the block, for CPU tensors (restored after it);
    nothing for other devices, whose kernels do not use the CPU thread pool."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _reverse_cholesky_(a: torch.Tensor) -> int:
    """In place: a (symmetric; its upper triangle is read) becomes the upper R with a = R R^T.
    Returns 0, or a positive number when a is not positive definite (a is then unusable)."""
    n = a.shape[0]
    if n <= LEAF:
        # J a J = L L^T (J reverses the order) gives a = (J L J)(J L J)^T with J L J upper triangular
        with one_thread(a.device):
            L, info = torch.linalg.cholesky_ex(a.flip(0, 1))
            a.copy_(L.flip(0, 1))
        return int(info)
    h = n // 2
    info = _reverse_cholesky_(a[h:, h:])
    if info:
        return info
    r22 = a[h:, h:]
    a[:h, h:] = torch.linalg.solve_triangular(r22, a[:h, h:].T, upper=True).T  # R12 R22^T = H12
    a[:h, :h].addmm_(a[:h, h:], a[:h, h:].T, alpha=-1)  # Schur complement
    a[h:, :h] = 0
    return _reverse_cholesky_(a[:h, :h])


def _upper_inverse_(r: torch.Tensor) -> None:
    """In place: the upper-triangular, non-singular r becomes r^-1."""
    n = r.shape[0]
    if n <= LEAF:
        with one_thread(r.device):
            r.copy_(torch.linalg.solve_triangular(r, torch.eye(n, dtype=r.dtype, device=r.device), upper=True))
        return
    h = n // 2
    _upper_inverse_(r[:h, :h])
    _upper_inverse_(r[h:, h:])
    r[:h, h:] = -((r[:h, :h] @ r[:h, h:]) @ r[h:, h:])


def inverse_upper_factor(h: torch.Tensor, shift: float | torch.Tensor = 0.0) -> tuple[torch.Tensor, int]:
    """(U, info): U upper triangular with (h + shift I)^-1 = U^T U for a symmetric positive-definite
    h + shift I; info is 0, or positive when it is not positive definite (U is then unusable).
    h is not modified; U comes from `fewbits.methods.workspace`, on h's device."""
    a = workspace.empty(*h.shape, dtype=h.dtype, device=h.device).copy_(h)
    a.diagonal().add_(shift)
    info = _reverse_cholesky_(a)
    if info == 0:
        _upper_inverse_(a)
    return a, info
