
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <ATen/cpu/Utils.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(FEWBITS_ROWS_PORTABLE)
#define ROWS_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE)
#define ROWS_AVX2 1
#include <immintrin.h>
#elif defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE_NOF16C)
#include <immintrin.h>
#endif
#ifndef ROWS_NS
#define ROWS_NS fewbits_rows
#endif

namespace {
constexpr int64_t MAXM = 8;     // rows of x per pass over the weight
constexpr int64_t BLOCK = 32;   // output channels per parallel unit
// rows of weight ahead whose same columns a pass prefetches (the hardware prefetcher misses the pattern of R rows
// read side by side), into L2 (prefetcht1), not L1: on an AVX-512 EPYC, with the same prefetches into L1, bf16
// weights times 8 rows of x ran at 0.55-0.67x this speed and int8 weights times one row at 0.71-0.98x
// (benchmarks/bench_rows.py --baseline); the load itself then brings the line to L1 from an L2 hit
constexpr int64_t PREFETCH_ROWS = 16;

// I8B: int8 weights times bf16 x through dpbf16 (AVX512-BF16 builds, 2+ rows of a bf16 x)
enum Kind { BF16 = 0, F16 = 1, I8 = 2, E4M3 = 3, E5M2 = 4, I8B = 5 };
constexpr int64_t esz(Kind kind) { return kind == BF16 || kind == F16 ? 2 : 1; }  // bytes per weight

// FP8 codes as the bits of an fp16 (what F16C / AVX-512 widen to fp32 exactly): E5M2 is an fp16's top byte; E4M3's
// seven exponent and mantissa bits, shifted 7 left, sit in an fp16's with an exponent bias of 15 instead of 7, so
// the fp16 reads as the E4M3 value / 2^8 (the operator multiplies the scales by 2^8 instead: exact).  Subnormal
// codes become fp16 subnormals, read exactly.  The byte is sign-extended first, so the shift moves the sign into
// bit 15 and a copy into bit 14, which the mask clears.  E4M3's NaN codes (0x7F, 0xFF) read as +-480 / 2^8:
// fewbits' codes never hold them (the quantiser clamps to +-448).
constexpr uint16_t E4M3_MASK = 0xBF80;
constexpr float E4M3_SCALE = 256.f;
inline uint16_t fp8_as_half(uint8_t b, Kind kind) {
  return kind == E5M2 ? uint16_t(b << 8) : uint16_t((int32_t(int8_t(b)) * 128) & E4M3_MASK);
}

// ---------------------------------------------------------------- portable: loops the compiler vectorises
// One weight row widened to fp32 (K floats), then M dot products with x (fp32, M x K).
inline void widen_row(const void* w, Kind kind, int64_t K, float* dst) {
  if (kind == BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(w);
    for (int64_t k = 0; k < K; ++k) { uint32_t u = static_cast<uint32_t>(s[k]) << 16; std::memcpy(dst + k, &u, 4); }
  } else if (kind == I8) {
    const int8_t* s = static_cast<const int8_t*>(w);
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(s[k]);
  } else if (kind == E4M3 || kind == E5M2) {
    const uint8_t* s = static_cast<const uint8_t*>(w);
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(c10::Half(fp8_as_half(s[k], kind), c10::Half::from_bits()));
  } else {
    const at::Half* s = static_cast<const at::Half*>(w);
    int64_t k = 0;
#if defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE_NOF16C)
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k))));
#endif
    for (; k < K; ++k) dst[k] = static_cast<float>(s[k]);
  }
}

template <int M>
void rows_portable(const float* __restrict x, const char* w, int64_t ld_bytes, Kind kind, int64_t K, int64_t n0,
                   int64_t n1, float* __restrict out, int64_t N, float* __restrict buf) {
  for (int64_t n = n0; n < n1; ++n) {
    widen_row(w + n * ld_bytes, kind, K, buf);
    float acc[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += xm[k] * buf[k];
      acc[m] = s;
    }
    for (int m = 0; m < M; ++m) out[m * N + n] = acc[m];
  }
}

// out[m * N + n] for n0 <= n < n1 in blocks of R channels (then single channels): block(rtag, n, acc) fills acc
// (M x RR) for channels n .. n + RR - 1
template <int M, int R, class Block>
inline void channel_blocks(int64_t n0, int64_t n1, float* __restrict out, int64_t N, Block block) {
  float acc[M * R];
  auto one = [&](auto rtag, int64_t n) {
    constexpr int RR = decltype(rtag)::value;
    block(rtag, n, acc);
    for (int m = 0; m < M; ++m) for (int r = 0; r < RR; ++r) out[m * N + n + r] = acc[m * RR + r];
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) one(std::integral_constant<int, R>{}, n);
  for (; n < n1; ++n) one(std::integral_constant<int, 1>{}, n);
}

// One row of x: a thread's channels read as ROW1_STREAMS runs of consecutive weight rows, far apart in memory, a row
// of each in turn, with no software prefetch.  One run (one sequential stream a thread) left the memory idle
// between the hardware prefetcher's requests: on an AVX2 EPYC (Zen 3, 2 threads), a row at a time over one run read
// 27-31 GB/s where a plain sum of the same memory read 34-36; four runs, measured against the one-run build in
// one process (alternating rounds, the fastest call of each, bf16 and int8 weights, SmolLM2's layers rotated over
// 128 MB of copies and both LM heads from memory): 1.04-1.46x (a second run 0.98-1.54x), Gemma-3's 335 MB bf16
// head 27-28 -> 35-40 GB/s; two runs 1.04-1.36x, eight 0.86-1.15x, the row prefetch kept beside four runs
// 0.94-1.45x.  Paths bound by their instructions rather than the memory lose by it and stay one run: fp8 weights
// (0.96-0.99x) and q4_mm's one-row int4 path (0.85-1.05x).
constexpr int ROW1_STREAMS = 4;

// f(n) for every n in n0 .. n1 - 1, in ROW1_STREAMS runs taken a row of each in turn
template <class F>
inline void row1_streams(int64_t n0, int64_t n1, F f) {
  const int64_t len = (n1 - n0) / ROW1_STREAMS;
  for (int64_t i = 0; i < len; ++i)
#pragma GCC unroll 4
    for (int s = 0; s < ROW1_STREAMS; ++s) f(n0 + s * len + i);
  for (int64_t n = n0 + ROW1_STREAMS * len; n < n1; ++n) f(n);
}

#ifdef ROWS_AVX2
// ---------------------------------------------------------------- AVX2 + FMA (no AVX-512): 8 columns a step
// bf16, fp16 or int8 weights widened to fp32 and multiplied with x in fp32 (M x K), as the AVX-512 int8 path.
template <Kind KIND>
inline __m256 widen8(const char* w, int64_t k) {
  if (KIND == BF16)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k))), 16));
  if (KIND == F16) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * k)));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
  if (KIND == E4M3)
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(int16_t(E4M3_MASK))));
  if (KIND == E5M2) return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

template <Kind KIND>
inline float scalar_w(const char* w, int64_t k) {
  if (KIND == BF16) { uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(w)[k]) << 16; float f;
                      std::memcpy(&f, &u, 4); return f; }
  if (KIND == F16) return float(reinterpret_cast<const at::Half*>(w)[k]);
  if (KIND == E4M3 || KIND == E5M2)
    return float(c10::Half(fp8_as_half(reinterpret_cast<const uint8_t*>(w)[k], KIND), c10::Half::from_bits()));
  return float(reinterpret_cast<const int8_t*>(w)[k]);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <Kind KIND, int M, int R>
inline void block_avx2(const float* __restrict x, int64_t K, const char* w, int64_t ld_bytes, float* acc_out) {
  constexpr int64_t ESZ = esz(KIND);
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = widen8<KIND>(w + r * ld_bytes, k);
      if ((k * ESZ) % 64 == 0) _mm_prefetch(w + (r + PREFETCH_ROWS) * ld_bytes + k * ESZ, _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[m][r]);
      for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * scalar_w<KIND>(w + r * ld_bytes, k);
      acc_out[m * R + r] = s;
    }
}

// one row of x: one weight row at a time, four FMA chains.  Reading several weight rows side by side (as more
// rows of x need, to reuse each loaded weight vector) makes as many interleaved streams a few hundred bytes apart,
// which the hardware prefetchers of an AVX2 EPYC follow at half the memory's speed; one row at a time reads each
// row as one sequential run (and row1_streams keeps four such runs, far apart, going at once).
template <Kind KIND>
inline float row1_avx2(const float* __restrict x, int64_t K, const char* w, int64_t ld_bytes) {
  constexpr int64_t ESZ = esz(KIND);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * j), widen8<KIND>(w, k + 8 * j), acc[j]);
  }
  for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), widen8<KIND>(w, k), acc[0]);
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; k < K; ++k) s += x[k] * scalar_w<KIND>(w, k);
  return s;
}

