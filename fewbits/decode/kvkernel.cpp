
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#define FEWBITS_KV_I16 1  // KIVI codes times 16-bit integers (256-bit vpmaddwd), on AVX-512 CPUs too
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FEWBITS_KV_AVX2 1  // attend_rows and attend_kv in 256-bit vectors
#define FEWBITS_KV_I16 1
#include <immintrin.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace {
constexpr int MAXD = 512, MAXR = 32;

// Denormals flushed to zero (inputs and results) in the calling thread while in scope, on x86 (elsewhere nothing).
// A softmax weight e^(s - max) under 2^-126 (s at least 87 below the row's largest score) is a denormal, and every
// product with it ran ~15x slower than with a normal number: one layer's attention at 2048 tokens (batch 8,
// SmolLM2's heads, keys spread so that most scores sit that far below the largest: a very peaked head) took 8.1 ms
// instead of 0.56.  Flushed, such a weight (or a product of one) is 0, which changes nothing a float sum of at least
// 1 (the largest score's own weight) can hold.  The attention operators only: append_kv rounds as IEEE does.
struct FlushDenormals {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ (bit 15) and DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// A row of codes in "plane" order: c[k * nb + j] = code k of byte j (bits 8: int8 codes, one plane), so
// 4- and 2-bit codes unpack with shifts and masks only; the query and the value accumulators use the
// same order (channel d = j * per + k sits at k * nb + j).
inline void unpack_planes(const uint8_t* row, int64_t nb, int64_t bits, float* c) {
  const int64_t per = 8 / bits;
#ifdef __AVX512F__
  if (nb % 16 == 0) {
    for (int64_t j = 0; j < nb; j += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j));
      if (bits == 8) { _mm512_storeu_ps(c + j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw))); continue; }
      const __m512i v = _mm512_cvtepu8_epi32(raw), mask = _mm512_set1_epi32((1 << bits) - 1);
      for (int64_t k = 0; k < per; ++k)
        _mm512_storeu_ps(c + k * nb + j, _mm512_cvtepi32_ps(
            _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(static_cast<int>(k * bits))), mask)));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < nb; ++j)
    for (int64_t k = 0; k < per; ++k)
      c[k * nb + j] = bits == 8 ? static_cast<float>(static_cast<int8_t>(row[j]))
                                : static_cast<float>((row[j] >> (k * bits)) & ((1 << bits) - 1));
}

// f(std::integral_constant<int, B>()) for B = bits (8, 4 or 2): the vector paths' templates, one per code width
template <typename F>
inline void by_bits(int64_t bits, F&& f) {
  if (bits == 8) f(std::integral_constant<int, 8>());
  else if (bits == 4) f(std::integral_constant<int, 4>());
  else f(std::integral_constant<int, 2>());
}

// f(r0, std::integral_constant<int, RR>()) for query heads r0 .. r0+RR-1 of R, in passes of at most RMAX (<= 4):
// each pass's loops unrolled for its exact count of heads
template <int RMAX = 4, typename F>
inline void head_passes(int64_t R, F&& f) {
  static_assert(RMAX >= 1 && RMAX <= 4);
  for (int64_t r0 = 0; r0 < R; r0 += RMAX) {
    const int64_t rr = std::min<int64_t>(RMAX, R - r0);
    if (rr == 1) f(r0, std::integral_constant<int, 1>());
    if constexpr (RMAX >= 2) if (rr == 2) f(r0, std::integral_constant<int, 2>());
    if constexpr (RMAX >= 3) if (rr == 3) f(r0, std::integral_constant<int, 3>());
    if constexpr (RMAX >= 4) if (rr == 4) f(r0, std::integral_constant<int, 4>());
  }
}

// (built without -ffast-math, so the quantiser below rounds as IEEE does: the sums vectorise by hand or through
// `omp simd`; a reduction under `omp simd` is vectorised but its lanes then added one by one, in order)
inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  int64_t d = 0;
  float s = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
    d = D;
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(FEWBITS_KV_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  s = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
#endif
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += w * x[d];
}

inline float h2f(const at::Half& x) { return static_cast<float>(x); }

// n fp16 values -> float (vector conversions: c10's scalar one costs more than the dot products here)
inline void halves(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#ifdef FEWBITS_KV_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// n bf16 values -> float (a 16-bit shift)
inline void bf16s(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#endif
#ifdef FEWBITS_KV_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// An fp8 cache's E4M3 codes (uint8 tensors) read as fp16 bits: the seven exponent and mantissa bits shifted 7 left
// sit in an fp16's with an exponent bias of 15 instead of 7, so the fp16 is the E4M3 value / 2^8 (subnormal codes
// become fp16 subnormals, exactly); the sign-extended byte's shift leaves a copy of the sign in bit 14, which the
// mask clears.  The per-token scales are multiplied by E4M3_UNIT instead (exact).  The quantiser saturates at +-448,
// so the NaN codes (0x7F, 0xFF) never occur.
struct e4m3_t { uint8_t bits; };
constexpr int16_t E4M3_MASK = static_cast<int16_t>(0xBF80);
constexpr float E4M3_UNIT = 256.f;
inline float e4m3_unit_value(uint8_t b) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>((int32_t(int8_t(b)) * 128) & 0xBF80),
                                      c10::Half::from_bits()));
}

// row i of a 16- or 32-bit float tensor's data, int8 codes, or E4M3 codes (uint8, / E4M3_UNIT) -> float
inline void row_f32(const void* base, at::ScalarType dt, int64_t i, int64_t D, float* dst) {
  if (dt == at::kBFloat16) bf16s(static_cast<const at::BFloat16*>(base) + i * D, dst, D);
  else if (dt == at::kHalf) halves(static_cast<const at::Half*>(base) + i * D, dst, D);
  else if (dt == at::kChar) for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<const int8_t*>(base)[i * D + d];
  else if (dt == at::kByte)
    for (int64_t d = 0; d < D; ++d) dst[d] = e4m3_unit_value(static_cast<const uint8_t*>(base)[i * D + d]);
  else for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<const float*>(base)[i * D + d];
}

// the largest of y[0 .. n-1] (NEG_INF for none)
inline float row_max(const float* y, int64_t n) {
  float mx = NEG_INF;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 v = _mm512_set1_ps(NEG_INF);
  for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(y + i));
  mx = _mm512_reduce_max_ps(v);
#endif
#ifdef FEWBITS_KV_AVX2
  if (n >= 8) {
    __m256 v = _mm256_set1_ps(NEG_INF);
    for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(y + i));
    alignas(32) float m8[8];
    _mm256_store_ps(m8, v);
    for (float x : m8) mx = std::max(mx, x);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, y[i]);
  return mx;
}

// y[i] = exp(y[i] - mx) for i < n, returning their sum.  Scalar expf was a fifth of the kernel's time;
// this is the usual range reduction exp(x) = 2^k exp(f), |f| <= ln2/2, with a degree-6 polynomial
// (relative error ~2e-7, like expf's rounding) and 2^k applied by scalef.
inline float exp_sub_sum(float* y, int64_t n, float mx) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vmx = _mm512_set1_ps(mx), log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2hi = _mm512_set1_ps(0.693359375f), ln2lo = _mm512_set1_ps(-2.12194440e-4f);
  __m512 vs = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(y + i), vmx), _mm512_set1_ps(-100.f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(k, ln2lo, _mm512_fnmadd_ps(k, ln2hi, x));
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
    __m512 e = _mm512_scalef_ps(p, k);
    _mm512_storeu_ps(y + i, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#endif
#ifdef FEWBITS_KV_AVX2
  {  // as above; 2^k built in the exponent bits (x clamped at -87, so k >= -126 stays a normal power of two)
    const __m256 vmx = _mm256_set1_ps(mx), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2hi = _mm256_set1_ps(0.693359375f), ln2lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(y + i), vmx), _mm256_set1_ps(-87.f));
      __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256 f = _mm256_fnmadd_ps(k, ln2lo, _mm256_fnmadd_ps(k, ln2hi, x));
      __m256 p = _mm256_set1_ps(1.3981999507e-3f);
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073e-3f));
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894e-2f));
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459e-1f));
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201e-1f));
      p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.f)));
      const __m256 two_k = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                                                   _mm256_set1_epi32(127)), 23));
      const __m256 e = _mm256_mul_ps(p, two_k);
      _mm256_storeu_ps(y + i, e);
      vs = _mm256_add_ps(vs, e);
    }
    alignas(32) float s8[8];
    _mm256_store_ps(s8, vs);
    for (float x : s8) sum += x;
  }
#endif
  for (; i < n; ++i) { y[i] = std::exp(y[i] - mx); sum += y[i]; }
  return sum;
}

