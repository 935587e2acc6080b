"""GPTQ's column loop compiled for CPU: the accelerator of `fewbits.methods.gptq.gptq_columns` (the plain
torch form, which is the specification and runs on any device), chosen by `fewbits.methods.backend` for
CPU tensors and tested code-for-code against it (tests/methods/test_backend_equivalence.py).

The inner loop quantises the columns of one lazy block in order, each one's rounding error spread over the
block's columns after it (paper eq. 2).  It is the part of GPTQ that is inherently sequential (column i+1
is rounded only after column i's error has moved it) and made of tiny operations: in torch it costs five
dispatches per column, ~24 us each time, which over a 135M model's 98k columns is seconds of interpreter
work around microseconds of arithmetic.
The block is held transposed, so a column is a contiguous vector and every step is a vectorised loop
over rows.  It runs on one thread.  Rows never interact, so sharing them out over threads is exact, but
inside a calibration run it does not pay: numba's `prange` made SmolLM2's loop slower (0.97 vs 0.68 s),
and two Python threads on half the rows each took a 3072-row block from 5.9 to 4.5 ms alone but to 6.0
ms right after a torch operation, whose OpenMP workers keep spinning on the second core.

Arithmetic is float32 in the order the plain form uses: q = clamp(rint(w / s), lo - z, hi - z) (rint
rounds half to even, as torch.round), e = w - q s, then w_k -= e Hs[i, k] for every later column k of the
block.  The stored code is q + z + offset; the error divided by the factor's diagonal is kept for the lazy
update of the columns after the block (eq. 4), which is one matrix product done by the driver.  The
errors of a tile of 8 columns reach the rest of the block together, their 8 products summed first
(`_tile_update`, which reads each later column once per tile instead of once per column); the plain form
sums in the same order (`fewbits.methods.gptq.spread_tile`), so the two give the same bits.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fewbits.formats.format import Format
from fewbits.methods import workspace
from fewbits.methods.gptq import TILE, group_scales, int_range


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
    E = np.empty((TILE, rows), dtype=np.float32)  # errors of the current tile of columns
    qc = np.empty(rows, dtype=np.float32)  # stored codes as floats (converted in a loop of their own)
    current = -1
    t0 = start
    for j in range(start, stop):
        i = j - b0
        err = E[j - t0]
        if group_of[j] != current:  # this group's scales (and zero points) as contiguous vectors
            current = group_of[j]
            for r in range(rows):
                s[r] = scale[r, current]
                if has_zero:
                    z[r] = zero[r, current]
        w = WT[i]
        c = codesT[j]
        e_out = ET[i]
        for r in range(rows):  # branch-free, so that it vectorises
            q = min(max(np.rint(w[r] / s[r]), qlo - z[r]), qhi - z[r])
            e = w[r] - q * s[r]
            err[r] = e
            qc[r] = q + z[r] + off
            eo = e / d[i]
            e_out[r] = eo
            loss[r] += eo * eo * np.float32(0.5)
        for r in range(rows):
            c[r] = np.uint8(qc[r])
        t1 = min(t0 + TILE, stop)
        for k in range(i + 1, t1 - b0):  # inside the tile: one column at a time
            h = Hs[i, k]
            wk = WT[k]
            for r in range(rows):
                wk[r] -= err[r] * h
        if j == t1 - 1:  # the tile is done: its errors reach the rest of the block together
            _tile_update(WT, E, Hs, t0 - b0, t1 - t0)
            t0 = t1


@njit(cache=True, nogil=True)
def _tile_update(WT: np.ndarray, E: np.ndarray, Hs: np.ndarray, i0: int, m: int) -> None:
    """w_k -= sum_t E[t] Hs[i0 + t, k] for every column k of the block after the tile i0..i0+m-1: a full
    tile (written out for TILE = 8) in one pass over w_k with its products summed first (w_k read once per
    tile, not once per column), a partial tile column by column."""
    nb, rows = WT.shape
    for k in range(i0 + m, nb):
        wk = WT[k]
        if m == TILE:
            h0, h1, h2, h3 = Hs[i0, k], Hs[i0 + 1, k], Hs[i0 + 2, k], Hs[i0 + 3, k]
            h4, h5, h6, h7 = Hs[i0 + 4, k], Hs[i0 + 5, k], Hs[i0 + 6, k], Hs[i0 + 7, k]
            e0, e1, e2, e3, e4, e5, e6, e7 = E[0], E[1], E[2], E[3], E[4], E[5], E[6], E[7]
            for r in range(rows):
                wk[r] -= (((e0[r] * h0 + e1[r] * h1) + (e2[r] * h2 + e3[r] * h3))
                          + ((e4[r] * h4 + e5[r] * h5) + (e6[r] * h6 + e7[r] * h7)))
        else:
            for t in range(m):
                h = Hs[i0 + t, k]
                et = E[t]
                for r in range(rows):
                    wk[r] -= et[r] * h


@njit(cache=True, nogil=True)
def symmetric_permute(H: np.ndarray, p: np.ndarray, out: np.ndarray) -> None:
    """out[i, j] = H[p[i], p[j]] in one pass (two torch index_selects over a 1536 x 1536 Hessian: ~8 ms
    here, cold; this ~2.3 ms)."""
    n = H.shape[0]
    for i in range(n):
        src = H[p[i]]
        o = out[i]
        for j in range(n):
            o[j] = src[p[j]]


@njit(cache=True, nogil=True)
def permuted_transpose(W: np.ndarray, p: np.ndarray, out: np.ndarray) -> None:
    """out[j, r] = W[r, p[j]] in one pass, in bands of 64 rows (the weight transposed with its columns in
    quantisation order)."""
    rows, cols = W.shape
    for r0 in range(0, rows, 64):
        r1 = min(r0 + 64, rows)
        for j in range(cols):
            c = p[j]
            o = out[j]
            for r in range(r0, r1):
                o[r] = W[r, c]


@njit(cache=True, nogil=True)
def gathered_transpose(CT: np.ndarray, p: np.ndarray, out: np.ndarray) -> None:
    """out[r, c] = CT[p[c], r] in one pass, in bands of 64 rows of out (codes held transposed in
    quantisation order, back to the weight's layout and column order)."""
    cols, rows = CT.shape
    for r0 in range(0, rows, 64):
        r1 = min(r0 + 64, rows)
        for c in range(cols):
            src = CT[p[c]]
            for r in range(r0, r1):
                out[r, c] = src[r]


def permute_hessian(H: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """H[order][:, order] (a `fewbits.methods.workspace` matrix) in one compiled pass."""
    n = H.shape[0]
    out = workspace.empty(n, n, device="cpu")
    symmetric_permute(H.contiguous().numpy(), order.numpy(), out.numpy())
    return out


def gptq_columns_compiled(W: torch.Tensor, U: torch.Tensor, order: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor | None, fmt: Format, block: int, static: bool, name: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fewbits.methods.gptq.gptq_columns` for CPU tensors, with the column loop compiled: the same
    arguments, the same results (up to rounding ties)."""
    rows, cols = W.shape
    g = fmt.group_size if fmt.granularity == "group" else cols
    # W held transposed, (cols, rows), in quantisation order: column j is the contiguous row WT[j], a
    # lazy block a slice of rows and its update one in-place matmul; a non-static block is a whole number
    # of groups starting at a group
    WT = workspace.empty(cols, rows, device="cpu")
    permuted_transpose(W.contiguous().numpy(), order.numpy(), WT.numpy())
    group_of = (order // g).numpy()
    qlo, qhi, off = int_range(fmt)
    codesT = workspace.empty(cols, rows, dtype=torch.uint8, device="cpu")
    ET_all = workspace.empty(min(block, cols), rows, device="cpu")  # one lazy block's errors, divided by the diagonal
    losses = torch.zeros(rows, device="cpu")
    S_, C_, L_ = scale.numpy(), codesT.numpy(), losses.numpy()
    Z_ = zero.numpy() if zero is not None else np.zeros((1, 1), dtype=np.float32)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        step = b1 - b0 if static else g
        # row i of Hs is row i of the inverse factor divided by its diagonal: eq. 2 for column i is
        # w_k -= e_i Hs[i, k] for the block's later columns k
        d = U[b0:b1, b0:b1].diagonal().contiguous()
        Hs = (U[b0:b1, b0:b1] / d[:, None]).contiguous()
        ET = ET_all[:b1 - b0]
        WT_, Hs_, d_, ET_ = WT[b0:b1].numpy(), Hs.numpy(), d.numpy(), ET.numpy()
        for a in range(b0, b1, step):
            if not static:  # a new group: scales from the current (updated) weights
                s_, z_ = group_scales(WT[a:a + g].T, fmt, name)
                scale[:, a // g] = s_
                if zero is not None:
                    zero[:, a // g] = z_
            quantize_block_columns(WT_, S_, Z_, zero is not None, group_of, Hs_, d_, b0, a, a + step,
                                   np.float32(qlo), np.float32(qhi), np.float32(off), C_, ET_, L_)
        if b1 < cols:  # lazy update of every later column (eq. 4)
            WT[b1:].addmm_(U[b0:b1, b1:].T, ET, alpha=-1)
    codes = torch.empty(rows, cols, dtype=torch.uint8, device="cpu")
    gathered_transpose(C_, torch.argsort(order).numpy(), codes.numpy())
    workspace.release(WT, codesT, ET_all)
    return codes, losses