// channels per block for M rows: accumulators and widened weights within the 16 vector registers (one row of x:
// row1_avx2)
template <int M> constexpr int chans2() { return M == 1 ? 1 : (M == 2 ? 4 : (M == 3 ? 3 : (M <= 6 ? 2 : 1))); }

// 7 or 8 rows of x whose fp32 copy outgrows the L1 data cache (8 rows: in_features above 1024): chans2 gives one
// output channel a pass (no room in 16 registers for more), M + 1 loads for M FMAs, and with x's vectors coming
// from L2 those loads bound the product.  Here the rows go in two groups, 4 + 4 or 4 + 3, each times TILE_CHANS
// channels (8 accumulators: 6 loads for 8 FMAs); both groups take each chunk of channels in turn, so the second
// finds those weight rows in cache.  Where x fits L1 the one-channel pass stays faster; 5 and 6 rows already
// run 2 channels a pass.  Measured on an AVX2 EPYC, 2 threads, against the one-channel pass in one run
// (benchmarks/bench_rows.py --rows 7,8 --baseline, bf16 and int8 weights of 1536-8192 columns): 8 rows
// 1.26-1.53x, 7 rows 1.16-1.40x; 6 rows in such tiles ran 0.76-0.94x of their own 2-channel pass.
constexpr int TILE_CHANS = 2;
constexpr int64_t L1_X_BYTES = 32768;  // x (M x K fp32) above this takes the tiles

template <Kind KIND, int M>
void tiles_avx2(const float* x, const char* w, int64_t ld_bytes, int64_t K, int64_t n0, int64_t n1,
                float* __restrict out, int64_t N) {
  constexpr int G1 = 4, G2 = M - G1;
  auto group = [&](auto gtag, int m0, int64_t c0, int64_t c1) {
    constexpr int G = decltype(gtag)::value;
    float acc[G * TILE_CHANS];
    const float* xg = x + m0 * K;
    int64_t n = c0;
    for (; n + TILE_CHANS <= c1; n += TILE_CHANS) {
      block_avx2<KIND, G, TILE_CHANS>(xg, K, w + n * ld_bytes, ld_bytes, acc);
      for (int m = 0; m < G; ++m)
        for (int r = 0; r < TILE_CHANS; ++r) out[(m0 + m) * N + n + r] = acc[m * TILE_CHANS + r];
    }
    for (; n < c1; ++n) {
      block_avx2<KIND, G, 1>(xg, K, w + n * ld_bytes, ld_bytes, acc);
      for (int m = 0; m < G; ++m) out[(m0 + m) * N + n] = acc[m];
    }
  };
  for (int64_t c = n0; c < n1; c += TILE_CHANS) {
    const int64_t c1 = std::min(n1, c + TILE_CHANS);
    group(std::integral_constant<int, G1>{}, 0, c, c1);
    group(std::integral_constant<int, G2>{}, G1, c, c1);
  }
}

template <int M>
void rows_avx2(const float* x, const char* w, int64_t ld_bytes, Kind kind, int64_t K, int64_t n0, int64_t n1,
               float* __restrict out, int64_t N) {
  if constexpr (M == 1) {
    auto run = [&](auto ktag) {
      constexpr Kind KIND = decltype(ktag)::value;
      auto one = [&](int64_t n) { out[n] = row1_avx2<KIND>(x, K, w + n * ld_bytes, ld_bytes); };
      if constexpr (KIND == E4M3 || KIND == E5M2)  // bound by widening the codes: in order (0.96-0.99x in runs)
        for (int64_t n = n0; n < n1; ++n) one(n);
      else
        row1_streams(n0, n1, one);
    };
    if (kind == BF16) run(std::integral_constant<Kind, BF16>{});
    else if (kind == F16) run(std::integral_constant<Kind, F16>{});
    else if (kind == E4M3) run(std::integral_constant<Kind, E4M3>{});
    else if (kind == E5M2) run(std::integral_constant<Kind, E5M2>{});
    else run(std::integral_constant<Kind, I8>{});
    return;
  }
  if constexpr (M >= 7) {
    if (M * K * 4 > L1_X_BYTES) {
      if (kind == BF16) tiles_avx2<BF16, M>(x, w, ld_bytes, K, n0, n1, out, N);
      else if (kind == F16) tiles_avx2<F16, M>(x, w, ld_bytes, K, n0, n1, out, N);
      else if (kind == E4M3) tiles_avx2<E4M3, M>(x, w, ld_bytes, K, n0, n1, out, N);
      else if (kind == E5M2) tiles_avx2<E5M2, M>(x, w, ld_bytes, K, n0, n1, out, N);
      else tiles_avx2<I8, M>(x, w, ld_bytes, K, n0, n1, out, N);
      return;
    }
  }
  channel_blocks<M, chans2<M>()>(n0, n1, out, N, [&](auto rtag, int64_t n, float* acc) {
    constexpr int RR = decltype(rtag)::value;
    const char* wn = w + n * ld_bytes;
    if (kind == BF16) block_avx2<BF16, M, RR>(x, K, wn, ld_bytes, acc);
    else if (kind == F16) block_avx2<F16, M, RR>(x, K, wn, ld_bytes, acc);
    else if (kind == E4M3) block_avx2<E4M3, M, RR>(x, K, wn, ld_bytes, acc);
    else if (kind == E5M2) block_avx2<E5M2, M, RR>(x, K, wn, ld_bytes, acc);
    else block_avx2<I8, M, RR>(x, K, wn, ld_bytes, acc);
  });
}

#define ROWS_A8 1
// int8 weights x int8 activations (int8_mm_a8) without vpdpbusd: vpmaddubsw multiplies unsigned by signed
// bytes, so |w| (vpabsb; -128 reads as 128 unsigned) times the activation codes given w's sign (vpsignb; the
// codes are within +-127, so negating one never overflows), pairs summed in int16 (<= 2 * 128 * 127 = 32512: no
// saturation), vpmaddwd by ones to int32 per 4 columns: exact; 32 columns (one activation block) a step, scaled
// by the block's d in fp32.
template <int M, int R, bool PREFETCH = true>
inline void block_a8(const int8_t* __restrict xq, const float* __restrict d, int64_t K, const int8_t* w, int64_t ld,
                     float* acc_out) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i wv[R], aw[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * ld + k));
      aw[r] = _mm256_abs_epi8(wv[r]);
      if (PREFETCH && k % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * ld + k), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
      const __m256 dv = _mm256_set1_ps(d[m * (K / 32) + k / 32]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, wv[r])), ones);
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dv, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc_out[m * R + r] = hsum8(acc[m][r]);
}

// channels per block for M rows: accumulators, weights and their magnitudes within the 16 vector registers.  One
// row of x reads one weight row at a time in row1_streams' four runs, without the row prefetch, as int8_mm's one
// row: against one run with the prefetch (old and new build side by side in one process, AVX2 EPYC, 2 threads,
// weights from memory, `bench_rows`' shapes) the LM heads 1.17-1.25x (SmolLM2's, 28 MB) and 1.18x (Gemma-3's,
// 168 MB) in two runs, SmolLM2's layers 0.98-1.06x (one gate/up figure of 0.81x did not come back in the second run)
template <int M> constexpr int chans_a8() { return M == 1 ? 1 : (M == 2 ? 3 : (M <= 4 ? 2 : 1)); }

template <int M>
void rows_a8(const int8_t* xq, const float* d, const int8_t* w, int64_t ld, int64_t K, int64_t n0, int64_t n1,
             float* __restrict out, int64_t N) {
  if constexpr (M == 1) {  // as int8_mm's one row (row1_streams): four runs of rows, no software prefetch
    row1_streams(n0, n1, [&](int64_t n) { block_a8<1, 1, false>(xq, d, K, w + n * ld, ld, out + n); });
    return;
  }
  channel_blocks<M, chans_a8<M>()>(n0, n1, out, N, [&](auto rtag, int64_t n, float* acc) {
    block_a8<M, decltype(rtag)::value>(xq, d, K, w + n * ld, ld, acc);
  });
}

#endif