// rows of keys / values ahead of the one read that the 16-bit loops prefetch (4 kB at 64 bf16 channels).  One layer
// of SmolLM2's bf16 cache at 2048 tokens, batch 8, called over 30 layers' caches in turn (360 MiB: from memory) read
// 10.7-11.3 GB/s without, 12.5-13.1 with (96 rows ahead: 11.8-12.3); the compiled int4-g64 step at that context
// 27.55-28.09 -> 25.54-26.37 ms (bench_compiled.py kv --weights int4-g64 --kv bf16 --batch 8, four processes).
// The AVX2 loops (scores_8, values_8) got the same prefetch later: the compiled int4-g64 step (SmolLM2, bf16 cache,
// batch 8) with the operators built without AVX-512, on an AVX-512 Xeon, alternating in one process: 2048 tokens
// 39.1 -> 31.7 ms, 128 tokens 7.86 -> 7.16.  Tried, not kept: the values' rows prefetched into L2 along the scores'
// pass (a whole chunk ahead): alone 1.13-1.37x faster at 128-2000 tokens, but the compiled step at 2048 tokens
// 21.8 -> 23.5 ms.
constexpr int64_t KV_PF_ROWS = 32;

// bytes of int8 rows ahead of the one read that the integer loops (kvkernel_vnni.inc, kvkernel_i16.inc) prefetch (as
// the 16-bit loops' 32 rows of 64 channels): one layer's compiled attention over SmolLM2's int8 cache at 2048
// tokens, batch 8, called over 30 layers' caches in turn (from memory) read 10.0 GB/s without, 10.8-11.0 with; over
// 6 layers' 15.6-16.5 without, 17.3-17.4 with.
constexpr int64_t KV_PF_BYTES = 4096;
// The KIVI loops (and kvkernel_i16.inc's, which the int8 cache takes without VNNI) prefetch the same way since: the
// compiled int4-g64 step (SmolLM2, batch 8, 2048 tokens), alternating in one process: a KIVI int4 cache 21.64 ->
// 20.02 ms; with the operators built without AVX-512 (the 256-bit integer loops) 28.76 -> 23.45, an int8 cache 28.26
// -> 20.40.

#include "kvkernel_avx512.inc"

#include "kvkernel_avx2.inc"

#include "kvkernel_i16.inc"

#include "kvkernel_vnni.inc"

#ifdef FEWBITS_KV_I16
// An int8 cache without a window in 16-bit integers: the query (per head) and the softmax weights times the value
// scales (per head and chunk) rounded to int16 against their largest magnitude as in KIVI's path (relative step
// 2^-15); a code times an int16 is exact and the sums are exact int32 while D and the tokens of a chunk are at most
// 2^31 / (128 * 32767) = 512.  VNNI where D is a multiple of 32, else vpmaddwd in 256-bit vectors (KIVI's loops on
// one plane of sign-extended codes: int_scores / int_values with BITS 8).
constexpr int64_t I8_LIM = 512;

// out[r * stride + i] = q_r . row_i (q: R x D int16 in plane order; int32 sums) for n rows of codes (all of them:
// the caller masks), KIVI's of BITS or int8 (BITS 8, sign-extended; nb = D), a pass of up to four query heads at a
// time: VNNI's 512-bit loops where a row fits them, else the 256-bit ones (nb a multiple of 16)
template <int BITS>
void int_scores(const uint8_t* rows, int64_t nb, int64_t n, const int16_t* q, int64_t R, int64_t D, int32_t* out,
                int64_t stride) {
  head_passes(R, [&](int64_t r0, auto RR) {
    const int16_t* qr = q + r0 * D;
    int32_t* o = out + r0 * stride;
#ifdef FEWBITS_KV_VNNI
    if constexpr (BITS == 8) {
      if (D % 32 == 0) return scores_i8_heads<RR.value>(reinterpret_cast<const int8_t*>(rows), D, n, qr, o, stride);
    } else if (nb % 32 == 0 || nb == 16) {
      return scores_codes_heads<BITS, RR.value>(rows, nb, n, qr, D, o, stride);
    }
#endif
    scores_i16_heads<BITS, RR.value>(rows, nb, n, qr, D, o, stride);
  });
}

// acc[r * D + plane-order index] = sum_i w_g[r][i] * codes_i (int32) over the n rows (as values_i16_heads: the
// weights int16 at w + g * gstride + r * stride, padded with a zero weight to an even count; int8: gv = D), four
// query heads a pass (int2: two, as many accumulators): VNNI's loops where a row is a multiple of 32 bytes
template <int BITS>
void int_values(const uint8_t* rows, int64_t nb, int64_t gv, int64_t n, const int16_t* w, int64_t stride,
                int64_t gstride, int64_t R, int64_t D, int32_t* acc) {
  constexpr int RMAX = 8 / BITS >= 4 ? 2 : 4;
  head_passes<RMAX>(R, [&](int64_t r0, auto RR) {
    const int16_t* wr = w + r0 * stride;
    int32_t* a = acc + r0 * D;
#ifdef FEWBITS_KV_VNNI
    if constexpr (BITS == 8) {
      if (D % 32 == 0) return values_i8_heads<RR.value>(reinterpret_cast<const int8_t*>(rows), D, n, wr, stride, a);
    } else if (nb % 32 == 0) {
      if (gv % (16 * (8 / BITS)) == 0)
        return values_codes_heads<BITS, RR.value, true>(rows, nb, gv, n, wr, stride, gstride, D, a);
      return values_codes_heads<BITS, RR.value>(rows, nb, gv, n, wr, stride, gstride, D, a);
    }
#endif
    values_i16_heads<BITS, RR.value>(rows, nb, gv, n, wr, stride, gstride, D, a);
  });
}

// y[i] = ok[i] ? x[i] * a * b[i] : fill for i < n (x int32 sums or floats), 8 at a time (written as a select, the
// loop compiles to a branch and a scalar store)
template <typename X>
inline void scaled_where(const X* x, float a, const float* b, const bool* ok, int64_t n, float fill, float* y) {
  const __m256 va = _mm256_set1_ps(a), vf = _mm256_set1_ps(fill);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i okv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ok + i)));
    __m256 v;
    if constexpr (std::is_same_v<X, int32_t>)
      v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    else
      v = _mm256_loadu_ps(x + i);
    v = _mm256_mul_ps(_mm256_mul_ps(v, va), _mm256_loadu_ps(b + i));
    _mm256_storeu_ps(y + i, _mm256_blendv_ps(vf, v, _mm256_castsi256_ps(
                                                   _mm256_cmpgt_epi32(okv, _mm256_setzero_si256()))));
  }
  for (; i < n; ++i) y[i] = ok[i] ? static_cast<float>(x[i]) * a * b[i] : fill;
}
#endif



// f(rows) with rows: base + off as a pointer to dt's elements (bf16, fp16, int8, E4M3 codes as uint8, or fp32)
template <typename F>
inline void by_dtype(const void* base, at::ScalarType dt, int64_t off, F&& f) {
  if (dt == at::kBFloat16) f(static_cast<const at::BFloat16*>(base) + off);
  else if (dt == at::kHalf) f(static_cast<const at::Half*>(base) + off);
  else if (dt == at::kChar) f(static_cast<const int8_t*>(base) + off);
  else if (dt == at::kByte) f(static_cast<const e4m3_t*>(base) + off);
  else f(static_cast<const float*>(base) + off);
}

// s[r * n + i] = q_r . row_i over rows row0 .. row0+n-1 of a (., D) tensor of dt (NEG_INF where !ok[i]) by the
// vector path; false where none fits D (the caller runs the plain loop)
inline bool scores_rows(const void* base, at::ScalarType dt, int64_t row0, int64_t D, const bool* ok, int64_t n,
                        const float* q, int64_t R, float* s) {
#ifdef FEWBITS_KV_AVX512
  if (D % 16 == 0) {
    by_dtype(base, dt, row0 * D, [&](auto rows) { scores_16(rows, D, ok, n, q, R, s); });
    return true;
  }
#elif defined(FEWBITS_KV_AVX2)
  if (D % 8 == 0) {
    by_dtype(base, dt, row0 * D, [&](auto rows) { scores_8(rows, D, ok, n, q, R, s); });
    return true;
  }
#endif
  return false;
}

// acc[r * D + d] = sum_i w[r * n + i] * row_i[d] over the same rows with ok[i] by the vector path; false where
// none fits D
inline bool values_rows(const void* base, at::ScalarType dt, int64_t row0, int64_t D, const bool* ok, int64_t n,
                        const float* w, int64_t R, float* acc) {
#ifdef FEWBITS_KV_AVX512
  if (D % 16 == 0) {
    by_dtype(base, dt, row0 * D, [&](auto rows) { values_16(rows, D, ok, n, w, R, acc); });
    return true;
  }
#elif defined(FEWBITS_KV_AVX2)
  if (D % 8 == 0) {
    by_dtype(base, dt, row0 * D, [&](auto rows) { values_8(rows, D, ok, n, w, R, acc); });
    return true;
  }
#endif
  return false;
}

