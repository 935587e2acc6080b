
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <type_traits>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define FB_FAST 1
#include <immintrin.h>
#else
#define FB_FAST 0
#endif
#if !FB_FAST && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FB_AVX2 1
#include <immintrin.h>
#else
#define FB_AVX2 0
#endif
#if FB_FAST && defined(__AVX512VNNI__)
#define FB_X16_512 1  // few rows of x in int16 through vpdpwssd (block_x16_512)
#else
#define FB_X16_512 0
#endif
#if FB_FAST && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FB_AMX 1
#include <ATen/cpu/Utils.h>
#else
#define FB_AMX 0
#endif

namespace {
constexpr int64_t R = 16, KC = 8, MT = 8, AMX_MT = 16;
// 64-byte chunks ahead of the one read that the one-row paths prefetch (the blocks are contiguous, so this runs
// into the next block at a block's end)
constexpr int64_t PREFETCH_CHUNKS = 32;
// and the AMX and int16 paths, also 8 kB ahead into L2: the compiled SmolLM2 int4-g64 step at batch 8 (128 tokens)
// ran 1.03-1.05x faster with it (64 to 512 chunks alike, alternating in one process); block_x16_512 at 1-2 rows
// 1.05-1.29x over 48 MB of weights, 1.03-1.16x over 128 MB, unchanged in cache (Emerald Rapids Xeon,
// bench_cpu_int4.py --rows 1,2 --kernels q4 --baseline), the compiled SmolLM2 int4-g64 step at batch 1 1.22-1.24x
// (bench_compiled.py speed --weights int4-g64 --batch 1, four processes in turn: 2.22 / 2.26 ms best against 2.74 /
// 2.85), at batch 2 unchanged (3.46-3.77 against 3.54-3.70); vdpbf16ps's one row gained nothing from it
constexpr int64_t L2_PREFETCH_CHUNKS = 128;
// rows of x from which the AMX path runs (fewer: x in int16 with AVX512-VNNI, else vdpbf16ps).  At 2 rows the AMX
// path (block_amx, decoding ahead) ran 1.0-1.16x vdpbf16ps on SmolLM2's layers and 1.08-1.4x on Gemma-3's, from
// memory on a 2-core AMX Xeon (bench_cpu_int4.py --rows 2 --spec int4-g64,int4-g32 --baseline, 3 rows ~1.0x as a
// control).  Against block_x16_512 on an Emerald Rapids Xeon (bench_cpu_int4.py --spec int4-g64[,int4-g32]
// --baseline): at 2 rows the int16 path ran 1.16-1.55x AMX with the weights in cache (--min-mb 2 --sample-mb 1),
// 0.93-1.26x from memory (--min-mb 128); at 3 rows 1.07-1.43x and 0.90-1.10x; at 4 rows 0.89-1.07x and 0.85-0.96x;
// at 8 rows 0.59-0.67x in cache
constexpr int64_t AMX_MIN_ROWS = 3;
// rows of x up to which the AVX2 path takes x in int16 (X16); from 2 rows the fp32 path's AND and convert per 8
// weights are shared by the rows and X16 gained nothing (2-3 rows 0.99-1.00x, 4 rows 0.88-0.92x; one row 1.11-1.26x).
// Later, the same EPYC: a kernel unpacking each chunk half once for 2-8 rows (one int32 chain a row, the rows'
// block sums in L1) ran 0.76-0.95x the fp32 path on SmolLM2's layers from memory (bench_cpu_int4.py --rows
// 1,2,4,8 --baseline; the unchanged one-row kernel 0.90-0.98x in that run): vpmaddwd and its add are two
// instructions per 16 products, as an FMA is one per 8
constexpr int64_t X16_MAX_ROWS = 1;
// and with AVX512-VNNI where AMX does not run (block_x16_512): on the Emerald Rapids Xeon against vdpbf16ps
// (block_fast, path 2), weights in cache, SmolLM2's q/k/v, gate/up and down: 1.46-1.98x at 2 rows, 1.60-1.92x at
// 3, 1.52-1.89x at 4, 1.59-2.27x at 8; more rows: vdpbf16ps in tiles of 8
constexpr int64_t X16_512_MAX_ROWS = 8;

struct Args {
  const uint16_t* codes;  // (NB, K/8, 32)
  const void* scales;     // (NB, G, 16) fp16 or fp32
  const void* zeros;      // like scales, or nullptr (symmetric)
  bool half;
  int64_t K, group, G, bits, N;
  const uint16_t* x;      // (M, K) bf16 bits
  const float* xsum;      // (M, G) group sums of x, or nullptr
  uint16_t* y;            // (M, N) bf16 bits
};

@SCRATCH@

// f(std::integral_constant<int, T>{}) with T = mt for 1 <= mt <= N, else N: a tile's rows as a template argument
template <int N, typename F>
inline void with_rows(int64_t mt, F&& f) {
  if constexpr (N > 1)
    if (mt < N) return with_rows<N - 1>(mt, f);
  f(std::integral_constant<int, N>{});
}

inline float bf2f(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f2bf(float f) {  // round to nearest even (NaN stays NaN)
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float table_value(const void* t, bool half, int64_t i) {
  return half ? float(static_cast<const at::Half*>(t)[i]) : static_cast<const float*>(t)[i];
}

// ---------------------------------------------------------------- portable path: plain loops, same layout
void block_portable(const Args& a, int64_t b, int64_t m0, int64_t mt) {
  float y[MT][R] = {};
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const float off = float(1 << (a.bits - 1));
  const int64_t cpg = a.group / KC;
  for (int64_t g = 0; g < a.G; ++g) {
    float acc[MT][2 * R] = {};  // lane p = 2 i + h
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const uint16_t* w = cb + c * 32;
      for (int j = 0; j < 4; ++j) {
        float v[2 * R];
        for (int p = 0; p < 2 * R; ++p) v[p] = float((w[p] >> (4 * j)) & 15) - off;
        for (int64_t m = 0; m < mt; ++m) {
          const uint16_t* xr = a.x + (m0 + m) * a.K + c * KC + 2 * j;
          const float x0 = bf2f(xr[0]), x1 = bf2f(xr[1]);
          for (int p = 0; p < 2 * R; p += 2) { acc[m][p] += v[p] * x0; acc[m][p + 1] += v[p + 1] * x1; }
        }
      }
    }
    for (int64_t i = 0; i < R; ++i) {
      const int64_t t = (b * a.G + g) * R + i;
      const float s = table_value(a.scales, a.half, t), z = a.zeros ? table_value(a.zeros, a.half, t) : 0.f;
      for (int64_t m = 0; m < mt; ++m) {
        float sum = acc[m][2 * i] + acc[m][2 * i + 1];
        if (a.zeros) sum -= z * a.xsum[(m0 + m) * a.G + g];
        y[m][i] += sum * s;
      }
    }
  }
  for (int64_t m = 0; m < mt; ++m)
    for (int64_t i = 0; i < R; ++i) a.y[(m0 + m) * a.N + b * R + i] = f2bf(y[m][i]);
}

// block b's rows, dequantised to bf16 and transposed: wt[k * ldw + col0 + i] = bf16(s * (c - o))
void dequant_portable(const Args& a, int64_t b, uint16_t* wt, int64_t ldw, int64_t col0) {
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const float off = float(1 << (a.bits - 1));
  const int64_t cpg = a.group / KC;
  for (int64_t g = 0; g < a.G; ++g) {
    float s[R], z[R];
    for (int64_t i = 0; i < R; ++i) {
      s[i] = table_value(a.scales, a.half, (b * a.G + g) * R + i);
      z[i] = a.zeros ? table_value(a.zeros, a.half, (b * a.G + g) * R + i) : 0.f;
    }
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c)
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h) {
          uint16_t* dst = wt + (c * KC + 2 * j + h) * ldw + col0;
          for (int64_t i = 0; i < R; ++i)
            dst[i] = f2bf(((float((cb[c * 32 + 2 * i + h] >> (4 * j)) & 15) - off) - z[i]) * s[i]);
        }
  }
}