#ifdef ROWS_AVX512
// ---------------------------------------------------------------- AVX-512
inline __m512 widen_bf16(const uint16_t* p, __mmask16 mk) {  // up to 16 bf16 -> fp32 (a 16-bit shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

// out[i] = the sum of v[i]'s 16 lanes, i < N: each folded to 4 lanes (two adds of halves), then four at a time
// through two levels of hadd (one store of 4 sums), where reducing each alone costs twice the instructions; a
// block of M rows x R channels ends with M * R of them (8 x 3 at 576 columns: ~25% of a block's instructions)
template <int N>
inline void sums(const __m512* v, float* out) {
  __m128 q[N];
#pragma GCC unroll 24
  for (int i = 0; i < N; ++i) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v[i]),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
    q[i] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  int i = 0;
#pragma GCC unroll 6
  for (; i + 4 <= N; i += 4)
    _mm_storeu_ps(out + i, _mm_hadd_ps(_mm_hadd_ps(q[i], q[i + 1]), _mm_hadd_ps(q[i + 2], q[i + 3])));
  for (; i < N; ++i) {
    const __m128 t = _mm_hadd_ps(q[i], q[i]);
    out[i] = _mm_cvtss_f32(_mm_hadd_ps(t, t));
  }
}

#ifdef __AVX512BF16__
// acc[m][r] += dpbf16(x row m's 32 columns from k (mk: those before K), wv[r]): each weight vector serves every row
template <int M, int R>
inline void dpbf16_rows(__m512 (&acc)[M][R], const uint16_t* x, int64_t K, int64_t k, __mmask32 mk,
                        const __m512i* wv) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m512i xv = _mm512_maskz_loadu_epi16(mk, x + m * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
  }
}

#endif

// R output channels at once, M rows of x: M * R accumulators, each loaded weight vector used M times.
// bf16 x bf16 (x as bf16, M x K): 32 columns a step through dpbf16 (exact products, fp32 sums).
template <int M, int R>
inline void block_bf16(const uint16_t* __restrict x, int64_t K, const uint16_t* w, int64_t ld, float* acc_out) {
#ifdef __AVX512BF16__
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_loadu_si512(w + r * ld + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * ld + k), _MM_HINT_T1);
    }
    dpbf16_rows<M, R>(acc, x, K, k, ~__mmask32(0), wv);
  }
  if (k < K) {
    const __mmask32 mk = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(mk, w + r * ld + k);
    dpbf16_rows<M, R>(acc, x, K, k, mk, wv);
  }
  sums<M * R>(&acc[0][0], acc_out);
#else
  // AVX-512 without BF16: widen both (x as fp32 would be faster, but this CPU class is rare)
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * ld + k, mk);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = widen_bf16(x + m * K + k, mk);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  sums<M * R>(&acc[0][0], acc_out);
#endif
}

#ifdef __AVX512BF16__
// int8 weights x bf16 x (M x K) through dpbf16: 32 codes widened to fp32 and packed to bf16 (exact: |code| <= 128
// has at most 8 significant bits) once, then one dpbf16 per row of x (the products exact, fp32 sums), where the
// fp32 path spends two FMAs per row and 32 columns: 5 + M instructions per 32 weights against 4 + 2 M.
template <int M, int R>
inline void block_i8_bf16(const uint16_t* __restrict x, int64_t K, const int8_t* w, int64_t ld, float* acc_out) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask16 m0 = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 m1 = left >= 32 ? __mmask16(0xFFFF) : left <= 16 ? __mmask16(0)
                                                                      : static_cast<__mmask16>((1u << (left - 16)) - 1);
    __m512i wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* p = w + r * ld + k;
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, p)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, p + 16)));
      wv[r] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // columns k .. k+15 from lo, k+16 .. k+31 from hi
      if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_ROWS * ld), _MM_HINT_T1);
    }
    dpbf16_rows<M, R>(acc, x, K, k, left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << left) - 1), wv);
  }
  sums<M * R>(&acc[0][0], acc_out);
}
#endif

// fp16 or int8 weights widened to fp32, x fp32 (M x K): 16 columns a step.
template <Kind KIND>
inline __m512 widen16(const void* w, int64_t k, __mmask16 mk, bool full) {
  if (KIND == F16) {
    const at::Half* p = static_cast<const at::Half*>(w) + k;
    const __m256i h = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(mk, p);
    return _mm512_cvtph_ps(h);
  }
  const int8_t* p = static_cast<const int8_t*>(w) + k;
  const __m128i b = full ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(mk, p);
  if (KIND == E4M3)
    return _mm512_cvtph_ps(
        _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(int16_t(E4M3_MASK))));
  if (KIND == E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

template <Kind KIND, int M, int R>
inline void block_f32(const float* __restrict x, int64_t K, const char* w, int64_t ld_bytes, float* acc_out) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = widen16<KIND>(w + r * ld_bytes, k, 0, true);
      if ((k * esz(KIND)) % 64 == 0)  // once per cache line of the weight row
        _mm_prefetch(w + (r + PREFETCH_ROWS) * ld_bytes + k * esz(KIND), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = widen16<KIND>(w + r * ld_bytes, k, mk, false);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  sums<M * R>(&acc[0][0], acc_out);
}

// channels per block for M rows: as many accumulators as the 32 vector registers allow
// (one row of x: one weight row at a time, row1_avx512; several side by side, as more rows of x need to reuse each
// loaded weight vector, are as many interleaved streams, which the hardware prefetchers of an AVX-512 EPYC followed
// at about half the memory's speed: one row's 8-channel blocks ran 0.47-0.78x of one channel at a time)
template <int M> constexpr int chans() { return M == 1 ? 1 : (M == 2 ? 6 : (M <= 4 ? 4 : 3)); }

// one row of x times one weight row: bf16 pairs through dpbf16 (two chains, 64 columns a step), other weights
// widened to fp32 (four FMA chains); the row PREFETCH_ROWS ahead prefetched once per cache line
inline float row1_bf16(const uint16_t* __restrict x, int64_t K, const uint16_t* w, int64_t ld) {
#ifdef __AVX512BF16__
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_ROWS * ld + k), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_ROWS * ld + k + 32), _MM_HINT_T1);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(w + k + 32));
  }
  for (; k < K; k += 32) {
    const __mmask32 mk = K - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (K - k)) - 1);
    _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_ROWS * ld + k), _MM_HINT_T1);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mk, x + k), (__m512bh)_mm512_maskz_loadu_epi16(mk, w + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
  float acc;
  block_bf16<1, 1>(x, K, w, ld, &acc);
  return acc;
#endif
}

template <Kind KIND>
inline float row1_f32(const float* __restrict x, int64_t K, const char* w, int64_t ld_bytes) {
  constexpr int64_t ESZ = esz(KIND);
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 2
    for (int64_t c = 0; c < 64 * ESZ; c += 64) _mm_prefetch(w + PREFETCH_ROWS * ld_bytes + k * ESZ + c, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * j), widen16<KIND>(w, k + 16 * j, 0, true), a[j]);
  }
  for (; k + 16 <= K; k += 16) a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), widen16<KIND>(w, k, 0, true), a[0]);
  if (k < K) {
    const __mmask16 mk = static_cast<__mmask16>((1u << (K - k)) - 1);
    a[1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + k), widen16<KIND>(w, k, mk, false), a[1]);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
}

template <int M>
void rows_avx512(const void* xv, const char* w, int64_t ld_bytes, Kind kind, int64_t K, int64_t n0, int64_t n1,
                 float* __restrict out, int64_t N) {
  if constexpr (M == 1) {
    for (int64_t n = n0; n < n1; ++n) {
      const char* wn = w + n * ld_bytes;
      const float* xf = static_cast<const float*>(xv);
      if (kind == BF16) out[n] = row1_bf16(static_cast<const uint16_t*>(xv), K, reinterpret_cast<const uint16_t*>(wn),
                                           ld_bytes / 2);
      else if (kind == F16) out[n] = row1_f32<F16>(xf, K, wn, ld_bytes);
      else if (kind == E4M3) out[n] = row1_f32<E4M3>(xf, K, wn, ld_bytes);
      else if (kind == E5M2) out[n] = row1_f32<E5M2>(xf, K, wn, ld_bytes);
#ifdef __AVX512BF16__
      else if (kind == I8B) block_i8_bf16<1, 1>(static_cast<const uint16_t*>(xv), K,
                                                reinterpret_cast<const int8_t*>(wn), ld_bytes, out + n);
#endif
      else out[n] = row1_f32<I8>(xf, K, wn, ld_bytes);
    }
    return;
  }
  channel_blocks<M, chans<M>()>(n0, n1, out, N, [&](auto rtag, int64_t n, float* acc) {
    constexpr int RR = decltype(rtag)::value;
    const char* wn = w + n * ld_bytes;
    if (kind == BF16) block_bf16<M, RR>(static_cast<const uint16_t*>(xv), K, reinterpret_cast<const uint16_t*>(wn),
                                        ld_bytes / 2, acc);
    else if (kind == F16) block_f32<F16, M, RR>(static_cast<const float*>(xv), K, wn, ld_bytes, acc);
    else if (kind == E4M3) block_f32<E4M3, M, RR>(static_cast<const float*>(xv), K, wn, ld_bytes, acc);
    else if (kind == E5M2) block_f32<E5M2, M, RR>(static_cast<const float*>(xv), K, wn, ld_bytes, acc);
#ifdef __AVX512BF16__
    else if (kind == I8B) block_i8_bf16<M, RR>(static_cast<const uint16_t*>(xv), K, reinterpret_cast<const int8_t*>(wn),
                                               ld_bytes, acc);
#endif
    else block_f32<I8, M, RR>(static_cast<const float*>(xv), K, wn, ld_bytes, acc);
  });
}