// The query's slot read from its memory, and the mask (B, ..., T') as B rows used in place where it is
// contiguous: Tensor::item and reshape each cost a dispatch (~1.3 us of the ~8 us attend_rows takes at one token).
int64_t slot_of(const at::Tensor& slot_t, const char* op) {
  TORCH_CHECK(slot_t.numel() == 1 && slot_t.scalar_type() == at::kLong && slot_t.device().is_cpu(), op,
              ": slot must be one int64 on the CPU");
  return *slot_t.data_ptr<int64_t>();
}

struct MaskRows {
  at::Tensor t;
  const bool* p;
  int64_t stride;  // elements a row
};

MaskRows mask_rows(const at::Tensor& allowed, int64_t B) {
  at::Tensor t = allowed.is_contiguous() ? allowed : allowed.contiguous();
  return {t, t.data_ptr<bool>(), B ? t.numel() / B : 0};
}

// out's elements x0 .. x0 + n - 1 (contiguous, fp32 / bf16 / fp16) = value(i) for i in 0 .. n - 1, rounded to nearest
// even in out's dtype
template <typename F>
inline void store_row(at::Tensor& out, int64_t x0, int64_t n, F value) {
  if (out.scalar_type() == at::kFloat) {
    float* p = out.data_ptr<float>() + x0;
    for (int64_t i = 0; i < n; ++i) p[i] = value(i);
  } else if (out.scalar_type() == at::kBFloat16) {
    at::BFloat16* p = out.data_ptr<at::BFloat16>() + x0;
    for (int64_t i = 0; i < n; ++i) p[i] = at::BFloat16(value(i));
  } else {
    at::Half* p = out.data_ptr<at::Half>() + x0;
    for (int64_t i = 0; i < n; ++i) p[i] = at::Half(value(i));
  }
}

// The per-unit softmaxes (maximum pm, sum pl, weighted values pacc: unit k of (b, h) at bh * nunits + k, each
// with R query heads) merged into one attention per query head -> (B, H, R, D) in q's dtype (rounded once)
at::Tensor merge_units(const at::Tensor& q_in, int64_t BH, int64_t R, int64_t D, int64_t nunits,
                       const std::vector<float>& pm, const std::vector<float>& pl, const std::vector<float>& pacc) {
  std::vector<float> o32(BH * R * D);
  float* O = o32.data();
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t r = 0; r < R; ++r) {
      float M = NEG_INF, L = 0.f;
      for (int64_t k = 0; k < nunits; ++k) M = std::max(M, pm[(bh * nunits + k) * R + r]);
      float* o = O + (bh * R + r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      if (M == NEG_INF) continue;  // nothing attended to
      for (int64_t k = 0; k < nunits; ++k) {
        const float mk = pm[(bh * nunits + k) * R + r];
        if (mk == NEG_INF) continue;
        const float e = std::exp(mk - M);
        L += e * pl[(bh * nunits + k) * R + r];
        axpy(e, pacc.data() + ((bh * nunits + k) * R + r) * D, o, D);
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= L;
    }
  auto out = at::empty(q_in.sizes(), q_in.options());
  store_row(out, 0, BH * R * D, [&](int64_t x) { return O[x]; });
  return out;
}
}  // namespace

// q (B, H, r, D): the r query heads that share KV head h, any float dtype; scale: the softmax scale.
// bits 8: int8 per token (kc/vc int8 (B,H,T,D), ks/vs (B,H,T,1) f16); bits 4/2: KIVI (kc/vc uint8
// (B,H,T,D*bits/8), ks/km (B,H,T/G,D) f16, vs/vm (B,H,T,D/gv) f16).  allowed (B, T) bool: the slots the
// query may see; slot (1,) long: the query's own slot.  rk/rv (B, H, W, D) bf16/f16/f32: the 16-bit window
// of the `residual` most recent tokens (W = 0: none), slot j holding the latest token congruent to j mod W,
// and the quantised slots are the first (slot + 1 - residual) // G * G.  -> (B, H, r, D) in q's dtype
at::Tensor attend_kv(const at::Tensor& q_in, double scale, int64_t bits, int64_t G, int64_t gv,
                     const at::Tensor& kc, const at::Tensor& ks, const at::Tensor& km, const at::Tensor& vc,
                     const at::Tensor& vs, const at::Tensor& vm, const at::Tensor& allowed, const at::Tensor& slot_t,
                     int64_t residual, const at::Tensor& rk, const at::Tensor& rv, int64_t chunk) {
  const FlushDenormals flush;  // (the merge of the units, on this thread)
  const int64_t B = q_in.size(0), H = q_in.size(1), R = q_in.size(2), D = q_in.size(3), T = kc.size(2);
  TORCH_CHECK(q_in.dim() == 4 && (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16 ||
              q_in.scalar_type() == at::kHalf), "attend_kv: q must be a (B, H, r, D) float tensor");
  const at::Tensor q_c = q_in.contiguous();
  std::vector<float> q(B * H * R * D);  // the query in fp32, times the softmax scale
  for (int64_t x = 0; x < B * H * R; ++x) row_f32(q_c.data_ptr(), q_c.scalar_type(), x, D, q.data() + x * D);
  for (auto& x : q) x *= static_cast<float>(scale);
  const int64_t W = rk.numel() ? rk.size(2) : 0;
  TORCH_CHECK(D <= MAXD && R <= MAXR, "attend_kv: head dim or query heads per KV head too large");
  TORCH_CHECK(allowed.size(-1) >= T, "attend_kv: the mask is shorter than the cache");
  const bool kivi = bits != 8;
  const int64_t per = 8 / bits, nb = D / per, ng = kivi ? D / gv : 1;
  TORCH_CHECK(!kivi || gv % per == 0, "attend_kv: value group not a multiple of the codes per byte");
  const int64_t slot = slot_of(slot_t, "attend_kv"), grp = kivi ? G : 1;
  const int64_t n_quant = W ? std::max<int64_t>(0, slot + 1 - residual) / grp * grp : T;
  const MaskRows mask = mask_rows(allowed, B);
  const bool* AL = mask.p;
  const int64_t AT = mask.stride;
  // which slots the query sees: quantised ones below n_quant (no window: up to its own), window slots holding tokens
  // from n_quant on.  Only those are cut into units, not the whole preallocated cache, whose units past them would be
  // empty and, split statically over the threads, leave one idle
  const int64_t live = W ? n_quant : std::min(T, slot + 1);
  std::vector<uint8_t> okq(B * T), okr(B * std::max<int64_t>(W, 1));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < live; ++t) okq[b * T + t] = AL[b * AT + t];
    for (int64_t j = 0; j < W; ++j) {
      const int64_t tok = slot - (((slot - j) % W) + W) % W;
      okr[b * W + j] = tok >= n_quant && tok >= 0 && AL[b * AT + tok];
    }
  }
  chunk = kivi ? std::max<int64_t>(G, chunk / G * G) : chunk;
  const int64_t nchunk = (live + chunk - 1) / chunk, nunits = std::max<int64_t>(1, nchunk + (W ? 1 : 0));
  auto kc_ = kc.contiguous(), vc_ = vc.contiguous(), ks_ = ks.contiguous(), vs_ = vs.contiguous();
  auto km_ = km.contiguous(), vm_ = vm.contiguous(), rk_ = rk.contiguous(), rv_ = rv.contiguous();
  // per (b, h, unit) and query head: the chunk's softmax maximum and sum, and its weighted values
  std::vector<float> pm(B * H * nunits * R), pl(B * H * nunits * R), pacc(B * H * nunits * R * D);
  const float* Q = q.data();
  // the vector path: whole 16-byte blocks of codes, at most 16 value groups per token
#ifdef FEWBITS_KV_AVX512
  const bool fast = D % 16 == 0 && nb % 16 == 0 && (!kivi || ng <= 16);
  constexpr int64_t VBLOCK = 16;  // bytes of codes per vector block
#elif defined(FEWBITS_KV_AVX2)  // (blocks of 8 bytes; only blocks within one value group: fold always)
  const bool fast = D % 8 == 0 && nb % 8 == 0 && (!kivi || gv % (8 * per) == 0);
  constexpr int64_t VBLOCK = 8;
#else
  const bool fast = false;
  constexpr int64_t VBLOCK = 1;
#endif
  const int64_t Rpad = (R + 3) / 4 * 4;  // the vector path runs query heads four at a time
