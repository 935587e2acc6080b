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
#: are the same under every set of compiler flags and equal `quantize_blocks`'.  A block of 32 on an AVX2 CPU
#: takes the same steps eight lanes at a time (the maximum of |x| is exact in any order, the product x * (1 / d)
#: is one IEEE multiplication per lane, rounded half to even by vroundps as by nearbyint): the scalar loops cost
#: ~1 ns an element, serial before the operators' parallel loops (a SmolLM2 step at 8 rows: 1.07x with these).
Q8_BLOCK_SRC = r"""
#if defined(__AVX2__)
#include <immintrin.h>
#endif
inline float fb_q8_block(const float* v, int n, int8_t* q) {
#if defined(__AVX2__)
  if (n == 32) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 x[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_loadu_ps(v + 8 * i);
      m = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), m);  // a NaN lane keeps m, as std::max(amax, NaN)
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    volatile float c127 = 127.f;
    volatile float dv = _mm_cvtss_f32(h) / c127;
    const float d = dv;
    volatile float idv = d > 0.f ? 1.f / d : 0.f;
    const __m256 id = _mm256_set1_ps(idv);
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(x[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs work within 128-bit lanes: 4-code groups come out as 0 2 4 6 1 3 5 7
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return d;
  }
#endif
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