#ifdef __AVX512VNNI__
#define ROWS_A8 1
// int8 weights x int8 activations (int8_mm_a8): xu = codes + 128 (unsigned, M x K), d (M x K/32) their block
// scales.  Per 64 columns: vpdpbusd(xu, w) - vpdpbusd(128, w) = sum of codes * w over each lane's 4 columns,
// exact in int32; lanes 0-7 hold the first block of 32 columns, 8-15 the second, scaled in fp32 by its d.
template <int M, int R>
inline void block_a8(const uint8_t* __restrict xu, const float* __restrict d, int64_t K, const int8_t* w, int64_t ld,
                     float* acc_out) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m) for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const __m512i c128 = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const bool full = K - k >= 64;  // else 32 columns (K is a multiple of 32)
    const __mmask64 mk = full ? ~0ull : 0xFFFFFFFFull;
    __m512i wv[R], corr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wv[r] = _mm512_maskz_loadu_epi8(mk, w + r * ld + k);
      corr[r] = _mm512_dpbusd_epi32(zero, c128, wv[r]);
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * ld + k), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi8(mk, xu + m * K + k);
      const float* dm = d + m * (K / 32) + k / 32;
      const __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(dm[0]), _mm256_set1_ps(full ? dm[1] : 0.f), 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i t = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xv, wv[r]), corr[r]);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), dv, acc[m][r]);
      }
    }
  }
  sums<M * R>(&acc[0][0], acc_out);
}

template <int M>
void rows_a8(const uint8_t* xu, const float* d, const int8_t* w, int64_t ld, int64_t K, int64_t n0, int64_t n1,
             float* __restrict out, int64_t N) {
  channel_blocks<M, chans<M>()>(n0, n1, out, N, [&](auto rtag, int64_t n, float* acc) {
    block_a8<M, decltype(rtag)::value>(xu, d, K, w + n * ld, ld, acc);
  });
}
#endif
#endif
#ifndef ROWS_A8
#define ROWS_A8 0
#endif

#if defined(ROWS_AVX2) || defined(ROWS_AVX512)
#define ROWS_X16 1
// One row of x on int8 weights through int16 (X16_MAX_ROWS): x per block of 32 columns as int16 codes times a power
// of two (fb_x16_block, fewbits.kernels.act8.int16_blocks: every bf16 element within 2^-7 of its block's largest
// exact, the rest rounded to a step of 2^-14 of it), the weight's bytes sign-extended to int16 and multiplied by
// vpmaddwd, a block's products summed exactly in int32 (a lane: 4 products of <= 2^7 * 2^15), then one convert and
// FMA by the block's step: per 32 weights two extensions, two vpmaddwd and an add, where the fp32 path widens,
// converts and FMAs every 8 (20 instructions against 8): at one row that path ran out of instructions before
// the memory ran out of bytes.  256-bit on AVX2 and on AVX-512 without VNNI (AVX-512's widened fp32 path, one row
// at a time, ran 0.65-0.99x of this on an AVX-512 EPYC); with AVX512-VNNI 512-bit, four rows at a time (below).
@X16_BLOCK@
constexpr int64_t X16_MAX_ROWS = 1;

// x (K fp32, K a multiple of 32) -> int16 codes and steps; false where x holds an Inf or NaN (the fp32 path then)
inline bool quantize_x16(const float* x, int64_t K, int16_t* xq, float* xd) {
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 f[4];
    for (int i = 0; i < 4; ++i) f[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
    int32_t s;
    if (!fb_x16_block(f, xq + 32 * b, xd + b, &s)) return false;
  }
  return true;
}

inline __m256 x16_block_sum(const int16_t* xq, const float* xd, const int8_t* w, int64_t b, __m256 f) {
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * b)));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 32 * b + 16)));
  const __m256i s = _mm256_add_epi32(
      _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b))),
      _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b + 16))));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xd[b]), f);
}

#if defined(ROWS_AVX512) && defined(__AVX512VNNI__)
// With AVX512-VNNI a block of 32 columns is one register: the 32 codes widened to int16 meet x's block through one
// vpdpwssd (16 exact int32 pair sums), converted and FMAed by the block's step.  Four weight rows side by side
// (rows_x16_512<4>: x's block loaded once, four independent chains) ran 1.21-1.39x the 256-bit row-at-a-time loop on
// SmolLM2's layers in cache and 1.00-1.08x over 128 MB of copies, the LM heads 1.06-1.08x (2-core Emerald Rapids
// Xeon, benchmarks/bench_rows.py --rows 1 --ops int8 --pool 2 / 128 --baseline), the compiled int8 SmolLM2
// batch-1 step 1.03-1.07x (median of 10 alternating rounds, two runs); the rows left over, one at a time.

// RR weight rows n .. n + RR - 1 side by side (x's block loaded once, one FMA chain a row) into out[0 .. RR - 1]
template <int RR>
inline void rows_x16_512(const int16_t* xq, const float* xd, int64_t K, const int8_t* w, int64_t ld, float* out) {
  __m512 f[RR];
  for (int r = 0; r < RR; ++r) f[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512i xv = _mm512_loadu_si512(xq + 32 * b);
    const __m512 dv = _mm512_set1_ps(xd[b]);
#pragma GCC unroll 4
    for (int r = 0; r < RR; ++r) {
      const int8_t* wr = w + r * ld + 32 * b;
      _mm_prefetch(reinterpret_cast<const char*>(wr + PREFETCH_ROWS * ld), _MM_HINT_T1);
      const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr)));
      f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w16, xv)), dv, f[r]);
    }
  }
  for (int r = 0; r < RR; ++r) out[r] = _mm512_reduce_add_ps(f[r]);
}

inline float row1_x16(const int16_t* xq, const float* xd, int64_t K, const int8_t* w, int64_t ld) {
  float y;
  rows_x16_512<1>(xq, xd, K, w, ld, &y);
  return y;
}
#define ROWS_X16_4 1
#else
// one int8 weight row (K a multiple of 32) times x's int16 blocks; two FMA chains, one weight row at a time (rows
// in row1_streams' order, as row1_avx2)
inline float row1_x16(const int16_t* xq, const float* xd, int64_t K, const int8_t* w, int64_t ld) {
  __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    f0 = x16_block_sum(xq, xd, w, b, f0);
    f1 = x16_block_sum(xq, xd, w, b + 1, f1);
  }
  if (b < nb) {
    f0 = x16_block_sum(xq, xd, w, b, f0);
  }
  const __m256 f = _mm256_add_ps(f0, f1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif
#endif

@Q8_BLOCK@
// the portable int8-activation product, and the operator's reference order of operations: per row of x and
// block of 32 columns the exact integer sum, times d, summed in fp32
void rows_a8_portable(const int8_t* xq, const float* d, const int8_t* w, int64_t ld, int64_t K, int64_t M,
                      int64_t n0, int64_t n1, float* out, int64_t N) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < K / 32; ++b) {
        int32_t s = 0;
        for (int64_t k = b * 32; k < b * 32 + 32; ++k) s += int32_t(xq[m * K + k]) * int32_t(w[n * ld + k]);
        acc += float(s) * d[m * (K / 32) + b];
      }
      out[m * N + n] = acc;
    }
}

// out (M x N, fp32) = x (M x K) . w (N x K, row stride ld_bytes)^T for M <= MAXM
template <int M>
void run_rows(const void* xv, const char* w, int64_t ld_bytes, Kind kind, int64_t K, int64_t N, float* out) {
  at::parallel_for(0, (N + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * BLOCK, n1 = std::min(N, b1 * BLOCK);
#if defined(ROWS_AVX512)
    rows_avx512<M>(xv, w, ld_bytes, kind, K, n0, n1, out, N);
#elif defined(ROWS_AVX2)
    rows_avx2<M>(static_cast<const float*>(xv), w, ld_bytes, kind, K, n0, n1, out, N);
#else
    std::vector<float> buf(K);
    rows_portable<M>(static_cast<const float*>(xv), w, ld_bytes, kind, K, n0, n1, out, N, buf.data());
#endif
  });
}