#if FB_AVX2
// ---------------------------------------------------------------- AVX2 + FMA path (no AVX-512): same layout
// A chunk's 32-bit lane i holds row i's 8 codes: nibble t = j + 4 h (bits 4t .. 4t + 3) is column 2 j + h.
// Masking nibble t in place (t < 7) and converting gives code * 16^t, exactly; x's column is pre-scaled by
// 16^-t (`scaled_x`), so each product is code * x exactly as an fp32 product.  Nibble 7 is shifted down
// instead (its mask would reach the sign bit).  The codes are not centred: a group's sum over code * x less
// (2^(bits-1) + zero) * sum(x over the group) is the centred sum (fp32).
inline int nibble_col(int t) { return 2 * (t % 4) + t / 4; }

// x (M, K) bf16 -> fp32 with column 8 c + nibble_col(t) times 16^-t (t < 7; nibble 7's column unscaled)
void scaled_x(const uint16_t* x, int64_t M, int64_t K, float* xs) {
  float f[KC];
  for (int t = 0; t < KC; ++t) f[nibble_col(t)] = t == 7 ? 1.f : std::ldexp(1.f, -4 * t);
  for (int64_t i = 0; i < M * K; ++i) xs[i] = bf2f(x[i]) * f[i % KC];
}

inline __m256 load8(const void* t, bool half, int64_t i) {
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const at::Half*>(t) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(t) + i);
}

// rows m0 .. m0 + T - 1 of x (xs: scaled_x's, xsum: (M, G) group sums) times block b's 16 output rows.  H: the
// chunk halves (8 output rows each) multiplied in one pass, sharing x's broadcasts; NA: accumulators per row and
// half (independent FMA chains where few rows would leave the FMA latency exposed).
template <int T, int H, int NA>
void block_avx2(const Args& a, int64_t b, int64_t m0, const float* xs, const float* xsum) {
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t cpg = a.group / KC;
  const float off = float(1 << (a.bits - 1));
  float y[T][R] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t ti = (b * a.G + g) * R;
    for (int h0 = 0; h0 < 2; h0 += H) {  // output rows 8 h .. 8 h + 7: the chunk's h-th 32 bytes
      __m256 acc[T][H][NA];
      for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) for (int n = 0; n < NA; ++n) acc[t][h][n] = _mm256_setzero_ps();
      for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
        if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(cb + (c + PREFETCH_CHUNKS) * 32), _MM_HINT_T0);
        __m256i d[H];
        for (int h = 0; h < H; ++h) d[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + c * 32 + (h0 + h) * 16));
        const float* xc = xs + m0 * a.K + c * KC;
#pragma GCC unroll 8
        for (int n = 0; n < KC; ++n) {
          __m256 v[H];
          for (int h = 0; h < H; ++h)
            v[h] = _mm256_cvtepi32_ps(n == 7 ? _mm256_srli_epi32(d[h], 28)
                                             : _mm256_and_si256(d[h], _mm256_set1_epi32(15 << (4 * n))));
          const int col = nibble_col(n);
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            const __m256 xb = _mm256_broadcast_ss(xc + t * a.K + col);
            for (int h = 0; h < H; ++h) acc[t][h][n % NA] = _mm256_fmadd_ps(v[h], xb, acc[t][h][n % NA]);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const int64_t r0 = 8 * (h0 + h);
        const __m256 s = load8(a.scales, a.half, ti + r0);
        const __m256 o = a.zeros ? _mm256_add_ps(_mm256_set1_ps(off), load8(a.zeros, a.half, ti + r0))
                                 : _mm256_set1_ps(off);
        for (int t = 0; t < T; ++t) {
          __m256 sum = acc[t][h][0];
          for (int n = 1; n < NA; ++n) sum = _mm256_add_ps(sum, acc[t][h][n]);
          sum = _mm256_fnmadd_ps(o, _mm256_set1_ps(xsum[(m0 + t) * a.G + g]), sum);
          _mm256_storeu_ps(y[t] + r0, _mm256_fmadd_ps(sum, s, _mm256_loadu_ps(y[t] + r0)));
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < R; ++i) a.y[(m0 + t) * a.N + b * R + i] = f2bf(y[t][i]);
}

void block_avx2_rows(const Args& a, int64_t b, int64_t m0, int64_t mt, const float* xs, const float* xsum) {
  switch (mt) {
    case 1: block_avx2<1, 2, 4>(a, b, m0, xs, xsum); break;
    case 2: block_avx2<2, 2, 2>(a, b, m0, xs, xsum); break;
    case 3: block_avx2<3, 2, 1>(a, b, m0, xs, xsum); break;
    case 4: block_avx2<4, 2, 1>(a, b, m0, xs, xsum); break;
    default:  // two tiles over the same block (the second decodes it again from L1)
      block_avx2<4, 2, 1>(a, b, m0, xs, xsum);
      block_avx2_rows(a, b, m0 + 4, mt - 4, xs, xsum);
      break;
  }
}
#endif

#if FB_FAST
inline __m512 load16(const void* t, bool half, int64_t i) {
  if (half) {
    const at::Half* h = static_cast<const at::Half*>(t) + i;
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  }
  return _mm512_loadu_ps(static_cast<const float*>(t) + i);
}

// y[t] += s * (f[t] - o * sums[(m0 + t) * G + g]) for group g of block b, rows m0 .. m0 + T - 1: f the sums of the
// uncentred codes times x, sums x's group sums, o = off (2^(bits-1)) + the zero offsets where the codes have them
template <int T>
inline void add_group(const Args& a, int64_t b, int64_t g, float off, const float* sums, int64_t m0, const __m512* f,
                      __m512* y) {
  const int64_t ti = (b * a.G + g) * R;
  const __m512 s = load16(a.scales, a.half, ti);
  const __m512 o = a.zeros ? _mm512_add_ps(load16(a.zeros, a.half, ti), _mm512_set1_ps(off)) : _mm512_set1_ps(off);
  for (int t = 0; t < T; ++t)
    y[t] = _mm512_fmadd_ps(_mm512_fnmadd_ps(o, _mm512_set1_ps(sums[(m0 + t) * a.G + g]), f[t]), s, y[t]);
}

// rows m0 .. m0 + T - 1 of block b's 16 outputs, rounded to bf16
template <int T>
inline void store_rows(const Args& a, int64_t b, int64_t m0, const __m512* y) {
  for (int t = 0; t < T; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + (m0 + t) * a.N + b * R), (__m256i)_mm512_cvtneps_pbh(y[t]));
}