#ifdef FEWBITS_KV_I16
  // KIVI in 16-bit integers (int_scores, int_values): whole 16-byte blocks of codes, 8-byte blocks within one value
  // group, int32 sums that cannot overflow.  On an AVX-512 CPU too: one layer at 2048 tokens (SmolLM2's heads, 2
  // threads) took 61 us where the 512-bit fp32 path below took 92 (int2: 64 / 97)
  const int64_t qmax = (1 << bits) - 1, lim = (int64_t{1} << 31) / (qmax * 32767);
  const bool i16 = kivi && D % 8 == 0 && nb % 16 == 0 && gv % (8 * per) == 0 && D <= lim && chunk <= lim;
#else
  constexpr bool i16 = false;
#endif
  const uint8_t* KC = static_cast<const uint8_t*>(kc_.data_ptr());
  const uint8_t* VC = static_cast<const uint8_t*>(vc_.data_ptr());
  const at::Half *KS = ks_.data_ptr<at::Half>(), *VS = vs_.data_ptr<at::Half>();
  const at::Half *KM = km_.data_ptr<at::Half>(), *VM = vm_.data_ptr<at::Half>();
  const uint8_t *OK = okq.data(), *OKR = okr.data();
  const void *RK = W ? rk_.data_ptr() : nullptr, *RV = W ? rv_.data_ptr() : nullptr;
  const at::ScalarType rdt = rk.scalar_type();

  at::parallel_for(0, B * H * nunits, 1, [&](int64_t lo, int64_t hi) {
    const FlushDenormals flush;
    std::vector<float> s(Rpad * std::max(chunk, W));
    // the vector path's per-token value scales and minima in fp32, and the weights times each group's scale
    std::vector<float> vsf, vmf, wg, tmp, tmp2, ksc;
    if (fast || i16) {
      ksc.resize(std::max(chunk, W));
      vsf.resize(std::max(chunk, W) * ng);
      vmf.resize(std::max(chunk, W) * ng);
      tmp.resize(std::max(chunk, W) * ng);
      tmp2.resize(std::max(chunk, W) * ng);
      wg.resize(ng * Rpad * std::max(chunk, W));
    }
    alignas(64) float c[MAXD], qp[MAXR * MAXD], bias[MAXR], acc[MAXR * MAXD], vb[MAXR * MAXD], sgf[MAXD], mgf[MAXD];
    alignas(64) float qpl[MAXR * MAXD], sgp[MAXD];  // the query and a group's key scales in plane order
    [[maybe_unused]] alignas(64) float scratch[MAXD];
#ifdef FEWBITS_KV_I16
    // the integer path's query, scores, weights (pairs of tokens: npad a row) and weighted codes
    alignas(64) int16_t q16[MAXR * MAXD];
    alignas(64) int32_t acc32[MAXR * MAXD];
    std::vector<int32_t> s32(i16 ? Rpad * chunk : 0);
    std::vector<int16_t> w16(i16 ? ng * Rpad * (chunk + 1) : 0);
    std::vector<float> wsc(i16 ? ng * Rpad : 0);
#endif
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t bh = u / nunits, unit = u % nunits, b = bh / H;
      const float* qh = Q + bh * R * D;
      const bool ring = unit == nchunk;
      const int64_t t0 = ring ? 0 : unit * chunk, n = ring ? W : std::min(chunk, live - t0);
      const uint8_t* okp = ring ? OKR + b * W : OK + b * T + t0;
      if (std::find(okp, okp + n, uint8_t{1}) == okp + n) {  // no slot to attend to: the merge skips the unit
        for (int64_t r = 0; r < R; ++r) pm[(bh * nunits + unit) * R + r] = NEG_INF;
        continue;
      }
      if (!kivi)  // the query in plane order (one plane: itself)
        for (int64_t x = 0; x < R * D; ++x) qp[x] = qh[x];
      int64_t cur_g = -1;
      bool in_planes = false;  // qpl holds this unit's query in plane order
      // KIVI: qp = the query times group g's per-channel key scales, in plane order; bias = the query . minima;
      // with qs (the integer path), qp rounded to int16 in q16 too, its steps in qs
      const auto group_query = [&](int64_t g, [[maybe_unused]] float* qs = nullptr) {
        halves(KS + (bh * (T / G) + g) * D, sgf, D);
        halves(KM + (bh * (T / G) + g) * D, mgf, D);
        const auto to_planes = [&](const float* x, float* y) {  // channel j * per + k -> k * nb + j
#ifdef FEWBITS_KV_I16
          if (fast || i16) {  // (per a power of 2)
            unweave(x, y, D, per, scratch);
            return;
          }
#endif
          for (int64_t j = 0; j < nb; ++j)
            for (int64_t k = 0; k < per; ++k) y[k * nb + j] = x[j * per + k];
        };
        if (!in_planes)
          for (int64_t r = 0; r < R; ++r) to_planes(qh + r * D, qpl + r * D);
        in_planes = true;
        to_planes(sgf, sgp);
#if defined(FEWBITS_KV_I16) && defined(FEWBITS_KV_AVX512)
        if (qs && D % 16 == 0) {  // all the heads' scaled queries in one pass of 512-bit vectors
          for (int64_t r = 0; r < R; ++r) bias[r] = dot(qh + r * D, mgf, D);
          head_passes(R, [&](int64_t r0, auto RR) {
            scaled_query_i16<RR.value>(qpl + r0 * D, sgp, D, qp + r0 * D, q16 + r0 * D, qs + r0);
          });
          return;
        }
#endif
        for (int64_t r = 0; r < R; ++r) {
          bias[r] = dot(qh + r * D, mgf, D);
          const float* ql = qpl + r * D;
          float* qo = qp + r * D;
#ifdef FEWBITS_KV_I16
          if (qs) {  // (D a multiple of 8) the product's maximum found as it is written
            qs[r] = round_i16(qo, D, D, mul_max(ql, sgp, D, qo), q16 + r * D);
            continue;
          }
#endif
#pragma omp simd
          for (int64_t x = 0; x < D; ++x) qo[x] = ql[x] * sgp[x];
        }
      };
      // the vector paths' raw scores of tokens i0 .. i0+m-1 -> int8: times the key scale, KIVI: plus the bias;
      // masked: -inf
      [[maybe_unused]] const auto finish_scores = [&](float* so, int64_t i0, int64_t m, int64_t t) {
        const uint8_t* ok = okp + i0;
        if (!kivi) halves(KS + bh * T + t, ksc.data(), m);  // the keys' per-token scales
        for (int64_t r = 0; r < R; ++r) {
          float* x = so + r * n;
          const float br = bias[r];
          if (kivi)
#pragma omp simd
            for (int64_t i = 0; i < m; ++i) x[i] = ok[i] ? x[i] + br : NEG_INF;
          else
#pragma omp simd
            for (int64_t i = 0; i < m; ++i) x[i] = ok[i] ? x[i] * ksc[i] : NEG_INF;
        }
      };
#ifdef FEWBITS_KV_I16
      if (i16 && !ring) {  // KIVI group by group: the scaled query in int16, the sums in int32, then times the
                           // query's step, plus the bias
        for (int64_t i0 = 0; i0 < n; i0 += G) {
          const int64_t m_ = std::min(G, n - i0), t = t0 + i0;
          float qs[MAXR];
          group_query(t / G, qs);
          const uint8_t* rows = KC + (bh * T + t) * nb;
          float* so = s.data() + i0;
          by_bits(bits, [&](auto B) { int_scores<B.value>(rows, nb, m_, q16, R, D, s32.data(), m_); });
          const uint8_t* ok = okp + i0;
          const int64_t m8 = m_ / 8 * 8;
          for (int64_t r = 0; r < R; ++r) {  // masked: -inf
            const __m256 step = _mm256_set1_ps(qs[r]), br = _mm256_set1_ps(bias[r]), ninf = _mm256_set1_ps(NEG_INF);
            const int32_t* sr = s32.data() + r * m_;
            float* x = so + r * n;
            for (int64_t i = 0; i < m8; i += 8) {
              const __m256i okv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ok + i)));
              const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(
                                                   reinterpret_cast<const __m256i*>(sr + i))), step, br);
              _mm256_storeu_ps(x + i, _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(
                                                             _mm256_cmpgt_epi32(okv, _mm256_setzero_si256()))));
            }
            for (int64_t i = m8; i < m_; ++i)
              x[i] = ok[i] ? std::fma(static_cast<float>(sr[i]), qs[r], bias[r]) : NEG_INF;
          }
        }
      } else