using RowsFn = void (*)(const void*, const char*, int64_t, Kind, int64_t, int64_t, float*);
constexpr RowsFn ROWS[MAXM] = {run_rows<1>, run_rows<2>, run_rows<3>, run_rows<4>,
                               run_rows<5>, run_rows<6>, run_rows<7>, run_rows<8>};

@SCRATCH@

#if defined(ROWS_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define ROWS_AMX 1
// ---------------------------------------------------------------- AMX (Intel's tile matrix unit), integers
// AMX_MIN_ROWS to AMX_MAX_ROWS rows of a bf16 x on int8 codes (int8_mm) through the tiles' integer products
// (tdpbssd / tdpbsud): the codes go straight from the weight into the A tiles (16 channels x 64 columns), nothing
// converted.  Each row of x is taken as a 24-bit fixed point, x = step * v with step = 2^(e - 22) for the row's
// largest |x| in [2^e, 2^(e+1)) and |v| < 2^23 (fewbits.kernels.act8.fixed24_rows, the reference): every bf16
// element within 2^-15 of its row's largest is exact (8 significant bits), the rest round half to even to a step
// of 2^-22 of it.  v = 2^16 h + 2^8 m + l (h a signed byte, m and l unsigned) makes three planes of x, the B tiles;
// per 16 channels three integer sums (exact in int32 up to K = 2^17 columns: |code x byte| <= 2^14), combined
// exactly in fp64 and rounded once to fp32: x's fixed-point dot product with the codes, correctly rounded (the
// bf16 path it replaced, codes converted to bf16 for tdpbf16ps, summed the exact products in fp32).
// Measured, SmolLM2-135M int8 with its head, the 121 calls of a step at 8 rows, the two paths alternating in one
// process (the weights from memory): 8.93 / 9.26 ms against 9.66 / 10.68 for the bf16-tile path (1.07-1.15x); at
// 2, 4 and 16 rows 1.07, 1.07 and 1.10x.  That is memory-bound far below the one-row path (4.1-4.5 ms for the same
// bytes): with the codes always read from one hot block the same calls take 4.1-5.1 ms, so the tile unit's work
// and the memory's overlap little; prefetch variants (into L1 ahead of the tiles, two blocks ahead, whole blocks
// at once, the next block copied row by row between the tiles) were all within 0.9-1.04x.
constexpr int64_t AMX_MIN_ROWS = 2, AMX_MAX_ROWS = 16, AMX_CH = 16, X24_PLANES = 3;

bool amx_ready() { static const bool ok = at::cpu::init_amx(); return ok; }

struct TileConfig { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// tiles 0-2: C (16 channels x M int32, one per plane of x), 3: A (16 channels x 64 codes), 4-6: B (16 groups of
// four columns x M rows of x, one per plane)
inline void amx_config(int64_t M) {
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 7; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = uint16_t(t == 3 ? 64 : M * 4);
  }
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12 can drop the stores above as dead (seen out of line)
  _tile_loadconfig(&c);
}

// x (M x K bf16) -> the B tiles of its three planes (above): plane P's tile kb, row p holds for each row m of x the
// bytes of columns 64 kb + 4 p .. + 3 (zero past K); step[m] the row's step (0 for a row of zeros).  False where x
// holds an Inf or NaN (nothing to take as a fixed point).
bool pack_x24(const uint16_t* x, int64_t M, int64_t K, uint32_t* xt, double* step) {
  const int64_t nkb = (K + 63) / 64, plane = nkb * 16 * M;
  std::memset(xt, 0, size_t(X24_PLANES * plane) * 4);
  auto load = [&](int64_t m, int64_t k) {  // x[m, k .. k + 15] as fp32 (zeros past K)
    const int64_t left = K - k;
    const __mmask16 mk = left >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, x + m * K + k)), 16));
  };
  // bytes 2, 1 and 0 of 16 dwords (the planes h, m, l) into 128-bit lanes 0, 1 and 2
  alignas(64) int8_t order[64] = {};
  for (int P = 0; P < X24_PLANES; ++P)
    for (int d = 0; d < 16; ++d) order[16 * P + d] = int8_t(4 * d + 2 - P);
  const __m512i pick = _mm512_load_si512(order);
  alignas(64) float scale[4], scale2[4];  // 2^(23 - e) as two factors: over 2^127 for a row of tiny values
  for (int64_t m0 = 0; m0 < M; m0 += 4) {  // four rows at a time: their dwords in a tile row are side by side
    const int64_t mr = std::min<int64_t>(4, M - m0);
    for (int64_t i = 0; i < 4; ++i) {
      scale[i] = scale2[i] = 0.f;
      if (i >= mr) continue;
      // the largest |x| from the bf16 bits (whose magnitudes order as integers), 32 a load; >= 0x7F80: Inf or NaN
      const uint16_t* r = x + (m0 + i) * K;
      __m512i big = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 32) {
        const int64_t left = K - k;
        const __mmask32 mk = left >= 32 ? __mmask32(0xFFFFFFFFu) : static_cast<__mmask32>((1u << left) - 1);
        big = _mm512_max_epu16(big, _mm512_and_si512(_mm512_maskz_loadu_epi16(mk, r + k), _mm512_set1_epi16(0x7FFF)));
      }
      alignas(64) uint16_t lanes[32];
      _mm512_store_si512(lanes, big);
      uint16_t top = 0;
      for (int l = 0; l < 32; ++l) top = std::max(top, lanes[l]);
      if (top >= 0x7F80) return false;
      step[m0 + i] = 0.0;
      if (top == 0) continue;
      int e;
      std::frexp(float(at::BFloat16(top, at::BFloat16::from_bits())), &e);  // the largest in [2^(e-1), 2^e)
      step[m0 + i] = std::ldexp(1.0, e - 23);
      scale[i] = std::ldexp(1.f, std::min(23 - e, 100));
      scale2[i] = std::ldexp(1.f, 23 - e - std::min(23 - e, 100));
    }
    const __mmask8 rows = static_cast<__mmask8>((1u << mr) - 1);
    for (int64_t k = 0; k < K; k += 16) {
      __m512i pl[4];  // row i: its three planes' 16 bytes in lanes 0-2 (four tile rows' dwords each)
      for (int64_t i = 0; i < 4; ++i) {  // x * 2^(23 - e) is exact; vcvtps2dq rounds it half to even
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(i < mr ? load(m0 + i, k) : _mm512_setzero_ps(),
                                                     _mm512_set1_ps(scale[i])), _mm512_set1_ps(scale2[i]));
        pl[i] = _mm512_permutexvar_epi8(pick, _mm512_cvtps_epi32(v));
      }
      // the 4 x 4 dwords of each lane transposed: tile row p0 + q gets row m0 + i's dword q
      const __m512i t0 = _mm512_unpacklo_epi32(pl[0], pl[1]), t1 = _mm512_unpackhi_epi32(pl[0], pl[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(pl[2], pl[3]), t3 = _mm512_unpackhi_epi32(pl[2], pl[3]);
      const __m512i tr[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                             _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
      uint32_t* t = xt + (k / 64 * 16 + (k % 64) / 4) * M + m0;
      for (int q = 0; q < 4; ++q) {
        _mm_mask_storeu_epi32(t + q * M, rows, _mm512_castsi512_si128(tr[q]));
        _mm_mask_storeu_epi32(t + plane + q * M, rows, _mm512_extracti32x4_epi32(tr[q], 1));
        _mm_mask_storeu_epi32(t + 2 * plane + q * M, rows, _mm512_extracti32x4_epi32(tr[q], 2));
      }
    }
  }
  return true;
}

