"""int8 activations in blocks of 32 columns, as llama.cpp's Q8_0 rounds them: one specification, two sides.

For each row of x and each block of 32 consecutive columns: d = amax / 127 (fp32), codes = round(x * (1 / d))
with ties to even (all zero where amax is 0), so x ~ d * codes.  The operators that offer int8 activations
(`fewbits.kernels.cpu_int4`'s `cpu_q4_a8`, `fewbits.kernels.rows`' ``int8_mm_a8``) include `Q8_BLOCK_SRC`;
`quantize_blocks` is the same arithmetic in torch, the reference their tests compare against bit for bit.
"""

from __future__ import annotations

import torch

BLOCK = 32

#: C++ of one block's quantisation.  The volatile temporaries keep -ffast-math from rewriting the arithmetic
#: (1 / (amax / 127) is not 127 / amax in floats, nor amax / 127 the product amax * (1 / 127)), so the codes
#: are the same under every set of compiler flags and equal `quantize_blocks`'.
Q8_BLOCK_SRC = r"""
inline float fb_q8_block(const float* v, int n, int8_t* q) {
  float amax = 0.f;
  for (int k = 0; k < n; ++k) amax = std::max(amax, std::fabs(v[k]));
  volatile float c127 = 127.f;
  volatile float dv = amax / c127;
  const float d = dv;
  volatile float idv = d > 0.f ? 1.f / d : 0.f;
  const float id = idv;
  for (int k = 0; k < n; ++k) q[k] = static_cast<int8_t>(std::nearbyint(v[k] * id));
  return d;
}
"""


def quantize_blocks(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K), K a multiple of `block` -> (codes (..., K) int8, d (..., K / block) fp32), x ~ codes * d."""
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block of {block} columns")
    v = x.float().reshape(*x.shape[:-1], -1, block)
    d = v.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(v * inv).to(torch.int8)
    return q.reshape(x.shape), d.squeeze(-1)


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """codes (..., K) and scales (..., K / block) -> fp32 (..., K)."""
    return (q.float().reshape(*q.shape[:-1], -1, block) * d.unsqueeze(-1)).reshape(q.shape)