inline __m512i code_table(int64_t bits) {  // bf16 of (c - 2^(bits-1)) for c = 0..15, twice
  alignas(64) uint16_t t[32];
  for (int c = 0; c < 32; ++c) t[c] = f2bf(float(c & 15) - float(1 << (bits - 1)));
  return _mm512_load_si512(t);
}

inline __m512i bcast_pair(const uint16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

template <int T>
void block_fast(const Args& a, int64_t b, int64_t m0, __m512i tab) {
  constexpr int NA = T == 1 ? 4 : (T == 2 ? 2 : 1);  // accumulators per row: independent dpbf16 chains
  __m512 y[T];
  for (int t = 0; t < T; ++t) y[t] = _mm512_setzero_ps();
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t cpg = a.group / KC;
  const uint16_t* xr[T];
  for (int t = 0; t < T; ++t) xr[t] = a.x + (m0 + t) * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 acc[T][NA];
    for (int t = 0; t < T; ++t)
      for (int n = 0; n < NA; ++n) acc[t][n] = _mm512_setzero_ps();
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(cb + (c + PREFETCH_CHUNKS) * 32), _MM_HINT_T0);
      const __m512i wd = _mm512_loadu_si512(cb + c * 32);
      __m512i w[4];
      w[0] = _mm512_permutexvar_epi16(wd, tab);
      w[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4), tab);
      w[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 8), tab);
      w[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 12), tab);
      const int64_t k = c * KC;
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < 4; ++j)
          acc[t][j % NA] = _mm512_dpbf16_ps(acc[t][j % NA], (__m512bh)w[j], (__m512bh)bcast_pair(xr[t] + k + 2 * j));
    }
    const int64_t ti = (b * a.G + g) * R;
    const __m512 s = load16(a.scales, a.half, ti);
    for (int t = 0; t < T; ++t) {
      __m512 sum = acc[t][0];
      for (int n = 1; n < NA; ++n) sum = _mm512_add_ps(sum, acc[t][n]);
      if (a.zeros)
        sum = _mm512_fnmadd_ps(load16(a.zeros, a.half, ti), _mm512_set1_ps(a.xsum[(m0 + t) * a.G + g]), sum);
      y[t] = _mm512_fmadd_ps(sum, s, y[t]);
    }
  }
  store_rows<T>(a, b, m0, y);
}

void block_fast_rows(const Args& a, int64_t b, int64_t m0, int64_t mt, __m512i tab) {
  with_rows<8>(mt, [&](auto T) { block_fast<T.value>(a, b, m0, tab); });
}

#if FB_AMX
struct TileConfig { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

bool amx_ready() { static const bool ok = at::cpu::init_amx(); return ok; }

// tiles 0-3: C (mt x 16 fp32: four sums, one per block of 32 columns of a chunk), 4-5: A (mt rows of x x 32
// bf16), 6-7: B (16 pairs of columns x 16 output rows)
void tile_config(int64_t mt) {
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) { c.rows[t] = uint8_t(t >= 6 ? 16 : mt); c.colsb[t] = 64; }
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12 dropped the stores above as dead where this was not inlined
  _tile_loadconfig(&c);
}

constexpr int64_t AMX_CK = 4;  // blocks of 32 columns a chunk: 4 B tiles, 4 kB decoded

// columns k0 .. k1 - 1 of block b's codes (cb) decoded to bf16 B tiles: per 32 columns one tile of 16 pairs, pair
// row 4 q + j holding columns 2 j, 2 j + 1 of code chunk q for each of the 16 output rows (the word order the
// chunk's nibbles j already have); the codes 2 kB ahead are prefetched (decoding ahead without it measured
// 0.83-1.08x the path before, which decoded each 32 columns just before their product; with it 1.06-1.54x at 3-8
// rows from memory)
inline void decode_chunk(const uint16_t* cb, int64_t k0, int64_t k1, __m512i tab, uint16_t* B) {
  for (int64_t c = k0 / KC; c < k1 / KC; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(cb + (c + PREFETCH_CHUNKS) * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + (c + L2_PREFETCH_CHUNKS) * 32), _MM_HINT_T1);
    const __m512i wd = _mm512_loadu_si512(cb + c * 32);
    uint16_t* d = B + (c - k0 / KC) * 128;
    _mm512_store_si512(d + 0, _mm512_permutexvar_epi16(wd, tab));
    _mm512_store_si512(d + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4), tab));
    _mm512_store_si512(d + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 8), tab));
    _mm512_store_si512(d + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 12), tab));
  }
}

// one 32-column block's product into C tile c (0-3), through A / B tiles 4 / 6 (ab 0) or 5 / 7 (ab 1): the tile
// intrinsics take their tile numbers as literals (macros), so the switches
#define FB_TILE_MUL(C, A, B) { _tile_loadd(B, bt, 64); _tile_loadd(A, xk, ldx); _tile_dpbf16ps(C, A, B); break; }
inline void tile_mul_at(int64_t c, int64_t ab, const uint16_t* bt, const uint16_t* xk, int64_t ldx) {
  switch (c * 2 + ab) {
    case 0: FB_TILE_MUL(0, 4, 6)
    case 1: FB_TILE_MUL(0, 5, 7)
    case 2: FB_TILE_MUL(1, 4, 6)
    case 3: FB_TILE_MUL(1, 5, 7)
    case 4: FB_TILE_MUL(2, 4, 6)
    case 5: FB_TILE_MUL(2, 5, 7)
    case 6: FB_TILE_MUL(3, 4, 6)
    default: FB_TILE_MUL(3, 5, 7)
  }
}
#undef FB_TILE_MUL
inline void tile_zero_at(int64_t c) {
  switch (c) { case 0: _tile_zero(0); break; case 1: _tile_zero(1); break; case 2: _tile_zero(2); break;
               default: _tile_zero(3); }
}
inline void tile_store_at(int64_t c, float* dst) {
  switch (c) { case 0: _tile_stored(0, dst, 64); break; case 1: _tile_stored(1, dst, 64); break;
               case 2: _tile_stored(2, dst, 64); break; default: _tile_stored(3, dst, 64); }
}