#endif
#ifdef FEWBITS_KV_AVX512
      if (fast && !ring) {  // scores: group by group (KIVI: the query scaled per group), then scale or bias
        const int64_t span = kivi ? G : n;
        // plane_idx[b]: the channels of block b of the plane order, (jb * 16 + lane) * per + k; qpl: the query
        // in plane order
        __m512i plane_idx[MAXD / 16];
        for (int64_t k = 0, b = 0; k < per; ++k)
          for (int64_t jb = 0; jb < nb / 16; ++jb, ++b)
            plane_idx[b] = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(int(jb * 16)), LANES),
                                                               _mm512_set1_epi32(int(per))), _mm512_set1_epi32(int(k)));
        if (kivi)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t b = 0; b < D / 16; ++b)
              _mm512_storeu_ps(qpl + r * D + b * 16, _mm512_i32gather_ps(plane_idx[b], qh + r * D, 4));
        for (int64_t i0 = 0; i0 < n; i0 += span) {
          const int64_t m_ = std::min(span, n - i0), t = t0 + i0;
          if (kivi) {  // qp = the query times the group's scales, in plane order; bias = the query . minima
            const int64_t g = t / G;
            halves(KS + (bh * (T / G) + g) * D, sgf, D);
            halves(KM + (bh * (T / G) + g) * D, mgf, D);
            for (int64_t r = 0; r < R; ++r) bias[r] = dot(qh + r * D, mgf, D);
            for (int64_t k = 0, b = 0; k < per; ++k)
              for (int64_t jb = 0; jb < nb / 16; ++jb, ++b) {
                const __m512 sg = _mm512_i32gather_ps(plane_idx[b], sgf, 4);
                for (int64_t r = 0; r < R; ++r)
                  _mm512_storeu_ps(qp + r * D + b * 16, _mm512_mul_ps(_mm512_loadu_ps(qpl + r * D + b * 16), sg));
              }
          }
          const uint8_t* rows = KC + (bh * T + t) * nb;
          float* so = s.data() + i0;
          by_bits(bits, [&](auto B) { scores_fast<B.value>(rows, nb, okp + i0, m_, qp, R, D, so, n); });
          finish_scores(so, i0, m_, t);
        }
      } else
#elif defined(FEWBITS_KV_AVX2)
      if (fast && !ring) {  // scores group by group (KIVI: the query scaled per group), then scale or bias
        const int64_t span = kivi ? G : n;
        for (int64_t i0 = 0; i0 < n; i0 += span) {
          const int64_t m_ = std::min(span, n - i0), t = t0 + i0;
          if (kivi) group_query(t / G);
          const uint8_t* rows = KC + (bh * T + t) * nb;
          float* so = s.data() + i0;
          by_bits(bits, [&](auto B) { scores_fast8<B.value>(rows, nb, okp + i0, m_, qp, R, D, so, n); });
          finish_scores(so, i0, m_, t);
        }
      } else
#endif
      // scores (the 16-bit window: attend_rows' vector path where it fits)
      if (!ring || !scores_rows(RK, rdt, bh * W, D, reinterpret_cast<const bool*>(okp), n, qh, R, s.data()))
      for (int64_t i = 0; i < n; ++i) {
        float* si = s.data() + i;
        if (!okp[i]) { for (int64_t r = 0; r < R; ++r) si[r * n] = NEG_INF; continue; }
        const int64_t t = t0 + i;
        if (ring) {
          row_f32(RK, rdt, bh * W + i, D, c);
          for (int64_t r = 0; r < R; ++r) si[r * n] = dot(qh + r * D, c, D);
          continue;
        }
        unpack_planes(KC + (bh * T + t) * nb, nb, bits, c);
        if (!kivi) {
          const float sc = h2f(KS[bh * T + t]);
          for (int64_t r = 0; r < R; ++r) si[r * n] = dot(qp + r * D, c, D) * sc;
          continue;
        }
        const int64_t g = t / G;
        if (g != cur_g) group_query(cur_g = g);
        for (int64_t r = 0; r < R; ++r) si[r * n] = dot(qp + r * D, c, D) + bias[r];
      }
      // softmax weights within the chunk
      float m[MAXR], l[MAXR];
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s.data() + r * n;
        const float mx = row_max(sr, n);
        m[r] = mx;
        l[r] = mx == NEG_INF ? 0.f : exp_sub_sum(sr, n, mx);
        for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.f;
        for (int64_t x = 0; x < ng; ++x) vb[r * ng + x] = 0.f;
      }
#ifdef FEWBITS_KV_I16
      // the value scales and minima group by group: vsf[g * n + i] (converted by vectors, then regrouped)
      const auto group_scales = [&](int64_t bh_t) {
        const auto regroup = [&](const at::Half* src, float* dst) {
          halves(src + bh_t * ng, ng == 1 ? dst : tmp.data(), n * ng);
          if (ng == 1) return;
          if ((ng & (ng - 1)) == 0) {  // a power of 2: even/odd splits
            unweave(tmp.data(), dst, n * ng, ng, tmp2.data());
            return;
          }
          for (int64_t i = 0; i < n; ++i)  // (another count of groups: the plain loop)
            for (int64_t g = 0; g < ng; ++g) dst[g * n + i] = tmp[i * ng + g];
        };
        regroup(VS, vsf.data());
        if (kivi) regroup(VM, vmf.data());
        else std::fill(vmf.begin(), vmf.begin() + n * ng, 0.f);
      };
      // the AVX2 build's fp32 values path: wg[g * Rpad * n + r * n + i] = the softmax weight times token i's scale of
      // value group g (masked tokens: 0), vb[r * ng + g] = the weights times the group's minima (KIVI); the integer
      // path does this per value group and pass of heads in value_weights_i16
      [[maybe_unused]] const auto group_weights = [&](int64_t bh_t, int64_t gs) {
        group_scales(bh_t);
        for (int64_t r = 0; r < R; ++r) {
          const float* sr = s.data() + r * n;
          for (int64_t g = 0; g < ng; ++g) {  // weights times the group's scales; KIVI: sum_i p_i m_i per group
            float* wr = wg.data() + g * gs + r * n;
            const float *sg = vsf.data() + g * n, *mg = vmf.data() + g * n;
            __m256 bacc = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 8 <= n; i += 8) {  // masked tokens weigh exactly 0
              const __m256i okv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(okp + i)));
              const __m256 p = _mm256_and_ps(_mm256_loadu_ps(sr + i), _mm256_castsi256_ps(
                                                 _mm256_cmpgt_epi32(okv, _mm256_setzero_si256())));
              _mm256_storeu_ps(wr + i, _mm256_mul_ps(p, _mm256_loadu_ps(sg + i)));
              bacc = _mm256_fmadd_ps(p, _mm256_loadu_ps(mg + i), bacc);
            }
            alignas(32) float b8[8];
            _mm256_store_ps(b8, bacc);
            float b = 0.f;
            for (float x : b8) b += x;
            for (; i < n; ++i) {
              const float p = okp[i] ? sr[i] : 0.f;
              wr[i] = p * sg[i];
              b += p * mg[i];
            }
            vb[r * ng + g] = b;
          }
        }
      };
      if (i16 && !ring) {  // the weights in int16 per query head and value group, the sums in int32, times the steps
        const int64_t bh_t = bh * T + t0, gs = Rpad * n, gvv = gv;
        group_scales(bh_t);
        const uint8_t* rows = VC + bh_t * nb;
        const int64_t npad = (n + 1) / 2 * 2;
        for (int64_t g = 0; g < ng; ++g)
          head_passes(R, [&](int64_t r0, auto RR) {
            float b[RR.value];
            value_weights_i16<RR.value>(s.data() + r0 * n, okp, vsf.data() + g * n, vmf.data() + g * n, n, npad,
                                        wg.data() + g * gs + r0 * n, w16.data() + (g * Rpad + r0) * npad,
                                        wsc.data() + g * Rpad + r0, b);
            for (int64_t j = 0; j < RR.value; ++j) vb[(r0 + j) * ng + g] = b[j];
          });
        by_bits(bits, [&](auto B) {
          int_values<B.value>(rows, nb, gvv, n, w16.data(), npad, Rpad * npad, R, D, acc32);
        });
        const int64_t seg = gvv / per;  // bytes of one value group: j in g * seg .. g * seg + seg - 1
        for (int64_t r = 0; r < R; ++r)
          for (int64_t k = 0; k < per; ++k)
            for (int64_t g = 0; g < ng; ++g) {
              const float st = wsc[g * Rpad + r];
              const int32_t* a = acc32 + r * D + k * nb + g * seg;
              float* o = acc + r * D + k * nb + g * seg;
#pragma omp simd
              for (int64_t j = 0; j < seg; ++j) o[j] = static_cast<float>(a[j]) * st;
            }
      } else
