"""The inner loop of GPTQ, compiled: quantise the columns of one lazy block in order, each one's rounding
error spread over the columns after it (paper eq. 2).

This is the one part of GPTQ that is inherently sequential (column i+1 is rounded only after column i's
error has moved it) and made of tiny operations: in torch it costs five dispatches per column, ~24 us
each time, which over a 135M model's 98k columns is seconds of interpreter work around microseconds of
arithmetic.  numba compiles it to a plain loop over float32 memory (cached on disk after the first call).

Arithmetic is float32 in the order the torch form uses: q = clamp(rint(w / s), lo, hi) (rint rounds half
to even, as torch.round), e = w - q s, then w_k -= e Hs[i, k] for every later column k of the block.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def obs_columns(W: np.ndarray, S: np.ndarray, LO: np.ndarray, HI: np.ndarray, Hs: np.ndarray,
                start: int, stop: int, qlo: np.float32, qhi: np.float32, per_element_range: bool) -> None:
    """Quantise columns start..stop-1 of a block held transposed (W: (n, rows), column i is the row W[i]),
    updating every later column of the block in place.

    S: (n, rows) scales per column and row.  The rounded value is clamped to [qlo, qhi], or to
    [LO[i, r], HI[i, r]] with `per_element_range` (asymmetric formats: the range shifted by the zero
    point).  Hs: (n, n) rows of the inverse-Hessian factor divided by their diagonal.  The last column of
    the block has nothing after it and is skipped (its code is recovered afterwards, like every other).
    """
    n, rows = W.shape
    err = np.empty(rows, dtype=np.float32)
    for i in range(start, min(stop, n - 1)):
        for r in range(rows):
            s = S[i, r]
            q = np.rint(W[i, r] / s)
            lo = LO[i, r] if per_element_range else qlo
            hi = HI[i, r] if per_element_range else qhi
            if q < lo:
                q = lo
            elif q > hi:
                q = hi
            err[r] = W[i, r] - q * s
        for k in range(i + 1, n):
            h = Hs[i, k]
            for r in range(rows):
                W[k, r] -= err[r] * h