// as block_fast, for mt <= 16 rows of x through AMX: x's columns are the A tiles, the decoded codes the B tiles.
// Group g's blocks of 32 columns add up in C tile g % 4; the tile is stored (cbuf, two slots) only once the next
// group's products are issued, and its sums are scaled like block_fast's only once the group after that is, so
// neither the store waits on its tile's last product nor the loads on the store.  The codes are decoded a chunk of
// 4 x 32 columns ahead (into the other half of bbuf) while the tiles multiply the chunk before.  group % 32 == 0.
// bbuf: 2 x 4 x 512 words, cbuf: 2 x 256 floats.  The version before stored each chunk's four C tiles (one per 32
// columns) as soon as their products were issued: on an Emerald Rapids Xeon, 2 threads (bench_cpu_int4.py --rows
// 3,8,16 --spec int4-g64,int4-g32 --kernels q4 --baseline) this one ran 1.22-1.38x it on SmolLM2's gate/up and down
// with the weights in cache (its q/k/v and o 0.94-1.07x) and 1.03-1.34x from memory (--min-mb 128, SmolLM2 and
// Gemma-3 shapes).  Tried there, not kept: decoding two chunks ahead (0.96-1.01x), codes as 128 + c by one
// vpternlogd instead of vpermw (0.83-0.97x with x's group sums for every call), AMX at 2 rows (0.54-0.99x the
// int16 path in cache).
void block_amx(const Args& a, int64_t b, int64_t m0, int64_t mt, __m512i tab, uint16_t* bbuf, float* cbuf) {
  __m512 yacc[AMX_MT];
  for (int64_t t = 0; t < mt; ++t) yacc[t] = _mm512_setzero_ps();
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const uint16_t* xb = a.x + m0 * a.K;
  const int64_t ldx = a.K * 2, nb = a.K / 32, spg = a.group / 32, nch = (nb + AMX_CK - 1) / AMX_CK;
  const auto scale = [&](int64_t g) {  // group g's sums, stored in slot g % 2 of cbuf, into yacc
    const float* c = cbuf + (g & 1) * AMX_MT * R;
    const int64_t ti = (b * a.G + g) * R;
    const __m512 s = load16(a.scales, a.half, ti);
    if (a.zeros) {
      const __m512 z = load16(a.zeros, a.half, ti);
      for (int64_t t = 0; t < mt; ++t)
        yacc[t] = _mm512_fmadd_ps(
            _mm512_fnmadd_ps(z, _mm512_set1_ps(a.xsum[(m0 + t) * a.G + g]), _mm512_load_ps(c + t * R)), s, yacc[t]);
    } else {
      for (int64_t t = 0; t < mt; ++t) yacc[t] = _mm512_fmadd_ps(_mm512_load_ps(c + t * R), s, yacc[t]);
    }
  };
  decode_chunk(cb, 0, std::min(a.K, AMX_CK * 32), tab, bbuf);
  int64_t stored = -1, done = -1;  // the group whose sums wait in cbuf, the one whose tile waits to be stored
  for (int64_t j = 0; j < nch; ++j) {
    const uint16_t* B = bbuf + (j & 1) * AMX_CK * 512;
    const int64_t s0 = j * AMX_CK, ns = std::min(AMX_CK, nb - s0);
    for (int64_t u = 0; u < ns; ++u) {
      const int64_t s = s0 + u, g = s / spg;
      if (s % spg == 0) tile_zero_at(g & 3);
      tile_mul_at(g & 3, s & 1, B + u * 512, xb + s * 32, ldx);
      if ((s + 1) % spg != 0) continue;
      if (stored >= 0) scale(stored);
      if (done >= 0) tile_store_at(done & 3, cbuf + (done & 1) * AMX_MT * R);
      stored = done;
      done = g;
    }
    if (j + 1 < nch)
      decode_chunk(cb, (s0 + AMX_CK) * 32, std::min(a.K, (s0 + 2 * AMX_CK) * 32), tab,
                   bbuf + ((j + 1) & 1) * AMX_CK * 512);
  }
  if (stored >= 0) scale(stored);
  tile_store_at(done & 3, cbuf + (done & 1) * AMX_MT * R);
  scale(done);
  for (int64_t t = 0; t < mt; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y + (m0 + t) * a.N + b * R),
                        (__m256i)_mm512_cvtneps_pbh(yacc[t]));
}
#endif

inline __m512 bf16_lo(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

void dequant_fast(const Args& a, int64_t b, uint16_t* wt, int64_t ldw, int64_t col0, __m512i tab) {
  alignas(64) uint16_t sp[32];
  for (int p = 0; p < 32; ++p) sp[p] = uint16_t(p < 16 ? 2 * p : 2 * (p - 16) + 1);  // even words, then odd
  const __m512i split = _mm512_load_si512(sp);
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t cpg = a.group / KC;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t ti = (b * a.G + g) * R;
    const __m512 s = load16(a.scales, a.half, ti);
    const __m512 z = a.zeros ? load16(a.zeros, a.half, ti) : _mm512_setzero_ps();
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const __m512i wd = _mm512_permutexvar_epi16(split, _mm512_loadu_si512(cb + c * 32));
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_permutexvar_epi16(_mm512_srli_epi16(wd, 4 * j), tab);
        const __m512 lo = _mm512_mul_ps(_mm512_sub_ps(bf16_lo(_mm512_castsi512_si256(v)), z), s);
        const __m512 hi = _mm512_mul_ps(_mm512_sub_ps(bf16_lo(_mm512_extracti64x4_epi64(v, 1)), z), s);
        uint16_t* dst = wt + (c * KC + 2 * j) * ldw + col0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ldw), (__m256i)_mm512_cvtneps_pbh(hi));
      }
    }
  }
}
#endif

#if (FB_FAST && defined(__AVX512VNNI__)) || FB_AVX2
#define FB_A8 1
// int8 activations (path 3): x quantised per row and block of 32 columns (fewbits.kernels.act8), stored per
// 8-column chunk in the order the nibbles come out of a chunk's 32-bit lanes (columns 0 4 1 5, then 2 6 3 7):
// a lane's low nibbles meet the chunk's first 4 activations, its high nibbles the next 4.
struct A8 {
  const int8_t* xq;   // (M, K) permuted per chunk
  const float* xs;    // (M, K/32) block scales
  const float* qsum;  // (M, G) sum over the group's blocks of xs * sum(xq): the zero term's sum of x
};

@Q8_BLOCK@
void quantize_x(const uint16_t* x, int64_t M, int64_t K, int64_t group, int8_t* xq, float* xs, float* qsum) {
  const int64_t nb = K / 32, G = K / group;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) qsum[m * G + g] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      float v[32];
      for (int k = 0; k < 32; ++k) v[k] = bf2f(x[m * K + b * 32 + k]);
      alignas(32) int8_t q[32];
      const float d = fb_q8_block(v, 32, q);  // fewbits.kernels.act8
      int32_t sum = 0;
      int8_t* dst = xq + m * K + b * 32;
#if defined(__AVX2__)
      const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q));
      // the sum of the codes: q + 128 as unsigned bytes summed by vpsadbw, less 32 * 128; each 8 codes reordered
      const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(qv, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
      const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
      sum = int32_t(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
      const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                             0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_shuffle_epi8(qv, order));
#else
      for (int k = 0; k < 32; ++k) sum += q[k];
      static const int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 8; ++i) dst[c * 8 + i] = q[c * 8 + order[i]];
#endif
      xs[m * nb + b] = d;
      qsum[m * G + (b * 32) / group] += d * float(sum);
    }
  }
}
#else
#define FB_A8 0
#endif

#if FB_A8 && FB_AVX2
// int8 activations on AVX2 (no vpdpbusd): the codes (unsigned, <= 15) times 4 broadcast activations (|q| <= 127)
// by vpmaddubsw, pairs summed into int16 lanes (<= 2 * 15 * 127); a lane's low and high nibbles and the 4 chunks
// of a 32-column block added in int16 (<= 16 * 15 * 127 = 30480: no wrap, exact), then vpmaddwd by ones to one
// int32 per output row, converted and scaled by the block's d in fp32.  H: chunk halves (8 output rows each) per
// pass, sharing the broadcasts of x.
template <int T, int H>
void block_a8_avx2(const Args& a, const A8& q, int64_t b, int64_t m0) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t nb = a.K / 32, bpg = a.group / 32;
  const float off = float(1 << (a.bits - 1));
  const int8_t* xr[T];
  for (int t = 0; t < T; ++t) xr[t] = q.xq + (m0 + t) * a.K;
  float y[T][R] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t ti = (b * a.G + g) * R;