#endif
#ifdef FEWBITS_KV_AVX512
      if (fast && !ring) {  // the weighted sum of values (plane order), int8's scales folded into the weights
        const int64_t bh_t = bh * T + t0;
        const uint8_t* rows = VC + bh_t * nb;
        const at::Half *sv = VS + bh_t * ng, *mv = VM + bh_t * ng;
        halves(sv, vsf.data(), n * ng);
        const bool fold = !kivi || gv % (16 * per) == 0;  // every block of 16 codes in one value group
        const float* w = s.data();
        if (fold) {  // weights times the value scales, per group; KIVI's minima: sum_i p_i m_i per group
          const int64_t gs = Rpad * n, n16 = n / 16 * 16;
          if (kivi) halves(mv, vmf.data(), n * ng);
          for (int64_t r = 0; r < R; ++r)  // masked tokens weigh exactly 0 (exp_sub_sum left exp(-100))
            for (int64_t i = 0; i < n; ++i) s[r * n + i] = okp[i] ? s[r * n + i] : 0.f;
          for (int64_t g = 0; g < ng; ++g) {
            const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(LANES, _mm512_set1_epi32(int(ng))),
                                                 _mm512_set1_epi32(int(g)));
            for (int64_t r = 0; r < R; ++r) {
              const float* sr = s.data() + r * n;
              float* wr = wg.data() + g * gs + r * n;
              __m512 vbacc = _mm512_setzero_ps();
              for (int64_t i = 0; i < n16; i += 16) {
                const __m512 p = _mm512_loadu_ps(sr + i);
                _mm512_storeu_ps(wr + i, _mm512_mul_ps(p, _mm512_i32gather_ps(idx, vsf.data() + i * ng, 4)));
                if (kivi) vbacc = _mm512_fmadd_ps(p, _mm512_i32gather_ps(idx, vmf.data() + i * ng, 4), vbacc);
              }
              float b = kivi ? _mm512_reduce_add_ps(vbacc) : 0.f;
              for (int64_t i = n16; i < n; ++i) {
                wr[i] = sr[i] * vsf[i * ng + g];
                if (kivi) b += sr[i] * vmf[i * ng + g];
              }
              vb[r * ng + g] = b;
            }
          }
          w = wg.data();
        }
        const int64_t gs = Rpad * n, gvv = kivi ? gv : D;
        by_bits(bits, [&](auto B) {
          values_fast<B.value>(rows, nb, fold, sv, mv, ng, gvv, okp, n, w, n, gs, R, D, acc);
        });
      } else
#elif defined(FEWBITS_KV_AVX2)
      if (fast && !ring) {  // the weighted sum of values (plane order), the value scales folded into the weights
        const int64_t bh_t = bh * T + t0, gs = Rpad * n;
        group_weights(bh_t, gs);
        const int64_t gvv = kivi ? gv : D;
        const uint8_t* rows = VC + bh_t * nb;
        by_bits(bits, [&](auto B) { values_fast8<B.value>(rows, nb, gvv, okp, n, wg.data(), n, gs, R, D, acc); });
      } else
#endif
      // the weighted sum of values (plane order for codes; the window as the scores)
      if (!ring || !values_rows(RV, rdt, bh * W, D, reinterpret_cast<const bool*>(okp), n, s.data(), R, acc))
      for (int64_t i = 0; i < n; ++i) {
        if (!okp[i]) continue;
        const int64_t t = t0 + i;
        if (ring) {
          row_f32(RV, rdt, bh * W + i, D, c);
          for (int64_t r = 0; r < R; ++r) axpy(s[r * n + i], c, acc + r * D, D);
          continue;
        }
        unpack_planes(VC + (bh * T + t) * nb, nb, bits, c);
        if (!kivi) {
          const float sc = h2f(VS[bh * T + t]);
          for (int64_t r = 0; r < R; ++r) axpy(s[r * n + i] * sc, c, acc + r * D, D);
          continue;
        }
        const at::Half *sv = VS + (bh * T + t) * ng, *mv = VM + (bh * T + t) * ng;
        const int64_t seg = gv / per;  // channels of one value group within one plane
        for (int64_t g = 0; g < ng; ++g) {
          const float sg = h2f(sv[g]), mg = h2f(mv[g]);
          for (int64_t k = 0; k < per; ++k)
            for (int64_t x = 0; x < seg; ++x) c[k * nb + g * seg + x] *= sg;
          for (int64_t r = 0; r < R; ++r) vb[r * ng + g] += s[r * n + i] * mg;
        }
        for (int64_t r = 0; r < R; ++r) axpy(s[r * n + i], c, acc + r * D, D);
      }
      const int64_t base = bh * nunits + unit;
      for (int64_t r = 0; r < R; ++r) {
        pm[base * R + r] = m[r];
        pl[base * R + r] = l[r];
        float* dst = pacc.data() + (base * R + r) * D;
        if (ring || !kivi)
          for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d];
        else if (fast && !i16 && gv % (VBLOCK * per) != 0)  // minima included (AVX-512 blocks across value groups)
          for (int64_t j = 0; j < nb; ++j)
            for (int64_t k = 0; k < per; ++k) dst[j * per + k] = acc[r * D + k * nb + j];
#ifdef FEWBITS_KV_I16
        else if (fast || i16) {  // the minima's sums added per value group in plane order, then the planes woven
          float* a = acc + r * D;
          const int64_t seg = gv / per;  // bytes of one value group
          for (int64_t k = 0; k < per; ++k)
            for (int64_t g = 0; g < ng; ++g)
              for (int64_t j = g * seg; j < (g + 1) * seg; ++j) a[k * nb + j] += vb[r * ng + g];
          weave(a, dst, D, per, scratch);
        }
#endif
        else
          for (int64_t g = 0; g < ng; ++g)  // channel d = j * per + k, value group g: channels g*gv .. g*gv+gv-1
            for (int64_t j = g * gv / per; j < (g + 1) * gv / per; ++j)
              for (int64_t k = 0; k < per; ++k) dst[j * per + k] = acc[r * D + k * nb + j] + vb[r * ng + g];
      }
    }
  });
  return merge_units(q_in, B * H, R, D, nunits, pm, pl, pacc);
}

// One query token per sequence over a cache of whole rows: q (B, H, r, D) as attend_kv's, k and v (B, H, T, D)
// bf16, fp16 or fp32 (a 16-bit cache), or int8 codes with ks and vs (B, H, T, 1) their fp16 per-token scales (an
// int8 cache without a window; else ks and vs are empty); allowed (B, T' >= T) bool, slot (1,) long: the query's
// own slot (slots after it are never read).  Tokens in chunks of `chunk` run in parallel (one KV head still uses
// every thread), each chunk's softmax merged at the end; a chunk with no allowed slot is skipped.  Scores are
// (q . row) * key scale, the weights of the values p * value scale; sums in fp32 -> (B, H, r, D) in q's dtype.
at::Tensor attend_rows(const at::Tensor& q_in, double scale, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& allowed, const at::Tensor& slot_t,
                       int64_t chunk) {
  const FlushDenormals flush;  // (the merge of the units, on this thread)
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes(),
              "attend_rows: q (B, H, r, D), k and v (B, H, T, D)");
  const int64_t B = q_in.size(0), H = q_in.size(1), R = q_in.size(2), D = q_in.size(3), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, "attend_rows: k ", k.sizes(), " does not fit q ",
              q_in.sizes());
  TORCH_CHECK(D <= MAXD && R <= MAXR, "attend_rows: head dim or query heads per KV head too large");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attend_rows: k and v of different dtypes");
  const bool scaled = k.scalar_type() == at::kChar || k.scalar_type() == at::kByte;  // int8 or E4M3 codes
  TORCH_CHECK(!scaled || (ks.numel() == B * H * T && vs.numel() == B * H * T && ks.scalar_type() == at::kHalf &&
                          vs.scalar_type() == at::kHalf), "attend_rows: int8 and fp8 rows need fp16 scales (B, H, T, 1)");
  const float unit = k.scalar_type() == at::kByte ? E4M3_UNIT : 1.f;  // what a code as read is worth
  const at::Tensor ks_ = scaled ? ks.contiguous() : ks, vs_ = scaled ? vs.contiguous() : vs;
  const at::Half *KS = scaled ? ks_.data_ptr<at::Half>() : nullptr, *VS = scaled ? vs_.data_ptr<at::Half>() : nullptr;
  TORCH_CHECK(allowed.size(-1) >= T, "attend_rows: the mask is shorter than the cache");
  const at::Tensor q_c = q_in.contiguous(), k_ = k.contiguous(), v_ = v.contiguous();
  std::vector<float> q(B * H * R * D);  // the query in fp32, times the softmax scale
  for (int64_t x = 0; x < B * H * R; ++x) row_f32(q_c.data_ptr(), q_c.scalar_type(), x, D, q.data() + x * D);
  for (auto& x : q) x *= static_cast<float>(scale);
  const int64_t n_seen = std::min<int64_t>(T, slot_of(slot_t, "attend_rows") + 1);  // slots 0 .. slot
  const MaskRows mask = mask_rows(allowed, B);
  const bool* AL = mask.p;
  const int64_t AT = mask.stride;
  // at least `chunk` tokens a unit, and no more units than ~8 per thread (the merge after them is serial)
  const int64_t per_bh = std::max<int64_t>(1, 8 * at::get_num_threads() / (B * H));
  chunk = std::max<int64_t>({1, chunk, (n_seen + per_bh - 1) / per_bh});