// out (M x N fp32) = x (M x K bf16, M <= AMX_MAX_ROWS) . w (N x K int8 codes, row stride ld)^T through the integer
// tiles, the next block's codes prefetched into L2 as each 64 columns go; false (nothing written) where x holds
// an Inf or NaN
bool amx_rows(const uint16_t* x, int64_t M, const int8_t* w, int64_t ld, int64_t K, int64_t N, float* out) {
  const int64_t nkb = (K + 63) / 64, plane = nkb * 16 * M;
  Scratch<uint32_t, 6> xt(X24_PLANES * plane);
  Scratch<double, 7> step(M);
  if (!pack_x24(x, M, K, xt.data(), step.data())) return false;
  const uint32_t* X = xt.data();
  at::parallel_for(0, (N + AMX_CH - 1) / AMX_CH, 1, [&](int64_t b0, int64_t b1) {
    amx_config(M);
    alignas(64) int32_t c[X24_PLANES][AMX_CH * AMX_MAX_ROWS];
    alignas(64) int8_t edge[AMX_CH * 64];
    const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int32_t(M)));  // channel r's sum at r M + m
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * AMX_CH, rows = std::min(AMX_CH, N - n);
      const int8_t* wb = w + n * ld;
      _tile_zero(0); _tile_zero(1); _tile_zero(2);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k = 64 * kb;
        if (rows == AMX_CH && k + 64 <= K) {
          for (int64_t r = 0; r < AMX_CH; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(wb + (AMX_CH + r) * ld + k), _MM_HINT_T1);
          _tile_loadd(3, wb + k, ld);
        } else {  // the last block's missing channels, or columns past K: zeros (nothing read past the weight)
          std::memset(edge, 0, sizeof(edge));
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(edge + 64 * r, wb + r * ld + k, size_t(std::min<int64_t>(64, K - k)));
          _tile_loadd(3, edge, 64);
        }
        const uint32_t* XB = X + kb * 16 * M;
        _tile_loadd(4, XB, M * 4); _tile_loadd(5, XB + plane, M * 4); _tile_loadd(6, XB + 2 * plane, M * 4);
        _tile_dpbssd(0, 3, 4); _tile_dpbsud(1, 3, 5); _tile_dpbsud(2, 3, 6);
      }
      _tile_stored(0, c[0], M * 4); _tile_stored(1, c[1], M * 4); _tile_stored(2, c[2], M * 4);
      // per row m of x its 16 channels' sums (a gather down the tiles' column m), 2^16 h + 2^8 m + l exactly in
      // int64 and fp64, times the row's step, rounded once to fp32: 16 outputs side by side (the scalar loop took
      // ~7% of an int8 SmolLM2 step at 8 rows)
      const __mmask16 rm = static_cast<__mmask16>((1u << rows) - 1);
      for (int64_t m = 0; m < M; ++m) {
        __m512i g[X24_PLANES];
        for (int P = 0; P < X24_PLANES; ++P) g[P] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rm, down, c[P] + m, 4);
        __m256 half[2];
        for (int h = 0; h < 2; ++h) {
          auto wide = [&](int P) {
            return _mm512_cvtepi32_epi64(h ? _mm512_extracti64x4_epi64(g[P], 1) : _mm512_castsi512_si256(g[P]));
          };
          const __m512i v = _mm512_add_epi64(_mm512_add_epi64(_mm512_slli_epi64(wide(0), 16), _mm512_slli_epi64(wide(1), 8)),
                                             wide(2));
          half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi64_pd(v), _mm512_set1_pd(step[m])));
        }
        _mm512_mask_storeu_ps(out + m * N + n, rm,
                              _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1));
      }
    }
    _tile_release();
  });
  return true;
}
#endif

// out (M x N fp32) for any M: passes of up to MAXM rows over the weight (int8 codes times a bf16 x through AMX:
// passes of up to AMX_MAX_ROWS); x (M x K) of xsize bytes an element
void matmul_rows(const void* x, int64_t M, int64_t K, int64_t xsize, const char* w, int64_t ld_bytes, Kind kind,
                 int64_t N, float* out) {
  const char* xp = static_cast<const char*>(x);
  const int64_t xrow = K * xsize;
#ifdef ROWS_AMX
  if (kind == I8B && M >= AMX_MIN_ROWS && amx_ready()) {
    for (int64_t m0 = 0; m0 < M; m0 += AMX_MAX_ROWS) {
      const int64_t mm = std::min(AMX_MAX_ROWS, M - m0);
      if (mm < AMX_MIN_ROWS || !amx_rows(reinterpret_cast<const uint16_t*>(xp + m0 * xrow), mm,
                                         reinterpret_cast<const int8_t*>(w), ld_bytes, K, N, out + m0 * N))
        for (int64_t s = 0; s < mm; s += MAXM)  // an Inf or NaN in x: the dpbf16 path carries it as a product would
          ROWS[std::min(MAXM, mm - s) - 1](xp + (m0 + s) * xrow, w, ld_bytes, kind, K, N, out + (m0 + s) * N);
    }
    return;
  }
#endif
  for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
    const int64_t mm = std::min(MAXM, M - m0);
    ROWS[mm - 1](xp + m0 * xrow, w, ld_bytes, kind, K, N, out + m0 * N);
  }
}

// a float tensor's values as fp32 in a plain buffer (a decode call's x, scales, corrections: no torch temporaries,
// whose allocation and dispatch cost more than these few kilobytes)
template <int SLOT>
Scratch<float, SLOT> as_float(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  Scratch<float, SLOT> v(c.numel());
  if (c.scalar_type() == at::kFloat) std::memcpy(v.data(), c.data_ptr<float>(), v.size() * 4);
  else if (c.scalar_type() == at::kBFloat16) {
    const at::BFloat16* p = c.data_ptr<at::BFloat16>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(p[i]);
  } else if (c.scalar_type() == at::kHalf) {
    const at::Half* p = c.data_ptr<at::Half>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(p[i]);
  } else {
    const at::Tensor f = c.to(at::kFloat);
    std::memcpy(v.data(), f.data_ptr<float>(), v.size() * 4);
  }
  return v;
}

// bf16 bits of f rounded to nearest even (c10::BFloat16's rounding, NaN to 0x7FC0), in integer operations a loop
// vectorises
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : r;
}

// y (M x N) in `like`'s dtype = acc * scales[n] (+ xsum[m] * corr[n]), rounded once.  Spans of a row split between
// threads, in loops the compiler vectorises (a batch-8 LM head has ~400K outputs; against the scalar loop before,
// on an AVX2 EPYC: SmolLM2's head at 8 rows 3.55 -> 3.51 ms, an 18-wide one of the same vocabulary 1.02 -> 0.93 ms).
at::Tensor finish(float* acc, int64_t M, int64_t N, const float* scales, const float* xsum,
                  const float* corr, const at::Tensor& like) {
  const at::ScalarType st = like.scalar_type();
  const bool direct = st == at::kBFloat16 || st == at::kHalf || st == at::kFloat;
  at::Tensor y = at::empty({M, N}, like.options().dtype(direct ? st : at::kFloat));
  void* out = y.data_ptr();
  at::parallel_for(0, M * N, 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {  // [i, e): a span of row m
      const int64_t m = i / N, n0 = i - m * N, e = std::min(i1, (m + 1) * N);
      float* a = acc + i;
      const int64_t len = e - i;
      if (scales) for (int64_t j = 0; j < len; ++j) a[j] *= scales[n0 + j];
      if (corr) { const float xs = xsum[m]; for (int64_t j = 0; j < len; ++j) a[j] += xs * corr[n0 + j]; }
      if (st == at::kBFloat16) {
        uint16_t* o = static_cast<uint16_t*>(out) + i;
        for (int64_t j = 0; j < len; ++j) o[j] = bf16_bits(a[j]);
      } else if (st == at::kHalf) {
        at::Half* o = static_cast<at::Half*>(out) + i;
        int64_t j = 0;
#if defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE_NOF16C)
        for (; j + 8 <= len; j += 8)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + j),
                           _mm256_cvtps_ph(_mm256_loadu_ps(a + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; j < len; ++j) o[j] = at::Half(a[j]);
      } else {
        std::memcpy(static_cast<float*>(out) + i, a, len * 4);
      }
      i = e;
    }
  });
  return direct ? y : y.to(st);
}

std::vector<float> row_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> s(M, 0.f);
  for (int64_t m = 0; m < M; ++m) for (int64_t k = 0; k < K; ++k) s[m] += x[m * K + k];
  return s;
}

void check_w(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x and w must be 2-D, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has ", x.size(1), " columns, w has ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) == 1, op, ": w's rows must be contiguous");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), op, ": CPU tensors only");
}
}  // namespace

// x (M, K), w (N, K): both bf16 or both fp16 -> (M, N) in their dtype
at::Tensor dense_mm(const at::Tensor& x, const at::Tensor& w) {
  check_w(x, w, "dense_mm");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "dense_mm: x and w must both be bf16 or both fp16, got ", x.scalar_type(), " and ", w.scalar_type());
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  const Kind kind = w.scalar_type() == at::kBFloat16 ? BF16 : F16;
  Scratch<float, 3> acc(M * N);
  if (M && N) {
    const char* W = static_cast<const char*>(w.data_ptr());
#ifdef ROWS_AVX512
    if (kind == BF16) {  // bf16 pairs straight into dpbf16
      const at::Tensor xc = x.contiguous();
      matmul_rows(xc.data_ptr(), M, K, 2, W, w.stride(0) * 2, kind, N, acc.data());
    } else {
      const auto xf = as_float<0>(x);
      matmul_rows(xf.data(), M, K, 4, W, w.stride(0) * 2, kind, N, acc.data());
    }
#else
    const auto xf = as_float<0>(x);
    matmul_rows(xf.data(), M, K, 4, W, w.stride(0) * 2, kind, N, acc.data());
#endif
  }
  return finish(acc.data(), M, N, nullptr, nullptr, nullptr, x);
}

