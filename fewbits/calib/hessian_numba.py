"""The mean of the Hessian's float32 partial sums, compiled for CPU: the accelerator of
`fewbits.calib.stats.mean_of_partials` (plain torch, any device), chosen by `fewbits.methods.backend`.

Both compute float32(((p0 + p1) + ...) / tokens) with the sum in float64, in the same order, so they give
the same bits (tests/calib/test_stats.py); this one in one pass over the partials, without the float64
matrix the torch form makes (its passes cost 0.5 s of a SmolLM2 GPTQ).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fewbits.methods import workspace


@njit(cache=True, nogil=True)
def _mean_of_partials(parts: tuple, tokens: np.float64, out: np.ndarray) -> None:
    """out = float32(((p0 + p1) + ...) / tokens), the sum in float64 in the order given."""
    n, m = out.shape
    for i in range(n):
        for j in range(m):
            acc = np.float64(parts[0][i, j])
            for k in range(1, len(parts)):
                acc += np.float64(parts[k][i, j])
            out[i, j] = np.float32(acc / tokens)


def mean_of_partials_compiled(parts: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """float32(sum(parts) / tokens) of float32 CPU matrices, summed in float64 in list order (a
    `fewbits.methods.workspace` matrix)."""
    arrays = tuple(p.contiguous().numpy() for p in parts)
    out = workspace.empty(*parts[0].shape, device="cpu")
    _mean_of_partials(arrays, np.float64(tokens), out.numpy())
    return out