#ifdef FEWBITS_KV_I16
  // int8 codes in 16-bit integers (exact int32 sums: D <= MAXD and chunks of at most I8_LIM tokens)
  const bool i8 = k.scalar_type() == at::kChar && D % 16 == 0;
  if (i8) chunk = std::min(chunk, I8_LIM);
#endif
  const int64_t nunits = std::max<int64_t>(1, (n_seen + chunk - 1) / chunk);
  std::vector<float> pm(B * H * nunits * R, NEG_INF), pl(B * H * nunits * R, 0.f), pacc(B * H * nunits * R * D, 0.f);
  const void *K = k_.data_ptr(), *V = v_.data_ptr();
  const at::ScalarType dt = k.scalar_type();
  const float* Q = q.data();
  // one unit a (b, h): no merge; each thread writes its units' rows (as merge_units computes and rounds them)
  at::Tensor out = nunits == 1 ? at::empty(q_in.sizes(), q_in.options()) : at::Tensor();
  const auto finish_unit = [&](int64_t bh) {
    for (int64_t r = 0; r < R; ++r) {
      const float m = pm[bh * R + r], l = pl[bh * R + r];
      const float* a = pacc.data() + (bh * R + r) * D;
      store_row(out, (bh * R + r) * D, D, [&](int64_t d) { return m == NEG_INF ? 0.f : a[d] / l; });
    }
  };
  at::parallel_for(0, B * H * nunits, 1, [&](int64_t lo, int64_t hi) {
    const FlushDenormals flush;
    std::vector<float> s(R * chunk), sc(scaled ? chunk : 0);
    alignas(64) float c[MAXD];
#ifdef FEWBITS_KV_I16
    // the integer path's query and its steps, scores, weights (pairs of tokens: npad a head) and weighted codes
    alignas(64) int16_t q16[MAXR * MAXD];
    alignas(64) int32_t acc32[MAXR * MAXD];
    float qs[MAXR], wsc[MAXR];
    std::vector<int32_t> s32(i8 ? R * chunk : 0);
    std::vector<int16_t> w16(i8 ? R * (chunk + 1) : 0);
#endif
    const auto run_unit = [&](int64_t u) {
      const int64_t bh = u / nunits, t0 = (u % nunits) * chunk, b = bh / H;
      const int64_t n = std::max<int64_t>(0, std::min(chunk, n_seen - t0));
      const bool* ok = AL + b * AT + t0;
      if (std::find(ok, ok + n, true) == ok + n) return;  // no slot to attend to: pm stays -inf, the merge skips it
      const float* qh = Q + bh * R * D;
      const int64_t base = bh * nunits + u % nunits, row0 = bh * T + t0;
      float* acc = pacc.data() + base * R * D;
#ifdef FEWBITS_KV_I16
      if (i8) {  // int8 codes in 16-bit integers: scores, softmax, weights, values
        for (int64_t r = 0; r < R; ++r) qs[r] = to_i16(qh + r * D, D, D, q16 + r * D);
        int_scores<8>(static_cast<const uint8_t*>(K) + row0 * D, D, n, q16, R, D, s32.data(), n);
        halves(KS + row0, sc.data(), n);
        for (int64_t r = 0; r < R; ++r) {  // times the query's step and the key scales; masked: -inf
          float* sr = s.data() + r * n;
          scaled_where(s32.data() + r * n, qs[r], sc.data(), ok, n, NEG_INF, sr);
          pm[base * R + r] = row_max(sr, n);
          pl[base * R + r] = exp_sub_sum(sr, n, pm[base * R + r]);
        }
        halves(VS + row0, sc.data(), n);
        const int64_t npad = (n + 1) / 2 * 2;
        for (int64_t r = 0; r < R; ++r) {  // weights times the value scales (masked: exactly 0), in int16
          float* sr = s.data() + r * n;
          scaled_where(sr, 1.f, sc.data(), ok, n, 0.f, sr);
          wsc[r] = to_i16(sr, n, npad, w16.data() + r * npad);
        }
        int_values<8>(static_cast<const uint8_t*>(V) + row0 * D, D, D, n, w16.data(), npad, 0, R, D, acc32);
        for (int64_t r = 0; r < R; ++r) {
          const float st = wsc[r];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] = static_cast<float>(acc32[r * D + d]) * st;
        }
        return;
      }
#endif
      if (!scores_rows(K, dt, row0, D, ok, n, qh, R, s.data()))
      for (int64_t i = 0; i < n; ++i) {  // scores
        if (!ok[i]) { for (int64_t r = 0; r < R; ++r) s[r * n + i] = NEG_INF; continue; }
        row_f32(K, dt, row0 + i, D, c);
        for (int64_t r = 0; r < R; ++r) s[r * n + i] = dot(qh + r * D, c, D);
      }
      if (scaled) {  // the keys' per-token scales; a masked slot's -inf times 1 (its scale may be anything)
        halves(KS + row0, sc.data(), n);
        for (int64_t i = 0; i < n; ++i) sc[i] = ok[i] ? sc[i] * unit : 1.f;
        for (int64_t r = 0; r < R; ++r)  // (a select, then a product stored unconditionally: vectorised)
          for (int64_t i = 0; i < n; ++i) s[r * n + i] *= sc[i];
      }
      for (int64_t r = 0; r < R; ++r) {  // softmax within the chunk
        float* sr = s.data() + r * n;
        pm[base * R + r] = row_max(sr, n);
        pl[base * R + r] = exp_sub_sum(sr, n, pm[base * R + r]);
      }
      if (scaled) {  // the values' per-token scales folded into the weights
        halves(VS + row0, sc.data(), n);
        if (unit != 1.f) for (int64_t i = 0; i < n; ++i) sc[i] *= unit;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t i = 0; i < n; ++i) s[r * n + i] *= sc[i];  // (a masked slot's weight is never read)
      }
      // the weighted sum of values (a masked slot is skipped: it weighs exactly 0)
      if (values_rows(V, dt, row0, D, ok, n, s.data(), R, acc)) return;
      for (int64_t i = 0; i < n; ++i) {
        if (!ok[i]) continue;
        row_f32(V, dt, row0 + i, D, c);
        for (int64_t r = 0; r < R; ++r) axpy(s[r * n + i], c, acc + r * D, D);
      }
    };
    for (int64_t u = lo; u < hi; ++u) {
      run_unit(u);
      if (nunits == 1) finish_unit(u);  // its own softmax is the whole one: written out by this thread
    }
  });
  if (nunits == 1) return out;
  return merge_units(q_in, B * H, R, D, nunits, pm, pl, pacc);
}

namespace {
// fewbits.kvcache.quant's arithmetic in IEEE single precision (this file is built without -ffast-math, so
// divisions stay divisions), rounding half to even as torch.round does.
inline at::Half fp16_scale(float s) {  // _fp16_scale: the scale as fp16, never zero (an all-zero block: 1)
  const at::Half h(s);
  return static_cast<float>(h) > 0.f ? h : at::Half(1.f);
}

// quant_int8_per_token on one token: amax / 127 as an fp16 scale, codes round(x / s) in [-127, 127]
inline void quant_int8_row(const float* x, int64_t D, int8_t* codes, at::Half* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const at::Half s = fp16_scale(amax / 127.f);
  const float sf = static_cast<float>(s);
  for (int64_t d = 0; d < D; ++d)
    codes[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / sf))));
  *scale = s;
}

// _minmax_codes over n values x[i * stride]: scale (max - min) / qmax and minimum as fp16, codes
// round((x - m) / s) in [0, qmax] into c[i * stride]
inline void minmax_codes(const float* x, int64_t n, int64_t stride, int64_t qmax, uint8_t* c, at::Half* scale,
                         at::Half* minv) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  const at::Half s = fp16_scale((hi - lo) / static_cast<float>(qmax)), m(lo);
  const float sf = static_cast<float>(s), mf = static_cast<float>(m);
  for (int64_t i = 0; i < n; ++i)
    c[i * stride] = static_cast<uint8_t>(
        std::min(static_cast<float>(qmax), std::max(0.f, std::nearbyint((x[i * stride] - mf) / sf))));
  *scale = s;
  *minv = m;
}