// x (M, K) float, q (N, K) int8, scales (N,) float, corr (N,) float or None -> (x q^T) * scales [+ sum(x) corr]
// path: 0 the fastest built (one row of x in int16 blocks where in_features is a multiple of 32 on the AVX2 and
// AVX-512 builds; 2+ rows of a bf16 x through dpbf16 with AVX512-BF16, 2-16 of them through AMX's integer tiles as
// a 24-bit fixed point per row where the CPU has them), 1 x in fp32
at::Tensor int8_run(const at::Tensor& x, const char* W, int64_t ld, int64_t N, const float* scales, const float* corr,
                    int64_t path);

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& corr, int64_t path) {
  check_w(x, q, "int8_mm");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_mm: q must be int8, got ", q.scalar_type());
  const int64_t N = q.size(0);
  TORCH_CHECK(scales.numel() == N, "int8_mm: ", N, " output channels but ", scales.numel(), " scales");
  const bool has_c = corr.has_value() && corr->defined();
  TORCH_CHECK(!has_c || corr->numel() == N, "int8_mm: ", N, " output channels but ", corr->numel(), " corrections");
  const auto sc = as_float<1>(scales);
  const auto cv = has_c ? as_float<2>(*corr) : Scratch<float, 2>(0);
  return int8_run(x, static_cast<const char*>(q.data_ptr()), q.stride(0), N, sc.data(), has_c ? cv.data() : nullptr,
                  path);
}

// int8_mm over tensors that lie in one block of memory (`arena`, uint8: the decoder's placed weights), each given by
// its byte offset there: q (N, K) int8 rows, scales (N,) bf16, corr (N,) fp32 or none (corr_off < 0).  A compiled
// step then takes the one block instead of two or three tensors a linear layer, each of which its C++ wrapper turns
// into a new handle on every call.
at::Tensor int8_mm_at(const at::Tensor& x, const at::Tensor& arena, int64_t q_off, int64_t scales_off,
                      int64_t corr_off, int64_t N, int64_t path) {
  TORCH_CHECK(arena.scalar_type() == at::kByte && arena.dim() == 1 && arena.is_contiguous(),
              "int8_mm_at: the arena must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(x.dim() == 2 && N >= 0, "int8_mm_at: x must be 2-D, got ", x.sizes());
  const int64_t K = x.size(1), n = arena.numel();
  TORCH_CHECK(q_off >= 0 && q_off + N * K <= n && scales_off >= 0 && scales_off % 2 == 0 && scales_off + 2 * N <= n &&
              (corr_off < 0 || (corr_off % 4 == 0 && corr_off + 4 * N <= n)),
              "int8_mm_at: the codes, scales or corrections lie outside the arena of ", n, " bytes");
  const uint8_t* base = arena.data_ptr<uint8_t>();
  const at::BFloat16* sb = reinterpret_cast<const at::BFloat16*>(base + scales_off);
  Scratch<float, 1> sc(N);
  for (int64_t i = 0; i < N; ++i) sc[i] = float(sb[i]);
  return int8_run(x, reinterpret_cast<const char*>(base + q_off), K, N, sc.data(),
                  corr_off < 0 ? nullptr : reinterpret_cast<const float*>(base + corr_off), path);
}

// x (M, K) float times the int8 rows W (N of them, ld bytes apart), per-row scales and optional corrections
at::Tensor int8_run(const at::Tensor& x, const char* W, int64_t ld, int64_t N, const float* scales, const float* corr,
                    int64_t path) {
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "int8_mm: x must be a float tensor, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && !x.is_cuda(), "int8_mm: x must be a 2-D CPU tensor, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  const bool has_c = corr != nullptr;
#if defined(ROWS_AVX512) && defined(__AVX512BF16__)
  const bool bf16_rows = path == 0 && M >= 2 && x.scalar_type() == at::kBFloat16;  // dpbf16 or AMX on x as it is
#else
  const bool bf16_rows = false;
#endif
  // x in fp32 only where a path or the correction's row sums read it: a bf16 x of 8 rows of 1536 columns costs
  // microseconds a call to convert, ~120 calls a step
  const auto xf = has_c || !bf16_rows ? as_float<0>(x) : Scratch<float, 0>(0);
  const std::vector<float> xs = has_c ? row_sums(xf.data(), M, K) : std::vector<float>();
  Scratch<float, 3> acc(M * N);
  bool done = !(M && N);
#ifdef ROWS_X16
  if (!done && path == 0 && M <= X16_MAX_ROWS && K % 32 == 0) {
    Scratch<int16_t, 0> xq(K);
    Scratch<float, 4> xd(K / 32);
    if (quantize_x16(xf.data(), K, xq.data(), xd.data())) {
      float* out = acc.data();
      at::parallel_for(0, (N + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
        int64_t n = b0 * BLOCK;
        const int64_t n1 = std::min(N, b1 * BLOCK);
#ifdef ROWS_X16_4
        for (; n + 4 <= n1; n += 4)
          rows_x16_512<4>(xq.data(), xd.data(), K, reinterpret_cast<const int8_t*>(W) + n * ld, ld, out + n);
        for (; n < n1; ++n)
          out[n] = row1_x16(xq.data(), xd.data(), K, reinterpret_cast<const int8_t*>(W) + n * ld, ld);
#else
        row1_streams(n, n1, [&](int64_t c) {
          out[c] = row1_x16(xq.data(), xd.data(), K, reinterpret_cast<const int8_t*>(W) + c * ld, ld);
        });
#endif
      });
      done = true;
    }
  }
#endif
#if defined(ROWS_AVX512) && defined(__AVX512BF16__)
  if (!done && bf16_rows) {  // bf16 x: dpbf16 on bf16 codes, or AMX
    const at::Tensor xc = x.contiguous();
    matmul_rows(xc.data_ptr(), M, K, 2, W, ld, I8B, N, acc.data());
    done = true;
  }
#endif
  if (!done) matmul_rows(xf.data(), M, K, 4, W, ld, I8, N, acc.data());
  return finish(acc.data(), M, N, scales, has_c ? xs.data() : nullptr, corr, x);
}

// x (M, K) float, codes (N, K) uint8 FP8 codes (E4M3, or E5M2 if e5m2), scales (N,) or (1,) float -> (x w^T) * scales
at::Tensor fp8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, bool e5m2) {
  check_w(x, codes, "fp8_mm");
  TORCH_CHECK(codes.scalar_type() == at::kByte, "fp8_mm: codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "fp8_mm: x must be a float tensor, got ", x.scalar_type());
  const int64_t M = x.size(0), N = codes.size(0), K = x.size(1);
  TORCH_CHECK(scales.numel() == N || scales.numel() == 1, "fp8_mm: ", N, " output channels but ", scales.numel(),
              " scales (one per channel, or one)");
  const auto xf = as_float<0>(x);
  const auto given = as_float<1>(scales);
  Scratch<float, 5> sc(N);
  for (int64_t n = 0; n < N; ++n) sc[n] = given[given.size() == 1 ? 0 : n] * (e5m2 ? 1.f : E4M3_SCALE);
  Scratch<float, 3> acc(M * N);
  if (M && N)
    matmul_rows(xf.data(), M, K, 4, static_cast<const char*>(codes.data_ptr()), codes.stride(0), e5m2 ? E5M2 : E4M3,
                N, acc.data());
  return finish(acc.data(), M, N, sc.data(), nullptr, nullptr, x);
}

// as int8_mm, with x rounded to int8 per row and block of 32 columns (fewbits.kernels.act8) and multiplied in
// integers; in_features must be a multiple of 32
at::Tensor int8_mm_a8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& corr) {
  check_w(x, q, "int8_mm_a8");
  TORCH_CHECK(q.scalar_type() == at::kChar, "int8_mm_a8: q must be int8, got ", q.scalar_type());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "int8_mm_a8: x must be a float tensor, got ", x.scalar_type());
  const int64_t M = x.size(0), N = q.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "int8_mm_a8: in_features ", K, " is not a multiple of 32 (the activations' blocks)");
  TORCH_CHECK(scales.numel() == N, "int8_mm_a8: ", N, " output channels but ", scales.numel(), " scales");
  const bool has_c = corr.has_value() && corr->defined();
  TORCH_CHECK(!has_c || corr->numel() == N, "int8_mm_a8: ", N, " output channels but ", corr->numel(),
              " corrections");
  const auto xf = as_float<0>(x);
  const auto sc = as_float<1>(scales);
  const auto cv = has_c ? as_float<2>(*corr) : Scratch<float, 2>(0);
  const std::vector<float> xs = has_c ? row_sums(xf.data(), M, K) : std::vector<float>();
  const float* X = xf.data();
  Scratch<int8_t, 0> xq(M * K);
  Scratch<float, 4> d(M * (K / 32));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b)
      d[m * (K / 32) + b] = fb_q8_block(X + m * K + b * 32, 32, xq.data() + m * K + b * 32);
