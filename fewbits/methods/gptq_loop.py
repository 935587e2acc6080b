"""The inner loop of GPTQ, compiled: quantise the columns of one lazy block in order, each one's rounding
error spread over the block's columns after it (paper eq. 2).

This is the part of GPTQ that is inherently sequential (column i+1 is rounded only after column i's error
has moved it) and made of tiny operations: in torch it costs five dispatches per column, ~24 us each time,
which over a 135M model's 98k columns is seconds of interpreter work around microseconds of arithmetic.
The block is held transposed, so a column is a contiguous vector and every step is a vectorised loop
over rows.  It runs on one thread.  Rows never interact, so sharing them out over threads is exact, but
inside a calibration run it does not pay: numba's `prange` made SmolLM2's loop slower (0.97 vs 0.68 s),
and two Python threads on half the rows each took a 3072-row block from 5.9 to 4.5 ms alone but to 6.0
ms right after a torch operation, whose OpenMP workers keep spinning on the second core.

Arithmetic is float32 in the order the textbook form uses: q = clamp(rint(w / s), lo - z, hi - z) (rint
rounds half to even, as torch.round), e = w - q s, then w_k -= e Hs[i, k] for every later column k of the
block.  The stored code is q + z + offset; the error divided by the factor's diagonal is kept for the lazy
update of the columns after the block (eq. 4), which is one matrix product done by the caller.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def quantize_block_columns(WT: np.ndarray, scale: np.ndarray, zero: np.ndarray, has_zero: bool,
                           group_of: np.ndarray, Hs: np.ndarray, d: np.ndarray, b0: int, start: int, stop: int,
                           qlo: np.float32, qhi: np.float32, off: np.float32, codesT: np.ndarray,
                           ET: np.ndarray, loss: np.ndarray) -> None:
    """Quantise columns start..stop-1 of the lazy block that starts at column b0, held transposed (WT:
    (block width, rows), column j is the contiguous row WT[j - b0]), updating the block's later columns.

    scale, zero: (rows, n_groups), column j uses group group_of[j] (zero ignored unless has_zero).
    Hs: rows of the block's inverse-Hessian factor divided by their diagonal d.  Writes the codes of
    column j to codesT[j] (uint8, (cols, rows)) and its errors divided by d to ET[j - b0], and adds each
    row's OBS loss (error / d)^2 / 2 to loss.
    """
    nb, rows = WT.shape
    s = np.empty(rows, dtype=np.float32)
    z = np.zeros(rows, dtype=np.float32)
    err = np.empty(rows, dtype=np.float32)
    current = -1
    for j in range(start, stop):
        i = j - b0
        if group_of[j] != current:  # this group's scales (and zero points) as contiguous vectors
            current = group_of[j]
            for r in range(rows):
                s[r] = scale[r, current]
                if has_zero:
                    z[r] = zero[r, current]
        w = WT[i]
        c = codesT[j]
        e_out = ET[i]
        for r in range(rows):
            q = np.rint(w[r] / s[r])
            lo = qlo - z[r]
            hi = qhi - z[r]
            if q < lo:
                q = lo
            elif q > hi:
                q = hi
            e = w[r] - q * s[r]
            err[r] = e
            c[r] = np.uint8(q + z[r] + off)
            e_out[r] = e / d[i]
            loss[r] += e_out[r] * e_out[r] * np.float32(0.5)
        for k in range(i + 1, nb):
            h = Hs[i, k]
            wk = WT[k]
            for r in range(rows):
                wk[r] -= err[r] * h