#pragma GCC unroll 2
    for (int h0 = 0; h0 < 2; h0 += H) {
      __m256 f[T][H];
      for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) f[t][h] = _mm256_setzero_ps();
      for (int64_t xb = g * bpg; xb < (g + 1) * bpg; ++xb) {
        __m256i acc[T][H];
        for (int t = 0; t < T; ++t) for (int h = 0; h < H; ++h) acc[t][h] = _mm256_setzero_si256();
        const uint16_t* cx = cb + xb * 4 * 32;
        if (h0 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(cx + PREFETCH_CHUNKS * 32), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(cx + (PREFETCH_CHUNKS + 1) * 32), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(cx + (PREFETCH_CHUNKS + 2) * 32), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(cx + (PREFETCH_CHUNKS + 3) * 32), _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int cc = 0; cc < 4; ++cc) {
          __m256i lo[H], hi[H];
          for (int h = 0; h < H; ++h) {
            const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cx + cc * 32 + (h0 + h) * 16));
            lo[h] = _mm256_and_si256(d, low4);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(d, 4), low4);
          }
          const int64_t col = xb * 32 + cc * KC;
#pragma GCC unroll 4
          for (int t = 0; t < T; ++t) {
            int32_t x0, x1;
            std::memcpy(&x0, xr[t] + col, 4);
            std::memcpy(&x1, xr[t] + col + 4, 4);
            const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
            for (int h = 0; h < H; ++h) {
              acc[t][h] = _mm256_add_epi16(acc[t][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], b0),
                                                                       _mm256_maddubs_epi16(hi[h], b1)));
              // keeps the sum a chain in one register: GCC otherwise reassociates the integer adds of the
              // unrolled chunks into a tree whose partial products spill to the stack (1.04-1.08x at 2-8 rows)
              asm volatile("" : "+x"(acc[t][h]));
            }
          }
        }
        for (int t = 0; t < T; ++t) {
          const __m256 dv = _mm256_set1_ps(q.xs[(m0 + t) * nb + xb]);
          for (int h = 0; h < H; ++h)
            f[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[t][h], ones)), dv, f[t][h]);
        }
      }
      for (int h = 0; h < H; ++h) {  // s * (sum c xq xs - o * sum xq xs)
        const int64_t r0 = 8 * (h0 + h);
        const __m256 s = load8(a.scales, a.half, ti + r0);
        const __m256 o = a.zeros ? _mm256_add_ps(_mm256_set1_ps(off), load8(a.zeros, a.half, ti + r0))
                                 : _mm256_set1_ps(off);
        for (int t = 0; t < T; ++t) {
          const __m256 sum = _mm256_fnmadd_ps(o, _mm256_set1_ps(q.qsum[(m0 + t) * a.G + g]), f[t][h]);
          _mm256_storeu_ps(y[t] + r0, _mm256_fmadd_ps(sum, s, _mm256_loadu_ps(y[t] + r0)));
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < R; ++i) a.y[(m0 + t) * a.N + b * R + i] = f2bf(y[t][i]);
}

void block_a8_rows(const Args& a, const A8& q, int64_t b, int64_t m0, int64_t mt) {
  switch (mt) {
    case 1: block_a8_avx2<1, 2>(a, q, b, m0); break;
    case 2: block_a8_avx2<2, 2>(a, q, b, m0); break;
    case 3: block_a8_avx2<3, 1>(a, q, b, m0); break;
    // 4 rows in one pass over each chunk half (12 registers, no spills): 1.15-1.23x two passes of <2, 2>
    default: block_a8_avx2<4, 1>(a, q, b, m0); break;
  }
}
#endif

#if FB_A8 && FB_FAST
template <int T>
void block_a8(const Args& a, const A8& q, int64_t b, int64_t m0) {
  constexpr int NA = T == 1 ? 2 : 1;  // int32 accumulators per row (lo and hi nibbles apart at one row)
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t nb = a.K / 32, bpg = a.group / 32;
  const float off = float(1 << (a.bits - 1));
  __m512 y[T];
  for (int t = 0; t < T; ++t) y[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 f[T];
    for (int t = 0; t < T; ++t) f[t] = _mm512_setzero_ps();
    for (int64_t xb = g * bpg; xb < (g + 1) * bpg; ++xb) {
      __m512i acc[T][NA];
      for (int t = 0; t < T; ++t)
        for (int n = 0; n < NA; ++n) acc[t][n] = _mm512_setzero_si512();
      for (int64_t c = xb * 4; c < xb * 4 + 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(cb + (c + PREFETCH_CHUNKS) * 32), _MM_HINT_T0);
        const __m512i wd = _mm512_loadu_si512(cb + c * 32);
        const __m512i lo = _mm512_and_si512(wd, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(wd, 4), low4);
        for (int t = 0; t < T; ++t) {
          const int8_t* xp = q.xq + (m0 + t) * a.K + c * KC;
          int32_t x0, x1;
          std::memcpy(&x0, xp, 4);
          std::memcpy(&x1, xp + 4, 4);
          acc[t][0] = _mm512_dpbusd_epi32(acc[t][0], lo, _mm512_set1_epi32(x0));
          acc[t][NA - 1] = _mm512_dpbusd_epi32(acc[t][NA - 1], hi, _mm512_set1_epi32(x1));
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512i s32 = NA == 2 ? _mm512_add_epi32(acc[t][0], acc[t][NA - 1]) : acc[t][0];
        f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32), _mm512_set1_ps(q.xs[(m0 + t) * nb + xb]), f[t]);
      }
    }
    add_group<T>(a, b, g, off, q.qsum, m0, f, y);  // s * (sum c xq xs - o * sum xq xs)
  }
  store_rows<T>(a, b, m0, y);
}

void block_a8_rows(const Args& a, const A8& q, int64_t b, int64_t m0, int64_t mt) {
  with_rows<4>(mt, [&](auto T) { block_a8<T.value>(a, q, b, m0); });
}
#endif

#if FB_AVX2 || FB_X16_512
// ---------------------------------------------------------------- x in int16 (path 0 at one row, group % 32 == 0)
// x per row and block of 32 columns as int16 times a power of two (fb_x16_block, fewbits.kernels.act8: exact for
// every bf16 element within 2^-7 of the block's largest, the rest rounded to a step of 2^-14 of it).  The codes
// then meet x through vpmaddwd: a lane's two 16-bit words hold columns 2 j and 2 j + 1
// of its row in nibble j, so (lane >> 4 j) & 0x000F000F are the int16 pair that multiplies the broadcast pair
// (q_2j, q_2j+1), summed exactly in int32 (a block: <= 32 * 15 * 2^15); one convert and FMA by d per block.
// On AVX2 (vpmaddwd), per 128 weights of a row: 36 instructions against the fp32 path's 58 (AND, convert, FMA
// per 8); fewer with nibbles 0 and 3 unshifted (d & 0x000F000F, and d >> 12 per 16-bit word, which needs no mask)
// and nibbles 1 and 2 from one shift by 4 (nibble 2 masked in place, so 16 times its code, summed in an int32
// chain of its own, shifted right by 4 per block: exact, a multiple of 16 below 2^26): 5 shifts and masks per
// half chunk instead of 7, bit for bit the same sums, 1.02-1.07x the one-row operator on the AVX2 EPYC in cache
// and from memory (SmolLM2's and Gemma-3's int4-g64 layers, builds side by side in one process).  With
// AVX512-VNNI (vpdpwssd) the same pairs meet x 16 output rows at a time (block_x16_512).  One row only
// (X16_MAX_ROWS).
@X16_BLOCK@
struct X16 {
  const int16_t* q;    // (M, K)
  const float* d;      // (M, K/32) block steps
  const float* gsum;   // (M, G): sum over the group's blocks of d * sum(q): the zero term's sum of x
};