#if ROWS_A8 && defined(ROWS_AVX512)
  Scratch<uint8_t, 0> xu(M * K);  // codes + 128: vpdpbusd's unsigned operand
  for (int64_t k = 0; k < M * K; ++k) xu[k] = uint8_t(int32_t(xq[k]) + 128);
#endif
  Scratch<float, 3> acc(M * N);
  float* O = acc.data();
  const int8_t* W = static_cast<const int8_t*>(q.data_ptr());
  const int64_t ld = q.stride(0);
  if (M && N) {
    for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
      const int64_t mm = std::min(MAXM, M - m0);
      at::parallel_for(0, (N + BLOCK - 1) / BLOCK, 1, [&](int64_t b0, int64_t b1) {
        const int64_t n0 = b0 * BLOCK, n1 = std::min(N, b1 * BLOCK);
#if ROWS_A8
#ifdef ROWS_AVX512
        const uint8_t* xm = xu.data() + m0 * K;
#else
        const int8_t* xm = xq.data() + m0 * K;
#endif
        const float* dm = d.data() + m0 * (K / 32);
        float* om = O + m0 * N;
        switch (mm) {
          case 1: rows_a8<1>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 2: rows_a8<2>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 3: rows_a8<3>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 4: rows_a8<4>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 5: rows_a8<5>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 6: rows_a8<6>(xm, dm, W, ld, K, n0, n1, om, N); break;
          case 7: rows_a8<7>(xm, dm, W, ld, K, n0, n1, om, N); break;
          default: rows_a8<8>(xm, dm, W, ld, K, n0, n1, om, N); break;
        }
#else
        rows_a8_portable(xq.data() + m0 * K, d.data() + m0 * (K / 32), W, ld, K, mm, n0, n1, O + m0 * N, N);
#endif
      });
    }
  }
  return finish(acc.data(), M, N, sc.data(), has_c ? xs.data() : nullptr, has_c ? cv.data() : nullptr, x);
}

// ---------------------------------------------------------------- greedy decoding's token choice
namespace {
constexpr int64_t ARGMAX_CHUNK = 512;  // values a chunk: its maximum, then (one chunk) the first index of it

template <typename E>
inline float value_f32(const E* p, int64_t i) {
  if constexpr (std::is_same_v<E, at::BFloat16>) {
    uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return float(p[i]);
  }
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE)
template <typename E>
inline __m256 widen8_any(const E* p) {  // 8 values -> fp32
  if constexpr (std::is_same_v<E, float>) return _mm256_loadu_ps(p);
  else if constexpr (std::is_same_v<E, at::BFloat16>)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// the largest of p[0 .. n-1] as fp32, and whether one is a NaN (the maximum is then meaningless).  The compiler
// does not vectorise a max reduction and a NaN test together: 8-lane max and unordered compares by hand
// (one 49152-token bf16 row: ~6 us against ~27 with a plain loop, on an AVX2 EPYC).
template <typename E>
inline float chunk_max(const E* p, int64_t n, bool* nan) {
  float m = -std::numeric_limits<float>::infinity();
  bool any = false;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__) && !defined(FEWBITS_ROWS_PORTABLE)
  __m256 m0 = _mm256_set1_ps(m), m1 = m0, u0 = _mm256_setzero_ps(), u1 = u0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = widen8_any(p + i), b = widen8_any(p + i + 8);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    u0 = _mm256_or_ps(u0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    u1 = _mm256_or_ps(u1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (int j = 0; j < 8; ++j) m = std::max(m, lanes[j]);
  any = _mm256_movemask_ps(_mm256_or_ps(u0, u1)) != 0;
#endif
  for (; i < n; ++i) {
    const float v = value_f32(p, i);
    m = std::max(m, v);
    any = any || std::isnan(v);
  }
  *nan = any;
  return m;
}

// torch.argmax of one row of V values: the index of the first maximum, a NaN counting as larger than any number
// (the first NaN's index).  The row's maximum's first chunk (strictly larger than every earlier chunk's maximum)
// is scanned for its first index; a chunk holding a NaN is scanned for that.
template <typename E>
int64_t argmax_row(const E* row, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_c = 0;
  for (int64_t c0 = 0; c0 < V; c0 += ARGMAX_CHUNK) {
    const int64_t n = std::min(ARGMAX_CHUNK, V - c0);
    bool nan = false;
    const float m = chunk_max(row + c0, n, &nan);
    if (nan)
      for (int64_t i = 0; i < n; ++i)
        if (std::isnan(value_f32(row + c0, i))) return c0 + i;
    if (m > best) { best = m; best_c = c0; }
  }
  const int64_t n = std::min(ARGMAX_CHUNK, V - best_c);
  for (int64_t i = 0; i < n; ++i)
    if (value_f32(row + best_c, i) == best) return best_c + i;
  return best_c;  // (not reached: the chunk holds its maximum)
}
}  // namespace

// logits (B, V) in fp32, bf16 or fp16, each row's values contiguous -> (B,) int64: torch.argmax(logits, -1),
// one pass over a row and one chunk again (torch's CPU argmax measured ~1 ns a value in fp32 and ~4.5 in bf16 on
// an AVX2 EPYC: ~0.23 ms for one 49152-token row, ~0.9 ms for eight, a decode step's greedy choice; this: ~9 / ~28 us)
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_rows: logits must be (batch, vocabulary), got ", logits.sizes());
  TORCH_CHECK(!logits.is_cuda(), "argmax_rows: CPU tensors only");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: an empty vocabulary");
  TORCH_CHECK(logits.stride(1) == 1 || V == 1, "argmax_rows: each row's values must be contiguous");
  const at::ScalarType st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "argmax_rows: logits must be float32, bfloat16 or float16, got ", st);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t ld = logits.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (st == at::kFloat) o[b] = argmax_row(logits.const_data_ptr<float>() + b * ld, V);
      else if (st == at::kBFloat16) o[b] = argmax_row(logits.const_data_ptr<at::BFloat16>() + b * ld, V);
      else o[b] = argmax_row(logits.const_data_ptr<at::Half>() + b * ld, V);
    }
  });
  return out;
}

// whether int8_mm_a8 runs integer vector products here (AVX512-VNNI's vpdpbusd or AVX2's vpmaddubsw; else its plain
// loops)
int64_t a8_fast() { return ROWS_A8; }

// whether int8_mm multiplies 2+ rows of a bf16 x through AMX here: built with it, and the OS lets this process use
// its tiles
bool rows_amx() {
#ifdef ROWS_AMX
  return amx_ready();
#else
  return false;
#endif
}

// the vector path dense_mm and int8_mm run here: 2 AVX-512, 1 AVX2 + FMA, 0 the plain loops
int64_t rows_isa() {
#if defined(ROWS_AVX512)
  return 2;
#elif defined(ROWS_AVX2)
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY(ROWS_NS, m) {
  m.def("dense_mm(Tensor x, Tensor w) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor q, Tensor scales, Tensor? corr, int path=0) -> Tensor");
  m.def("int8_mm_at(Tensor x, Tensor arena, int q_off, int scales_off, int corr_off, int N, int path) -> Tensor");
  m.def("int8_mm_a8(Tensor x, Tensor q, Tensor scales, Tensor? corr) -> Tensor");
  m.def("fp8_mm(Tensor x, Tensor codes, Tensor scales, bool e5m2) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("a8_fast() -> int");
  m.def("rows_isa() -> int");
  m.def("rows_amx() -> bool");
  m.impl("dense_mm", c10::DispatchKey::CPU, &dense_mm);
  m.impl("int8_mm", c10::DispatchKey::CPU, &int8_mm);
  m.impl("int8_mm_at", c10::DispatchKey::CPU, &int8_mm_at);
  m.impl("int8_mm_a8", c10::DispatchKey::CPU, &int8_mm_a8);
  m.impl("fp8_mm", c10::DispatchKey::CPU, &fp8_mm);
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.impl("a8_fast", c10::DispatchKey::CatchAll, &a8_fast);
  m.impl("rows_isa", c10::DispatchKey::CatchAll, &rows_isa);
  m.impl("rows_amx", c10::DispatchKey::CatchAll, &rows_amx);
}