// formats/packing.py's layout: code k of byte j is channel j * per + k, at bits k * bits
inline void pack_row(const uint8_t* c, int64_t D, int64_t bits, uint8_t* out) {
  const int64_t per = 8 / bits;
  for (int64_t j = 0; j < D / per; ++j) {
    uint8_t byte = 0;
    for (int64_t k = 0; k < per; ++k) byte |= static_cast<uint8_t>(c[j * per + k] << (k * bits));
    out[j] = byte;
  }
}

void check_buffer(const at::Tensor& t, at::ScalarType dt, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, "append_kv: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.dim() == 4, "append_kv: ", name, " must be a contiguous (B, H, n, m) tensor");
}
}  // namespace

// One decode step's write into an int8 or KIVI cache, `LayerKV.step`'s semantics: k, v (B, H, 1, D) in the
// window's dtype go to window slot `slot` % W (W = rk.size(2); W = 0, rk/rv empty: no window, int8 only, the
// token is quantised at once); when a whole group of G tokens (int8: one) has just left the window of the
// `residual` most recent tokens (slot + 1 - residual a positive multiple of G), that group is quantised from
// the window into its slots of codes and scales.  Buffers as in attend_kv; km/vm unused (empty) for int8.
void append_kv(const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& slot_t, int64_t bits, int64_t G,
               int64_t gv, int64_t residual, const at::Tensor& rk, const at::Tensor& rv, const at::Tensor& kc,
               const at::Tensor& ks, const at::Tensor& km, const at::Tensor& vc, const at::Tensor& vs,
               const at::Tensor& vm) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "append_kv: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(k_in.dim() == 4 && k_in.size(2) == 1 && v_in.sizes() == k_in.sizes(),
              "append_kv: k and v must be (B, H, 1, D), got ", k_in.sizes(), " and ", v_in.sizes());
  TORCH_CHECK(v_in.scalar_type() == k_in.scalar_type(), "append_kv: k and v differ in dtype");
  const bool kivi = bits != 8;
  const int64_t B = k_in.size(0), H = k_in.size(1), D = k_in.size(3), BH = B * H;
  const int64_t per = 8 / bits, nb = D / per, grp = kivi ? G : 1, qmax = (1 << bits) - 1;
  const int64_t W = rk.numel() ? rk.size(2) : 0;
  TORCH_CHECK(D <= MAXD && D % per == 0, "append_kv: head dim ", D, " unsupported");
  TORCH_CHECK(grp >= 1 && (!kivi || (gv >= 1 && D % gv == 0)), "append_kv: bad group sizes G=", G, " gv=", gv);
  check_buffer(kc, kivi ? at::kByte : at::kChar, "kc");
  check_buffer(vc, kivi ? at::kByte : at::kChar, "vc");
  check_buffer(ks, at::kHalf, "ks");
  check_buffer(vs, at::kHalf, "vs");
  const int64_t T = kc.size(2);
  TORCH_CHECK(kc.size(0) == B && kc.size(1) == H && kc.size(3) == nb && vc.sizes() == kc.sizes(),
              "append_kv: codes of shape ", kc.sizes(), " do not fit k of shape ", k_in.sizes());
  if (kivi) {
    check_buffer(km, at::kHalf, "km");
    check_buffer(vm, at::kHalf, "vm");
    TORCH_CHECK(T % G == 0 && ks.size(2) == T / G && ks.size(3) == D && km.sizes() == ks.sizes() &&
                vs.size(2) == T && vs.size(3) == D / gv && vm.sizes() == vs.sizes(),
                "append_kv: KIVI scales do not fit the codes");
  } else {
    TORCH_CHECK(ks.size(2) == T && ks.size(3) == 1 && vs.sizes() == ks.sizes(), "append_kv: int8 scales do not fit");
  }
  TORCH_CHECK(W || !kivi, "append_kv: a KIVI cache needs its 16-bit window");
  if (W) {
    TORCH_CHECK(rk.scalar_type() == k_in.scalar_type() && rv.scalar_type() == k_in.scalar_type(),
                "append_kv: k and v must be in the window's dtype ", rk.scalar_type(), ", got ", k_in.scalar_type());
    TORCH_CHECK(rk.is_contiguous() && rv.is_contiguous() && rk.dim() == 4 && rk.size(0) == B && rk.size(1) == H &&
                rk.size(3) == D && rv.sizes() == rk.sizes(), "append_kv: the window does not fit k");
  }
  const int64_t slot = slot_of(slot_t, "append_kv");
  TORCH_CHECK(slot >= 0 && slot < T, "append_kv: slot ", slot, " outside the cache's ", T, " slots");
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  const at::ScalarType dt = k.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat, "append_kv: k must be a float tensor");
  const int64_t es = k.element_size();
  int64_t g0 = slot;  // the first token quantised by this step
  if (W) {
    const int64_t j = slot % W;
    auto* RK = static_cast<char*>(rk.data_ptr());
    auto* RV = static_cast<char*>(rv.data_ptr());
    const auto *K = static_cast<const char*>(k.data_ptr()), *V = static_cast<const char*>(v.data_ptr());
    for (int64_t bh = 0; bh < BH; ++bh) {
      std::memcpy(RK + (bh * W + j) * D * es, K + bh * D * es, D * es);
      std::memcpy(RV + (bh * W + j) * D * es, V + bh * D * es, D * es);
    }
    const int64_t left = slot + 1 - residual;  // tokens that have left the window
    if (left < grp || left % grp != 0) return;  // no group completed by this step
    g0 = left - grp;
  }
  std::vector<float> xk(grp * D), xv(grp * D);
  std::vector<uint8_t> ck(grp * D), cv(grp * D);
  const void *SK = W ? rk.data_ptr() : k.data_ptr(), *SV = W ? rv.data_ptr() : v.data_ptr();
  uint8_t *KC = static_cast<uint8_t*>(kc.data_ptr()), *VC = static_cast<uint8_t*>(vc.data_ptr());
  at::Half *KS = ks.data_ptr<at::Half>(), *VS = vs.data_ptr<at::Half>();
  for (int64_t bh = 0; bh < BH; ++bh) {
    for (int64_t i = 0; i < grp; ++i) {
      const int64_t row = W ? bh * W + (g0 + i) % W : bh;
      row_f32(SK, dt, row, D, xk.data() + i * D);
      row_f32(SV, dt, row, D, xv.data() + i * D);
    }
    if (!kivi) {
      const int64_t t = bh * T + g0;
      quant_int8_row(xk.data(), D, reinterpret_cast<int8_t*>(KC) + t * D, KS + t);
      quant_int8_row(xv.data(), D, reinterpret_cast<int8_t*>(VC) + t * D, VS + t);
      continue;
    }
    at::Half *KM = km.data_ptr<at::Half>(), *VM = vm.data_ptr<at::Half>();
    const int64_t sg = (bh * (T / G) + g0 / G) * D;  // keys: one scale and minimum per channel of the group
    for (int64_t d = 0; d < D; ++d) minmax_codes(xk.data() + d, grp, D, qmax, ck.data() + d, KS + sg + d, KM + sg + d);
    const int64_t ng = D / gv;  // values: per token, per group of gv channels
    for (int64_t i = 0; i < grp; ++i) {
      const int64_t t = bh * T + g0 + i;
      for (int64_t g = 0; g < ng; ++g)
        minmax_codes(xv.data() + i * D + g * gv, gv, 1, qmax, cv.data() + i * D + g * gv, VS + t * ng + g,
                     VM + t * ng + g);
      pack_row(ck.data() + i * D, D, bits, KC + t * nb);
      pack_row(cv.data() + i * D, D, bits, VC + t * nb);
    }
  }
}

TORCH_LIBRARY(fewbits_kv, m) {
  m.def("attend_kv(Tensor q, float scale, int bits, int G, int gv, Tensor kc, Tensor ks, Tensor km, Tensor vc, "
        "Tensor vs, Tensor vm, Tensor allowed, Tensor slot, int residual, Tensor rk, Tensor rv, int chunk) -> Tensor");
  m.impl("attend_kv", c10::DispatchKey::CPU, &attend_kv);
  m.def("attend_rows(Tensor q, float scale, Tensor k, Tensor v, Tensor ks, Tensor vs, Tensor allowed, Tensor slot, "
        "int chunk) -> Tensor");
  m.impl("attend_rows", c10::DispatchKey::CPU, &attend_rows);
  m.def("append_kv(Tensor k, Tensor v, Tensor slot, int bits, int G, int gv, int residual, Tensor(a!) rk, "
        "Tensor(b!) rv, Tensor(c!) kc, Tensor(d!) ks, Tensor(e!) km, Tensor(f!) vc, Tensor(g!) vs, "
        "Tensor(h!) vm) -> ()");
  m.impl("append_kv", c10::DispatchKey::CPU, &append_kv);
}