// false (nothing usable written) where a block holds an Inf or NaN: the caller takes the fp32 path, which
// carries them into the output as a plain product does
bool quantize_x16(const uint16_t* x, int64_t M, int64_t K, int64_t group, int16_t* xq, float* xd, float* gsum) {
  const int64_t nb = K / 32, G = K / group;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) gsum[m * G + g] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint16_t* v = x + m * K + b * 32;
      __m256 f[4];
      for (int i = 0; i < 4; ++i)
        f[i] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 8 * i))), 16));
      int32_t s;
      if (!fb_x16_block(f, xq + m * K + b * 32, xd + m * nb + b, &s)) return false;
      gsum[m * G + (b * 32) / group] += xd[m * nb + b] * float(s);
    }
  }
  return true;
}

#if FB_AVX2
// one row m of x (int16, X16) times block b's 16 output rows; both chunk halves share x's broadcasts
void block_x16(const Args& a, const X16& q, int64_t b, int64_t m) {
  const __m256i low4 = _mm256_set1_epi32(0x000F000F), mid4 = _mm256_set1_epi32(0x00F000F0);
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t nb = a.K / 32, bpg = a.group / 32;
  const float off = float(1 << (a.bits - 1));
  const int16_t* xr = q.q + m * a.K;
  float y[R] = {};
  for (int64_t g = 0; g < a.G; ++g) {
    __m256 f[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t xb = g * bpg; xb < (g + 1) * bpg; ++xb) {
      __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      __m256i a16[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      const uint16_t* cx = cb + xb * 4 * 32;
      for (int p = 0; p < 4; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(cx + (PREFETCH_CHUNKS + p) * 32), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int cc = 0; cc < 4; ++cc) {
        const int16_t* xc = xr + xb * 32 + cc * KC;
        __m256i xv[4];
        for (int j = 0; j < 4; ++j) {
          int32_t pair;
          std::memcpy(&pair, xc + 2 * j, 4);
          xv[j] = _mm256_set1_epi32(pair);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cx + cc * 32 + 16 * h));
          const __m256i t = _mm256_srli_epi16(d, 4);
          acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_and_si256(d, low4), xv[0]));
          acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_and_si256(t, low4), xv[1]));
          a16[h] = _mm256_add_epi32(a16[h], _mm256_madd_epi16(_mm256_and_si256(t, mid4), xv[2]));
          acc[h] = _mm256_add_epi32(acc[h], _mm256_madd_epi16(_mm256_srli_epi16(d, 12), xv[3]));
        }
        // the sums a chain in a register each (GCC otherwise reassociates the unrolled adds into a tree whose
        // partial sums spill to the stack: 1.04-1.26x with the chains, bench_cpu_int4.py --rows 1 --kernels q4
        // --baseline, AVX2 EPYC).  Tried beside it there and not kept: vpmaddubsw on x's low and high bytes (half
        // the multiplies, the same exact sums) 0.89-1.10x; the blocks in 2 runs far apart (as rows.cpp's
        // row1_streams) 0.95-1.16x, in 4 runs 0.85-1.05x; prefetching 64 chunks ahead, or 128 into L2,
        // 0.98-1.15x (scratch A/B of builds in one process, the same host); after the unpacking above, prefetching
        // 96 chunks ahead 1.02-1.09x, 1.01-1.08x and 1.00-1.01x in three runs (192: 0.98-1.03x), not kept: the
        // distance is shared with the AVX-512 paths, tuned on other hosts.  Later, the same host and A/B: nibbles 1
        // and 2 masked in place from the loaded word (16x and 256x their codes, a chain each, shifted back per
        // block: 4 shifts and masks per half chunk instead of 5) 0.96-1.03x; each thread's first 32 chunks
        // prefetched at its range's start 0.99-1.01x; the blocks handed out from an atomic counter instead of
        // one range a thread, the whole batch-1 step 0.87-0.99x (chunks of NB / 16 to NB / 4 blocks)
        asm volatile("" : "+x"(acc[0]), "+x"(acc[1]), "+x"(a16[0]), "+x"(a16[1]));
      }
      const __m256 dv = _mm256_set1_ps(q.d[m * nb + xb]);
      for (int h = 0; h < 2; ++h)
        f[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(acc[h], _mm256_srai_epi32(a16[h], 4))), dv, f[h]);
    }
    const int64_t ti = (b * a.G + g) * R;
    for (int h = 0; h < 2; ++h) {  // s * (sum c x - (2^(bits-1) + zero) * sum x)
      const __m256 s = load8(a.scales, a.half, ti + 8 * h);
      const __m256 o = a.zeros ? _mm256_add_ps(_mm256_set1_ps(off), load8(a.zeros, a.half, ti + 8 * h))
                               : _mm256_set1_ps(off);
      const __m256 sum = _mm256_fnmadd_ps(o, _mm256_set1_ps(q.gsum[m * a.G + g]), f[h]);
      _mm256_storeu_ps(y + 8 * h, _mm256_fmadd_ps(sum, s, _mm256_loadu_ps(y + 8 * h)));
    }
  }
  for (int i = 0; i < R; ++i) a.y[m * a.N + b * R + i] = f2bf(y[i]);
}
#endif

