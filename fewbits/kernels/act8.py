"""Activations rounded to integers per row and block of 32 columns: one specification each, two sides.

int8 (llama.cpp's Q8_0 rounding, the opt-in int8-activation mode): for each block, d = amax / 127 (fp32),
codes = round(x * (1 / d)) with ties to even (all zero where amax is 0), so x ~ d * codes.  The operators that
offer int8 activations (`fewbits.kernels.cpu_int4`'s `cpu_q4_a8`, `fewbits.kernels.rows`' ``int8_mm_a8``) include
`Q8_BLOCK_SRC`; `quantize_blocks` is the same arithmetic in torch, the reference their tests compare against bit
for bit.

int16 (the AVX2 one-row paths of ``q4_mm`` and ``int8_mm``, not an opt-in: finer than the bf16 activations they
hold): d = 2^(e - 14) for the block's largest |x| in [2^e, 2^(e+1)), codes = x / d rounded half to even (saturated
to int16).  A bf16 has 8 significant bits, so every bf16 element within 2^-7 of its block's largest is exact and
the rest round to a step of 2^-14 of it.  `X16_BLOCK_SRC` is the C++ both operators include, `int16_blocks` the
reference.

24-bit fixed point per row (``int8_mm``'s AMX path for 2-16 rows of a bf16 x, not an opt-in: every bf16 element
within 2^-15 of its row's largest taken exactly): `fixed24_rows` is the reference.
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


#: C++ (AVX2) of one block's int16 rounding: 32 floats in four vectors -> 32 int16 codes at q, their step d and
#: the sum of the codes; false where a value is Inf or NaN (nothing usable written: the caller takes its fp32
#: path, which carries them into the output as a plain product does).  |x| bits compare as unsigned integers in
#: the order of the magnitudes, so the largest exponent is one integer maximum; d and 1 / d are powers of two, so
#: x * (1 / d) is exact and vcvtps2dq rounds it half to even; vpackssdw saturates (an fp32 x just below 2^(e+1)
#: can round to 2^15).
X16_BLOCK_SRC = r"""
#if defined(__AVX2__)
#include <immintrin.h>
inline bool fb_x16_block(const __m256 f[4], int16_t* q, float* d_out, int32_t* sum_out) {
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i mx = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(f[i]), absmask));
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
  const uint32_t e = uint32_t(_mm_cvtsi128_si32(h)) >> 23;  // biased exponent of the largest |x|
  if (e == 255) return false;
  float d = 0.f, id = 0.f;
  if (e > 14) {  // else every |x| < 2^-112: the block reads as zero
    const uint32_t db = (e - 14) << 23, ib = (268 - e) << 23;  // 2^(e-127-14) and its inverse (e <= 254)
    std::memcpy(&d, &db, 4);
    std::memcpy(&id, &ib, 4);
  }
  const __m256 iv = _mm256_set1_ps(id);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], iv));
  // packs interleave 128-bit lanes: 64-bit quarters 0 2 1 3 back in column order
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), hi);
  const __m256i sv = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_set1_epi16(1)),
                                      _mm256_madd_epi16(hi, _mm256_set1_epi16(1)));  // of the saturated codes
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *d_out = d;
  *sum_out = _mm_cvtsi128_si32(s4);
  return true;
}
#endif
"""


def with_blocks(src: str) -> str:
    """C++ source with its ``@Q8_BLOCK@`` and ``@X16_BLOCK@`` lines replaced by the two blocks' code."""
    return src.replace("@Q8_BLOCK@", Q8_BLOCK_SRC).replace("@X16_BLOCK@", X16_BLOCK_SRC)


def int16_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) (K a multiple of 32) as the AVX2 one-row paths take it: (q int16 (M, K), d fp32 (M, K/32)) with
    x ~ q * d per block of 32 columns.  d = 2^(e - 14) where 2^e <= the block's largest |x| < 2^(e+1) (0 where that
    is below 2^-112), q = x / d rounded half to even and saturated to int16: every bf16 element within 2^-7 of the
    block's largest is exact (|q| <= 255 * 2^7)."""
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"last dimension {K} is not a multiple of the block of {BLOCK} columns")
    xf = x.float().reshape(M, K // BLOCK, BLOCK)
    amax = xf.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): 2^(e-1) <= amax
    d = torch.where(amax >= 2.0**-112, torch.ldexp(torch.ones_like(amax), e - 15), torch.zeros_like(amax))
    q = torch.where(d[..., None] > 0, torch.round(xf / torch.where(d > 0, d, 1.0)[..., None]), 0.0)
    return q.clamp(-32768, 32767).to(torch.int16).reshape(M, K), d


def fixed24_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), finite, as ``int8_mm``'s AMX path takes 2+ rows of a bf16 x: (v int32 (M, K), step fp64 (M,)) with
    x ~ v * step per row.  step = 2^(e - 22) where 2^e <= the row's largest |x| < 2^(e+1) (0 for a row of zeros),
    v = x / step rounded half to even (|v| < 2^23): every bf16 element within 2^-15 of its row's largest is exact,
    the rest round to a step of 2^-22 of it."""
    xd = x.double()
    amax = xd.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    step = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e - 23), torch.zeros_like(amax))
    v = torch.round(xd / torch.where(step > 0, step, 1.0)[:, None])
    return v.to(torch.int32), step


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