#if FB_X16_512
// one row m of x (int16, X16) times block b's 16 output rows, one chunk a register.  Nibble j of a lane's two
// words is masked in place (lane & (0x000F000F << 4 j): the codes times 16^j; nibble 3, which would reach the
// words' sign bits, shifted down by 12 instead) and meets the broadcast pair (q_2j, q_2j+1) through vpdpwssd, in
// eight int32 chains (nibble j of even and odd chunks: four would leave vpdpwssd's latency exposed).  Per block
// of 32 columns a chain pair holds 4 products of pairs, <= 4 * 2 * (15 * 16^2) * 2^15 < 2^30 for nibble 2: exact;
// nibble j's sum is then shifted right by 4 j (exact: a multiple of 16^j), the four added, converted and scaled
// by the block's d.  Against block_fast (vdpbf16ps, which issues at about half vpdpwssd's rate on the AVX-512
// Xeon measured, and a table lookup per 32 codes): 1.2-1.7x at one row with the weights in cache, 1.29x the
// compiled SmolLM2 int4-g64 step (benchmarks/bench_x16_step.py); with the weights streamed from memory the same.
template <int T>
void block_x16_512(const Args& a, const X16& q, int64_t b, int64_t m0) {
  constexpr int NA = T == 1 ? 8 : 4;  // chains per row: at one row nibble j of even and odd chunks apart
  const __m512i low4 = _mm512_set1_epi32(0x000F000F);
  const uint16_t* cb = a.codes + b * (a.K / KC) * 32;
  const int64_t nb = a.K / 32, bpg = a.group / 32;
  const float off = float(1 << (a.bits - 1));
  const int16_t* xr[T];
  for (int t = 0; t < T; ++t) xr[t] = q.q + (m0 + t) * a.K;
  __m512 y[T];
  for (int t = 0; t < T; ++t) y[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    __m512 f[T];
    for (int t = 0; t < T; ++t) f[t] = _mm512_setzero_ps();
    for (int64_t xb = g * bpg; xb < (g + 1) * bpg; ++xb) {
      __m512i acc[T][NA];
      for (int t = 0; t < T; ++t)
        for (int n = 0; n < NA; ++n) acc[t][n] = _mm512_setzero_si512();
      const uint16_t* cx = cb + xb * 4 * 32;
      for (int p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(cx + (PREFETCH_CHUNKS + p) * 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(cx + (L2_PREFETCH_CHUNKS + p) * 32), _MM_HINT_T1);
      }
#pragma GCC unroll 4
      for (int cc = 0; cc < 4; ++cc) {
        const __m512i wd = _mm512_loadu_si512(cx + cc * 32);
        const int64_t col = xb * 32 + cc * KC;
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m512i w = j == 3 ? _mm512_srli_epi16(wd, 12) : _mm512_and_si512(wd, _mm512_slli_epi32(low4, 4 * j));
          const int n = NA == 8 ? 4 * (cc & 1) + j : j;
#pragma GCC unroll 8
          for (int t = 0; t < T; ++t) {
            int32_t pair;
            std::memcpy(&pair, xr[t] + col + 2 * j, 4);
            acc[t][n] = _mm512_dpwssd_epi32(acc[t][n], w, _mm512_set1_epi32(pair));
          }
        }
      }
      for (int t = 0; t < T; ++t) {
        __m512i s[4];
        for (int j = 0; j < 4; ++j) s[j] = NA == 8 ? _mm512_add_epi32(acc[t][j], acc[t][NA - 4 + j]) : acc[t][j];
        const __m512i s4 = _mm512_add_epi32(_mm512_add_epi32(s[0], _mm512_srai_epi32(s[1], 4)),
                                            _mm512_add_epi32(_mm512_srai_epi32(s[2], 8), s[3]));
        f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s4), _mm512_set1_ps(q.d[(m0 + t) * nb + xb]), f[t]);
      }
    }
    add_group<T>(a, b, g, off, q.gsum, m0, f, y);
  }
  store_rows<T>(a, b, m0, y);
}

void block_x16_512_rows(const Args& a, const X16& q, int64_t b, int64_t m0, int64_t mt) {
  with_rows<4>(mt, [&](auto T) { block_x16_512<T.value>(a, q, b, m0); });
}
#endif
#endif

Args make_args(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
               int64_t bits) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == 32 && codes.scalar_type() == at::kShort && codes.is_contiguous(),
              "q4: codes must be a contiguous int16 tensor (blocks, in_features/8, 32)");
  TORCH_CHECK(bits >= 1 && bits <= 4, "q4: bits must be 1..4, got ", bits);
  const int64_t NB = codes.size(0), K = codes.size(1) * KC;
  TORCH_CHECK(group > 0 && group % KC == 0 && K % group == 0, "q4: group ", group,
              " must be a multiple of 8 that divides in_features ", K);
  const int64_t G = K / group;
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == NB && scales.size(1) == G && scales.size(2) == R &&
              scales.is_contiguous() && (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat),
              "q4: scales must be contiguous fp16/fp32 (blocks, groups, 16)");
  const bool has_z = zeros.numel() > 0;
  TORCH_CHECK(!has_z || (zeros.sizes() == scales.sizes() && zeros.scalar_type() == scales.scalar_type() &&
                         zeros.is_contiguous()), "q4: zeros must be empty or shaped and typed like scales");
  Args a{};
  a.codes = reinterpret_cast<const uint16_t*>(codes.data_ptr<int16_t>());
  a.scales = scales.data_ptr();
  a.zeros = has_z ? zeros.data_ptr() : nullptr;
  a.half = scales.scalar_type() == at::kHalf;
  a.K = K; a.group = group; a.G = G; a.bits = bits; a.N = NB * R;
  return a;
}
}  // namespace

// 0: portable loops only, 1: the AVX512-BF16 path, 2: and the AMX one (usable in this process); +4: the
// int8-activation path is built (AVX512-VNNI, or AVX2's vpmaddubsw); 8: the AVX2 + FMA path (no AVX-512); +16:
// one row of x in int16 through vpdpwssd (AVX512-VNNI)
int64_t q4_isa() {
  int64_t isa = FB_FAST;
#if FB_AMX
  if (amx_ready()) isa = 2;
#endif
  return isa + 4 * FB_A8 + 8 * FB_AVX2 + 16 * FB_X16_512;
}

// (M, K) bf16 x packed (NB*16, K) weight -> (M, NB*16) bf16.  path: 0 the fastest built (AMX from
// AMX_MIN_ROWS rows on where the group is a multiple of 32; fewer rows of x in int16, X16, where the group is a
// multiple of 32: one on AVX2, with AVX512-VNNI up to AMX_MIN_ROWS - 1 or, without AMX, X16_512_MAX_ROWS), 1 the
// plain loops, 2 vdpbf16ps only, 3 x in int8 (blocks of 32 columns) through vpdpbusd (AVX2: vpmaddubsw) at every
// row count where the group is a multiple of 32 (else path 0), 4 as 0 but x exact at few rows too (AVX2: the fp32
// path; AVX-512: vdpbf16ps), 5 as 0 without AMX (what a CPU without it runs; tests).
at::Tensor q4_run(const at::Tensor& x_in, Args a, int64_t path);

at::Tensor q4_mm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                 int64_t group, int64_t bits, int64_t path) {
  return q4_run(x_in, make_args(codes, scales, zeros, group, bits), path);
}

// q4_mm over tensors that lie in one block of memory (`arena`, uint8: the decoder's placed weights), each given by
// its byte offset there: codes (N/16, K/8, 32) int16, scales (N/16, K/group, 16) fp16 (half) or fp32, zeros like
// the scales or none (zeros_off < 0).  A compiled step then takes the one block instead of two or three tensors a
// linear layer, each of which its C++ wrapper turns into a new handle on every call.
at::Tensor q4_mm_at(const at::Tensor& x_in, const at::Tensor& arena, int64_t codes_off, int64_t scales_off,
                    int64_t zeros_off, int64_t N, int64_t K, int64_t group, int64_t bits, int64_t half, int64_t path) {
  TORCH_CHECK(arena.scalar_type() == at::kByte && arena.dim() == 1 && arena.is_contiguous(),
              "q4_mm_at: the arena must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(bits >= 1 && bits <= 4, "q4: bits must be 1..4, got ", bits);
  TORCH_CHECK(N > 0 && N % R == 0 && K > 0 && K % KC == 0 && group > 0 && group % KC == 0 && K % group == 0,
              "q4_mm_at: N ", N, " must be a multiple of ", R, ", K ", K, " of 8 and of the group ", group);
  const int64_t NB = N / R, G = K / group, esz = half ? 2 : 4, n = arena.numel();
  const int64_t cbytes = NB * (K / KC) * 32 * 2, sbytes = NB * G * R * esz;
  TORCH_CHECK(codes_off >= 0 && codes_off % 2 == 0 && codes_off + cbytes <= n && scales_off >= 0 &&
              scales_off % esz == 0 && scales_off + sbytes <= n &&
              (zeros_off < 0 || (zeros_off % esz == 0 && zeros_off + sbytes <= n)),
              "q4_mm_at: the codes, scales or zeros lie outside the arena of ", n, " bytes");
  const uint8_t* base = arena.data_ptr<uint8_t>();
  Args a{};
  a.codes = reinterpret_cast<const uint16_t*>(base + codes_off);
  a.scales = base + scales_off;
  a.zeros = zeros_off < 0 ? nullptr : base + zeros_off;
  a.half = half != 0;
  a.K = K; a.group = group; a.G = G; a.bits = bits; a.N = N;
  return q4_run(x_in, a, path);
}

at::Tensor q4_run(const at::Tensor& x_in, Args a, int64_t path) {
  const int64_t portable = path == 1;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == a.K && x_in.scalar_type() == at::kBFloat16,
              "q4_mm: x must be bf16 (M, ", a.K, "), got ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), NB = a.N / R;
  auto y = at::empty({M, a.N}, x.options());
  if (M == 0 || a.N == 0) return y;
  const bool fast = FB_FAST && !portable;
  const bool a8 = FB_A8 && !portable && path == 3 && a.group % 32 == 0;
  bool avx2 = FB_AVX2 && !portable && !a8;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if FB_AMX
  const bool amx_here = fast && path == 0 && a.group % 32 == 0 && amx_ready();  // path 5: as 0 without AMX
#else
  const bool amx_here = false;
#endif
#if FB_AVX2 || FB_X16_512
  // path 0: x in int16 (X16) where the group is a multiple of 32, up to X16_MAX_ROWS rows on AVX2, with AVX512-VNNI
  // below AMX_MIN_ROWS where AMX runs, else up to X16_512_MAX_ROWS; path 4: x exact (on AVX2 the fp32 path, with
  // AVX-512 vdpbf16ps)
  const int64_t x16_rows = avx2 ? X16_MAX_ROWS : (amx_here ? AMX_MIN_ROWS - 1 : X16_512_MAX_ROWS);
  bool x16 = (avx2 || (fast && FB_X16_512)) && (path == 0 || path == 5) && M <= x16_rows && a.group % 32 == 0;
  Scratch<int16_t, 0> x16q(x16 ? M * a.K : 0);
  Scratch<float, 1> x16d(x16 ? M * (a.K / 32) : 0);
  Scratch<float, 2> x16s(x16 ? M * a.G : 0);
  if (x16) x16 = quantize_x16(a.x, M, a.K, a.group, x16q.data(), x16d.data(), x16s.data());
  const X16 xq16{x16q.data(), x16d.data(), x16s.data()};
  if (x16) avx2 = false;
#else
  const bool x16 = false;
#endif
  const bool sums = (a.zeros || avx2) && !a8 && !x16;
  Scratch<float, 3> xs(sums ? M * a.G : 0);
  if (sums) {  // the group sums of x, for the zero term (and the AVX2 path's uncentred codes)
    const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < a.G; ++g) {
        float s = 0.f;
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) s += bf2f(X[m * a.K + k]);
        xs[m * a.G + g] = s;
      }
    a.xsum = xs.data();
  }
  const bool amx = amx_here && M >= AMX_MIN_ROWS && !x16;
#if FB_A8
  Scratch<int8_t, 4> xq(a8 ? M * a.K : 0);
  Scratch<float, 5> xsb(a8 ? M * (a.K / 32) : 0);
  Scratch<float, 6> qsum(a8 ? M * a.G : 0);
  A8 q{};
  if (a8) {
    quantize_x(a.x, M, a.K, a.group, xq.data(), xsb.data(), qsum.data());
    q = A8{xq.data(), xsb.data(), qsum.data()};
  }
#endif
  (void)amx;
  (void)avx2;
#if FB_AVX2
  Scratch<float, 7> x32(avx2 ? M * a.K : 0);
  if (avx2) {
    scaled_x(a.x, M, a.K, x32.data());
  }
#endif
  (void)x16;
  at::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
#if FB_FAST
    const __m512i tab = code_table(a.bits);
#endif
#if FB_AVX2 || FB_X16_512
    if (x16) {
      for (int64_t b = lo; b < hi; ++b)
#if FB_X16_512
        for (int64_t m0 = 0; m0 < M; m0 += 4) block_x16_512_rows(a, xq16, b, m0, std::min<int64_t>(4, M - m0));
#else
        for (int64_t m = 0; m < M; ++m) block_x16(a, xq16, b, m);
#endif
      return;
    }
#endif
#if FB_AMX
    if (amx) {
      alignas(64) uint16_t bbuf[2 * AMX_CK * 512];
      alignas(64) float cbuf[2 * AMX_MT * R];
      int64_t configured = -1;
      for (int64_t b = lo; b < hi; ++b)
        for (int64_t m0 = 0; m0 < M; m0 += AMX_MT) {
          const int64_t mt = std::min(AMX_MT, M - m0);
          if (mt != configured) { tile_config(mt); configured = mt; }
          block_amx(a, b, m0, mt, tab, bbuf, cbuf);
        }
      _tile_release();
      return;
    }
#endif
#if FB_A8
    if (a8) {
      for (int64_t b = lo; b < hi; ++b)
        for (int64_t m0 = 0; m0 < M; m0 += 4) block_a8_rows(a, q, b, m0, std::min<int64_t>(4, M - m0));
      return;
    }
#endif
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = std::min(MT, M - m0);
#if FB_FAST
        if (fast) { block_fast_rows(a, b, m0, mt, tab); continue; }
#endif
#if FB_AVX2
        if (avx2) { block_avx2_rows(a, b, m0, mt, x32.data(), a.xsum); continue; }
#endif
        block_portable(a, b, m0, mt);
      }
  });
  return y;
}

// the packed weight as a dense bf16 (NB*16, K) matrix, decoded as q4_mm decodes it (tests and debugging)
at::Tensor q4_dequant(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                      int64_t bits, int64_t portable) {
  Args a = make_args(codes, scales, zeros, group, bits);
  const int64_t NB = codes.size(0);
  auto wt = at::empty({a.K, a.N}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* W = reinterpret_cast<uint16_t*>(wt.data_ptr<at::BFloat16>());
  const bool fast = FB_FAST && !portable;
  at::parallel_for(0, NB, 1, [&](int64_t lo, int64_t hi) {
#if FB_FAST
    const __m512i tab = code_table(a.bits);
#endif
    for (int64_t b = lo; b < hi; ++b) {
#if FB_FAST
      if (fast) { dequant_fast(a, b, W, a.N, b * R, tab); continue; }
#endif
      dequant_portable(a, b, W, a.N, b * R);
    }
  });
  return wt.t().contiguous();
}

TORCH_LIBRARY(fewbits_q4, m) {
  m.def("q4_mm(Tensor x, Tensor codes, Tensor scales, Tensor zeros, int group, int bits, int path) -> "
        "Tensor");
  m.def("q4_mm_at(Tensor x, Tensor arena, int codes_off, int scales_off, int zeros_off, int N, int K, int group, "
        "int bits, int half, int path) -> Tensor");
  m.def("q4_dequant(Tensor codes, Tensor scales, Tensor zeros, int group, int bits, int portable) -> Tensor");
  m.def("q4_isa() -> int");
  m.impl("q4_mm", c10::DispatchKey::CPU, &q4_mm);
  m.impl("q4_mm_at", c10::DispatchKey::CPU, &q4_mm_at);
  m.impl("q4_dequant", c10::DispatchKey::CPU, &q4_dequant);
  m.impl("q4_isa", c10::DispatchKey::CatchAll, &q4_isa);
}
