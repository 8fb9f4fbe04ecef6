// Linear products of a few rows for CPUs: y = x W^T (+ b) for x [n, K], n from 1 to
// ~64 (a one-token step, a token tree, the LM-head rows a verifier scores), W [O, K]
// as nn.Linear stores it, streamed from memory once for all n rows.
//
// Such products are bound by reading W. PyTorch's bfloat16 GEMM for a few rows ran at
// about a third of the memory bandwidth on a 2-core Sapphire Rapids (all 210 products
// of a SmolLM2-135M forward: ~23 ms for 1 to 16 rows, 212 MB), and the compiled
// multiply-and-sum for one row at about half. Here W is walked in blocks of kBlock
// output rows; a block (a few KB) stays in L1 while every row of x is multiplied with
// it, so memory sees W once whatever n is. Threads split the output rows.
//
// Each output y[r, o] is one dot product computed by the same instructions in the same
// order whatever n, the thread count or the row's place in x: a row's result does not
// depend on which other rows share the call, so a tree's rows equal one-token steps
// bit for bit. Accumulation is in float32; bfloat16 results are rounded once at the
// end (nearest even), as PyTorch's GEMM rounds its float32 accumulators.
//
// Paths, chosen at build time (-march=native): bfloat16 with AVX512-BF16 (vdpbf16ps:
// pairs of bfloat16 products summed into float32 lanes); bfloat16 elsewhere (each W
// block widened to float32 once, then FMA); float32 with AVX512F or AVX2+FMA; and a
// scalar loop where neither exists.
//
// Registered as torch.ops.tokenswift_cpu.few_rows_linear (tokenswift.kernels).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "amx.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using fvec = __m512;
inline fvec fzero() { return _mm512_setzero_ps(); }
inline fvec fload(const float* p) { return _mm512_loadu_ps(p); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline float fsum(fvec a) { return _mm512_reduce_add_ps(a); }
inline void widen(const c10::BFloat16* src, float* dst) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
}
constexpr int kCols = 8;  // output rows per block
constexpr int kRows = 3;  // rows of x per tile: 3 x 8 accumulators of the 32 registers
#define TOKENSWIFT_FVEC 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using fvec = __m256;
inline fvec fzero() { return _mm256_setzero_ps(); }
inline fvec fload(const float* p) { return _mm256_loadu_ps(p); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline float fsum(fvec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void widen(const c10::BFloat16* src, float* dst) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
}
constexpr int kCols = 4;
constexpr int kRows = 2;  // 2 x 4 accumulators of the 16 registers
#define TOKENSWIFT_FVEC 1
#else
constexpr int kCols = 4;
constexpr int kRows = 1;
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// A tile: R rows of x (float32, K each, consecutive) against C rows of W (float32).
// Every accumulator runs over K in the same order whatever R and C: the vector part
// over K rounded down to kLanes, summed across lanes, then the tail.
template <int R, int C>
inline void tile_f32(const float* x, int64_t K, const float* const* w, float* out /* [R][C] */) {
#ifdef TOKENSWIFT_FVEC
  const int64_t body = K - K % kLanes;
  fvec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j] = fzero();
  for (int64_t k = 0; k < body; k += kLanes) {
    fvec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = fload(x + r * K + k);
    for (int j = 0; j < C; ++j) {
      const fvec wv = fload(w[j] + k);
      for (int r = 0; r < R; ++r) acc[r][j] = fmadd(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      float s = fsum(acc[r][j]);
      for (int64_t k = body; k < K; ++k) s += x[r * K + k] * w[j][k];
      out[r * C + j] = s;
    }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[j][k];
      out[r * C + j] = s;
    }
#endif
}

#if defined(__AVX512BF16__)
// bfloat16 x and W with vdpbf16ps: 32 products per instruction, pairs summed into 16
// float32 lanes; the K % 32 tail through masked loads (zeros add nothing).
template <int R, int C, int J>
inline void tile_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* const* w, float* out /* [R][C] */) {
  // J of the block's W rows at a time, each read start to end. J = 1 reads the block
  // in memory order, one stream the hardware prefetcher follows: all C rows a cache
  // line of each at a time measured 16 GB/s on an AMD EPYC Zen 4 for 212 MB of one-row
  // products, one row at a time 30 GB/s. Calls of many x rows re-read W from L1 and
  // are bound by its loads instead, which J = C shares among the tile's rows (see
  // kStreamRows). Each (row, output) accumulator takes the same K-steps in the same
  // order whatever R and J: a row's result depends neither on the other rows nor on J.
  static_assert(C % J == 0, "J divides the block");
  const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
  for (int j0 = 0; j0 < C; j0 += J) {
    __m512 acc[R][J];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[R];
      for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int j = 0; j < J; ++j) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[j0 + j] + k);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv[r], wv);
      }
    }
    if (k < K) {
      __m512bh xv[R];
      for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + r * K + k);
      for (int j = 0; j < J; ++j) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w[j0 + j] + k);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv[r], wv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) out[r * C + j0 + j] = _mm512_reduce_add_ps(acc[r][j]);
  }
}
constexpr bool kNativeBF16 = true;
#else
constexpr bool kNativeBF16 = false;
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// bfloat16 W on AVX2 (no native bfloat16): each W row widened in registers as it is read
// (bfloat16 is float32's upper half: zero-extend, shift left 16) and multiplied with the
// R rows of x, already widened to float32. The block's C rows of W are taken one at a
// time, each read start to end (one stream, as the hardware prefetcher follows it best:
// see tile_bf16). Four accumulators per x row over K in steps of 32 (k, k+8, k+16, k+24)
// hide the FMA latency; they are summed (a0 + a1) + (a2 + a3), across lanes, then the
// K % 8 tail. A (row, output) result takes the same steps in the same order whatever R:
// a row's result does not depend on the other rows. Measured on an AMD EPYC Zen 3
// (2 cores), SmolLM2-135M's 210 bfloat16 products: see kStreamRows below.
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <int R, int C>
inline void tile_widen(const float* x, int64_t K, const c10::BFloat16* const* w, float* out /* [R][C] */) {
  const int64_t body32 = K - K % 32;
  const int64_t body8 = K - K % 8;
  for (int j = 0; j < C; ++j) {
    const c10::BFloat16* wj = w[j];
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < body32; k += 32) {
      const __m256 w0 = widen8(wj + k), w1 = widen8(wj + k + 8), w2 = widen8(wj + k + 16), w3 = widen8(wj + k + 24);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + k;
        acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, acc[r][3]);
      }
    }
    for (; k < body8; k += 8) {
      const __m256 w0 = widen8(wj + k);
      for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, acc[r][0]);
    }
    for (int r = 0; r < R; ++r) {
      float s = fsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3])));
      for (int64_t t = body8; t < K; ++t) s += x[r * K + t] * static_cast<float>(wj[t]);
      out[r * C + j] = s;
    }
  }
}
constexpr bool kWidenInRegisters = true;
constexpr int kWidenRows = 3;  // rows of x per tile: 3 x 4 accumulators and 4 widened W vectors: the 16 registers

inline void widen_tile(int rows, const float* x, int64_t K, const c10::BFloat16* const* w, float* out) {
  switch (rows) {
    case 1: return tile_widen<1, kCols>(x, K, w, out);
    case 2: return tile_widen<2, kCols>(x, K, w, out);
    case 3: return tile_widen<3, kCols>(x, K, w, out);
  }
}
#else
constexpr bool kWidenInRegisters = false;
constexpr int kWidenRows = 1;
inline void widen_tile(int, const float*, int64_t, const c10::BFloat16* const*, float*) {}
#endif

template <typename T>
void widen_row(const T* src, float* dst, int64_t K) {
  int64_t k = 0;
#ifdef TOKENSWIFT_FVEC
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; k + kLanes <= K; k += kLanes) widen(src + k, dst + k);
#endif
  for (; k < K; ++k) dst[k] = to_float(src[k]);
}

// One tile of `rows` (1..kRows) rows of x against a block of kCols rows of W.
template <int R, typename X, typename W>
inline void tile_of(const X* x, int64_t K, const W* const* w, float* out, bool stream) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, c10::BFloat16>) stream ? tile_bf16<R, kCols, 1>(x, K, w, out) : tile_bf16<R, kCols, kCols>(x, K, w, out);
  else
#endif
    tile_f32<R, kCols>(x, K, w, out);
}

template <typename X, typename W>
inline void tile(int rows, const X* x, int64_t K, const W* const* w, float* out, bool stream) {
  if constexpr (kRows >= 3) {
    if (rows == 3) return tile_of<kRows >= 3 ? 3 : 1>(x, K, w, out, stream);
  }
  if constexpr (kRows >= 2) {
    if (rows == 2) return tile_of<kRows >= 2 ? 2 : 1>(x, K, w, out, stream);
  }
  tile_of<1>(x, K, w, out, stream);
}

// Calls of up to this many x rows read each W block as one stream (tile_bf16's J = 1);
// measured on an AMD EPYC Zen 4, 210 bfloat16 products against PyTorch's: 0.28-0.38x
// for 1 row, 0.47-0.50x for 4, 0.64-0.70x for 8 (J = C: 0.36-0.47, 0.52-0.70,
// 0.59-0.75), while 16 and 32 rows were faster with J = C.
constexpr int64_t kStreamRows = 8;

template <typename T>
void run(const T* x, const T* w, const T* bias, T* y, int64_t n, int64_t K, int64_t O) {
  const bool stream = n <= kStreamRows;
  constexpr bool native = std::is_same_v<T, c10::BFloat16> && kNativeBF16;
  constexpr bool widening = !std::is_same_v<T, float> && !native;
  const int64_t blocks = (O + kCols - 1) / kCols;
  const int64_t step = widening && kWidenInRegisters ? kWidenRows : kRows;  // rows of x per tile
  // float32 copies of x for the widening path (bfloat16 without AVX512-BF16).
  std::vector<float> xf;
  if constexpr (widening) {
    xf.resize(n * K);
    for (int64_t r = 0; r < n; ++r) widen_row(x + r * K, xf.data() + r * K, K);
  }
  // Grain: ~32 KB of W per work item at least, so the fork/join costs stay small.
  const int64_t grain = std::max<int64_t>(1, 32768 / (kCols * K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;  // a W block widened to float32 (widening path)
    if constexpr (widening && !kWidenInRegisters) scratch.resize(kCols * K);
    float sums[std::max(kRows, kWidenRows) * kCols];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * kCols;
      const int64_t count = std::min<int64_t>(kCols, O - o0);
      // A short last block repeats its last row; the repeats are computed and dropped.
      const T* rows[kCols];
      for (int64_t j = 0; j < kCols; ++j) rows[j] = w + (o0 + std::min(j, count - 1)) * K;
      const float* frows[kCols];
      if constexpr (widening && !kWidenInRegisters) {
        for (int64_t j = 0; j < count; ++j) widen_row(rows[j], scratch.data() + j * K, K);
        for (int64_t j = 0; j < kCols; ++j) frows[j] = scratch.data() + std::min(j, count - 1) * K;
      } else if constexpr (std::is_same_v<T, float>) {
        for (int64_t j = 0; j < kCols; ++j) frows[j] = rows[j];
      }
      for (int64_t r = 0; r < n; r += step) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(step, n - r));
        if constexpr (native) tile(tile_rows, x + r * K, K, rows, sums, stream);
        else if constexpr (widening && kWidenInRegisters) widen_tile(tile_rows, xf.data() + r * K, K, rows, sums);
        else if constexpr (widening) tile(tile_rows, xf.data() + r * K, K, frows, sums, stream);
        else tile(tile_rows, x + r * K, K, frows, sums, stream);
        for (int i = 0; i < tile_rows; ++i)
          for (int64_t j = 0; j < count; ++j) {
            const float s = bias ? sums[i * kCols + j] + to_float(bias[o0 + j]) : sums[i * kCols + j];
            y[(r + i) * O + o0 + j] = static_cast<T>(s);
          }
      }
    }
  });
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bfloat16 with AMX tiles (Sapphire Rapids and later): y^T = W x^T, W's rows as the A
// tiles straight from memory (16 output rows x 32 of K each; no repacked copy of W),
// x's rows packed as the B tile in the pairs layout the instruction reads (16 pairs of K
// x up to 16 rows), four C tiles of 16 output rows x n float32 accumulators. Each C
// element is the sum over K-steps of the same tile products whatever n: a row's result
// does not depend on the other rows. Used where K is a multiple of 32 and O of 16.
constexpr int64_t kAmxGroup = 4;  // C tiles: 4 x 16 output rows per pass over K

void configure_tiles(int64_t cols) {
  tokenswift_amx::TileConfig config;
  for (int t = 0; t < 4; ++t) {  // tmm0-3: C, 16 output rows x cols float32
    config.rows[t] = 16;
    config.colsb[t] = static_cast<uint16_t>(cols * 4);
  }
  config.rows[4] = 16;  // tmm4: B, 16 pairs of K x cols rows of x
  config.colsb[4] = static_cast<uint16_t>(cols * 4);
  config.rows[5] = 16;  // tmm5: A, 16 output rows x 32 bfloat16 of K
  config.colsb[5] = 64;
  _tile_loadconfig(&config);
}

// C tile T += A (16 rows of W from `a`) x B (tmm4). The tile intrinsics take the tile
// numbers as literals, hence a macro.
#define TOKENSWIFT_AMX_STEP(T, a, stride) \
  do {                                   \
    _tile_loadd(5, (a), (stride));       \
    _tile_dpbf16ps(T, 5, 4);             \
  } while (0)

void run_amx(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n,
             int64_t K, int64_t O) {
  // x packed per group of 16 rows: [K / 2][rows] pairs (32 bits each).
  std::vector<uint32_t> packed((K / 2) * n);
  const int64_t groups = (n + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = g * 16, cols = std::min<int64_t>(16, n - r0);
    uint32_t* dst = packed.data() + (K / 2) * r0;
    for (int64_t p = 0; p < K / 2; ++p)
      for (int64_t r = 0; r < cols; ++r) std::memcpy(dst + p * cols + r, x + (r0 + r) * K + 2 * p, 4);
  }
  const int64_t blocks = O / 16;
  const int64_t passes = (blocks + kAmxGroup - 1) / kAmxGroup;
  const int64_t stride = K * static_cast<int64_t>(sizeof(c10::BFloat16));
  at::parallel_for(0, passes, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[kAmxGroup][16][16];
    int64_t configured = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = g * 16, cols = std::min<int64_t>(16, n - r0);
      if (cols != configured) {
        configure_tiles(cols);
        configured = cols;
      }
      const uint32_t* b = packed.data() + (K / 2) * r0;
      for (int64_t pass = begin; pass < end; ++pass) {
        const int64_t first = pass * kAmxGroup;
        const int64_t count = std::min<int64_t>(kAmxGroup, blocks - first);
        const c10::BFloat16* a = w + first * 16 * K;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, b + (k / 2) * cols, cols * 4);
          TOKENSWIFT_AMX_STEP(0, a + k, stride);
          if (count > 1) TOKENSWIFT_AMX_STEP(1, a + 16 * K + k, stride);
          if (count > 2) TOKENSWIFT_AMX_STEP(2, a + 32 * K + k, stride);
          if (count > 3) TOKENSWIFT_AMX_STEP(3, a + 48 * K + k, stride);
        }
        _tile_stored(0, out[0], 64);
        if (count > 1) _tile_stored(1, out[1], 64);
        if (count > 2) _tile_stored(2, out[2], 64);
        if (count > 3) _tile_stored(3, out[3], 64);
        for (int64_t t = 0; t < count; ++t)
          for (int64_t i = 0; i < 16; ++i) {
            const int64_t o = (first + t) * 16 + i;
            const float extra = bias ? static_cast<float>(bias[o]) : 0.0f;
            for (int64_t r = 0; r < cols; ++r)
              y[(r0 + r) * O + o] = static_cast<c10::BFloat16>(bias ? out[t][i][r] + extra : out[t][i][r]);
          }
      }
    }
    _tile_release();
  });
}

bool amx_serves(int64_t K, int64_t O) { return K % 32 == 0 && O % 16 == 0 && tokenswift_amx::permitted(); }
#else
bool amx_serves(int64_t, int64_t) { return false; }
void run_amx(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, c10::BFloat16*, int64_t, int64_t, int64_t) {}
#endif


#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TOKENSWIFT_PACKED_AVX2 1
#endif

#if defined(__AVX512BF16__) || defined(TOKENSWIFT_PACKED_AVX2)
// -- Weights packed once: the AVX512-BF16 path without AMX tiles, and AVX2 ---------------
//
// The tiles above give each (row, output) pair its own accumulator and sum its 16 lanes
// at the end: for a few rows, those sums and the re-reads of the block cost more than the
// products (210 products of 4 / 8 / 16 rows took 9.6 / 11.3 / 19.0 ms on an AMD EPYC
// Zen 4, against 8.2 for one). Here W is rearranged once, at its first product, into the
// pairs layout vdpbf16ps multiplies by a broadcast pair of x: [ceil(O / 16)][K / 2][16],
// 16 outputs' weights for k and k + 1 in one 64-byte vector. 16 outputs then accumulate
// in the lanes of one register, nothing is summed across lanes, and W is read once, in
// memory order, for every row (4 / 8 / 16 rows: 7.1 / 8.0 / 12.5 ms, one row 7.0).
//
// Each output's lane adds its K / 2 pair products in the same order whatever n, the
// tile or the thread: a row's result does not depend on the other rows. The copy lives
// as long as the weight's storage, keyed by its address and checked against the
// weight's version counter, so a weight changed in place is packed again (a change
// through .data, which bypasses the counter, is not seen: forget_packed_weights()).
// Inference tensors (no version counter) keep the path above.

struct PackedWeight {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t offset, O, K;
  uint32_t version;
  at::Tensor pairs;  // int32 [ceil(O / 16), K / 2, 16]
};

std::mutex packed_mutex;
std::unordered_map<const void*, PackedWeight> packed_weights;  // by the weight's data address

at::Tensor pack_pairs(const c10::BFloat16* w, int64_t O, int64_t K) {
  const int64_t blocks = (O + 15) / 16, P = K / 2;
  at::Tensor pairs = at::empty({blocks, P, 16}, at::TensorOptions().dtype(at::kInt));
  uint32_t* dst = reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t o = b * 16 + i;
        uint32_t* out = dst + b * P * 16 + i;
        for (int64_t p = 0; p < P; ++p) {
          uint32_t pair = 0;  // outputs past O: zeros, computed and dropped
          if (o < O) std::memcpy(&pair, w + o * K + 2 * p, 4);
          out[p * 16] = pair;
        }
      }
  });
  return pairs;
}

bool packed_serves(const at::Tensor& weight) {
  return weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.size(1) % 2 == 0 &&
         !weight.is_inference();
}

// The packed copy of `weight` (bfloat16 [O, K], contiguous, not an inference tensor),
// made at the first call and again after the weight changed.
at::Tensor packed_pairs(const at::Tensor& weight) {
  const int64_t O = weight.size(0), K = weight.size(1);
  const auto* w = weight.data_ptr<c10::BFloat16>();
  const uint32_t version = weight.unsafeGetTensorImpl()->version_counter().current_version();
  c10::StorageImpl* storage = weight.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(packed_mutex);
  auto found = packed_weights.find(w);
  if (found != packed_weights.end()) {
    const PackedWeight& entry = found->second;
    const auto alive = entry.storage.lock();
    if (alive.get() == storage && entry.offset == weight.storage_offset() && entry.O == O && entry.K == K &&
        entry.version == version)
      return entry.pairs;
    packed_weights.erase(found);
  }
  for (auto it = packed_weights.begin(); it != packed_weights.end();)  // copies of weights that are gone
    it = it->second.storage.expired() ? packed_weights.erase(it) : std::next(it);
  at::Tensor pairs = pack_pairs(w, O, K);
  packed_weights.emplace(
      w, PackedWeight{weight.storage().getWeakStorageImpl(), weight.storage_offset(), O, K, version, pairs});
  return pairs;
}

int64_t packed_weight_bytes() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  int64_t total = 0;
  for (const auto& [key, entry] : packed_weights)
    if (!entry.storage.expired()) total += entry.pairs.numel() * 4;
  return total;
}

void forget_packed_weights() {
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights.clear();
}

#if defined(__AVX512BF16__)
// Each block's stream is prefetched this many 64-byte vectors (2 KB) ahead: the hardware's
// prefetch alone left the memory idle between a tile's bursts. Measured on a 2-core Intel
// Xeon with AVX512-BF16 and no AMX (SmolLM2-135M's 210 products in a compiled forward at
// 2K positions, in turns): forwards of 1 / 2 / 4 tokens 0.89-0.93x / 0.89-0.91x /
// 0.86-0.90x the time without; 128 or more vectors ahead gained little or nothing.
constexpr int64_t kPackedPrefetch = 32;

// R rows of x (P pairs each) against B blocks of 16 outputs, written to y (row stride O)
// from output o0 on, `valid` of them (the rest of the last block is dropped), bias added.
template <int R, int B>
inline void packed_tile(const c10::BFloat16* x, int64_t K, const uint32_t* w, int64_t P, c10::BFloat16* y, int64_t O,
                        const c10::BFloat16* bias, int64_t valid) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      _mm_prefetch(reinterpret_cast<const char*>(w + (b * P + p + kPackedPrefetch) * 16), _MM_HINT_T0);
    for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * P + p) * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * K + 2 * p, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t lanes = std::min<int64_t>(16, valid - 16 * b);
    if (lanes <= 0) break;
    const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1);
    // bias widened to float32 (bfloat16 is float32's upper half), added before the one rounding
    const __m512 extra = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + 16 * b)), 16))
                              : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      // to bfloat16, rounded to nearest even (as c10::BFloat16 rounds)
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], extra));
      _mm256_mask_storeu_epi16(y + r * O + 16 * b, keep, out);
    }
  }
}

template <int B>
inline void packed_rows(int rows, const c10::BFloat16* x, int64_t K, const uint32_t* w, int64_t P, c10::BFloat16* y,
                        int64_t O, const c10::BFloat16* bias, int64_t valid) {
  switch (rows) {
    case 1: return packed_tile<1, B>(x, K, w, P, y, O, bias, valid);
    case 2: return packed_tile<2, B>(x, K, w, P, y, O, bias, valid);
    case 3: return packed_tile<3, B>(x, K, w, P, y, O, bias, valid);
    case 4: return packed_tile<4, B>(x, K, w, P, y, O, bias, valid);
    case 5: return packed_tile<5, B < 4 ? B : 2>(x, K, w, P, y, O, bias, valid);
    case 6: return packed_tile<6, B < 4 ? B : 2>(x, K, w, P, y, O, bias, valid);
    case 7: return packed_tile<7, B < 4 ? B : 2>(x, K, w, P, y, O, bias, valid);
    default: return packed_tile<8, B < 4 ? B : 2>(x, K, w, P, y, O, bias, valid);
  }
}

constexpr int64_t kPackedTileRows = 8;  // rows of x per tile: 8 x 2 accumulators, or 4 x 4

// Blocks of 16 outputs a tile of `rows` rows takes, `left` blocks left in its group: 4
// where the rows leave registers for them, else 2, then 1.
inline int64_t packed_width(int rows, int64_t left) { return rows <= 4 && left >= 4 ? 4 : left >= 2 ? 2 : 1; }
#else
// AVX2 without native bfloat16: the same pairs layout, each 32-byte half of a block's
// 64-byte vector (8 outputs' weights for k and k + 1) widened in registers: shifted left
// 16 bits it is the 8 weights of k as float32, masked to its upper halves those of k + 1.
// Each is multiplied by a broadcast float32 x[r, k] (x widened once per call) into the
// output's lane, k then k + 1: 16 outputs per two registers, nothing summed across
// lanes, W read once in memory order with the next 4 KB of each block's stream
// prefetched (the loop does enough arithmetic per byte that the hardware's prefetch
// alone leaves the memory idle between bursts). Each output's lane adds its K products
// in the same order whatever n, the tile or the thread: a row's result does not depend
// on the other rows. Measured on an AMD EPYC Zen 3 (2 cores, 2.45 GHz), SmolLM2-135M's
// 211 bfloat16 products with its LM head: see AUTO_LINEAR_PATHS in __init__.py.
constexpr int64_t kPrefetchPairs = 1024;  // 4 KB of a block's stream ahead

template <int R, int B>
inline void packed_tile(const float* x, int64_t K, const uint32_t* w, int64_t P, c10::BFloat16* y, int64_t O,
                        const c10::BFloat16* bias, int64_t valid) {
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][B][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    for (int b = 0; b < B; ++b) _mm_prefetch(reinterpret_cast<const char*>(w + (b * P + p + kPrefetchPairs) * 16), _MM_HINT_T0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * P + p) * 16 + 8 * h));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, upper));
        for (int r = 0; r < R; ++r) {
          acc[r][b][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * p), even, acc[r][b][h]);
          acc[r][b][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * K + 2 * p + 1), odd, acc[r][b][h]);
        }
      }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t lanes = std::min<int64_t>(16, valid - 16 * b);
    if (lanes <= 0) break;
    for (int r = 0; r < R; ++r) {
      float sums[16];
      _mm256_storeu_ps(sums, acc[r][b][0]);
      _mm256_storeu_ps(sums + 8, acc[r][b][1]);
      for (int64_t i = 0; i < lanes; ++i)  // bias added before the one rounding (nearest even)
        y[r * O + 16 * b + i] = static_cast<c10::BFloat16>(bias ? sums[i] + static_cast<float>(bias[16 * b + i]) : sums[i]);
    }
  }
}

template <int B>
inline void packed_rows(int rows, const float* x, int64_t K, const uint32_t* w, int64_t P, c10::BFloat16* y,
                        int64_t O, const c10::BFloat16* bias, int64_t valid) {
  switch (rows) {
    case 1: return packed_tile<1, B>(x, K, w, P, y, O, bias, valid);
    case 2: return packed_tile<2, B < 2 ? B : 2>(x, K, w, P, y, O, bias, valid);
    case 3: return packed_tile<3, B < 2 ? B : 2>(x, K, w, P, y, O, bias, valid);
    default: return packed_tile<4, 1>(x, K, w, P, y, O, bias, valid);
  }
}

constexpr int64_t kPackedTileRows = 4;  // rows of x per tile: 4 x 2 accumulators of the 16 registers

// Blocks of 16 outputs a tile of `rows` rows takes, `left` blocks left in its group: 4 for
// one row, 2 for two or three, else 1.
inline int64_t packed_width(int rows, int64_t left) { return rows == 1 && left >= 4 ? 4 : rows <= 3 && left >= 2 ? 2 : 1; }
#endif

constexpr int64_t kPackedGroup = 4;  // blocks of 16 outputs a tile takes at most

// The n rows of x (X: bfloat16 with AVX512-BF16, float32 widened once on AVX2) against the
// packed pairs: threads take equal runs of blocks (a k or v projection's 12 blocks: 6
// each; in groups of 4, one thread took two of the three groups and the other waited),
// each group of up to kPackedGroup blocks in tiles of up to kPackedTileRows rows.
template <typename X>
void packed_blocks(const X* x, const uint32_t* pairs, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n, int64_t K,
                   int64_t O) {
  const int64_t P = K / 2, blocks = (O + 15) / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += kPackedGroup) {
      const int64_t count = std::min<int64_t>(kPackedGroup, end - first);
      for (int64_t r = 0; r < n; r += kPackedTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPackedTileRows, n - r));
        int64_t b = 0;
        while (b < count) {
          const int64_t width = packed_width(rows, count - b);
          const int64_t o0 = (first + b) * 16;
          const uint32_t* w = pairs + (first + b) * P * 16;
          const c10::BFloat16* extra = bias ? bias + o0 : nullptr;
          c10::BFloat16* out = y + r * O + o0;
          if (width == 4) packed_rows<4>(rows, x + r * K, K, w, P, out, O, extra, O - o0);
          else if (width == 2) packed_rows<2>(rows, x + r * K, K, w, P, out, O, extra, O - o0);
          else packed_rows<1>(rows, x + r * K, K, w, P, out, O, extra, O - o0);
          b += width;
        }
      }
    }
  });
}

void run_packed(const c10::BFloat16* x, const uint32_t* pairs, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n,
                int64_t K, int64_t O) {
#if defined(__AVX512BF16__)
  packed_blocks(x, pairs, bias, y, n, K, O);
#else
  std::vector<float> xf(n * K);  // x widened once
  widen_row(x, xf.data(), n * K);
  packed_blocks(xf.data(), pairs, bias, y, n, K, O);
#endif
}
#else
bool packed_serves(const at::Tensor&) { return false; }
int64_t packed_weight_bytes() { return 0; }
void forget_packed_weights() {}
#endif

// Bytes the packed copy of `weight` takes once few_rows_linear has multiplied by it on
// this build (0: it is multiplied as it is) -- the dispatch below, asked in advance.
int64_t packed_size(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kBFloat16 || weight.dim() != 2) return 0;
  const int64_t O = weight.size(0), K = weight.size(1);
  if (amx_serves(K, O) || !packed_serves(weight)) return 0;
  return (O + 15) / 16 * 16 * K * static_cast<int64_t>(sizeof(c10::BFloat16));
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "few_rows_linear: CPU tensors only");
  TORCH_CHECK(weight.dim() == 2, "few_rows_linear: weight must be [out_features, in_features]");
  const int64_t K = weight.size(1);
  const int64_t O = weight.size(0);
  TORCH_CHECK(x.size(-1) == K, "few_rows_linear: x's last dimension ", x.size(-1), " is not in_features ", K);
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "few_rows_linear: x and weight must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "few_rows_linear: float32 or bfloat16 only");
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == O && bc.scalar_type() == x.scalar_type(), "few_rows_linear: bias must be [out_features], x's dtype");
  }
  const int64_t n = xc.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = O;
  at::Tensor y = at::empty({n, O}, x.options());
  if (x.scalar_type() == at::kFloat)
    run<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), bc.defined() ? bc.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), n, K, O);
  else if (amx_serves(K, O))
    run_amx(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr,
            y.data_ptr<c10::BFloat16>(), n, K, O);
#if defined(__AVX512BF16__) || defined(TOKENSWIFT_PACKED_AVX2)
  else if (packed_serves(weight))
    run_packed(xc.data_ptr<c10::BFloat16>(), reinterpret_cast<const uint32_t*>(packed_pairs(weight).data_ptr<int32_t>()),
               bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), n, K, O);
#endif
  else
    run<c10::BFloat16>(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(),
                       bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr, y.data_ptr<c10::BFloat16>(), n, K, O);
  return y.view(shape);
}

std::string few_rows_linear_path() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tokenswift_amx::permitted()) return "amx";
#endif
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(TOKENSWIFT_FVEC)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenswift_cpu, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("few_rows_linear_path() -> str");
  m.def("packed_size(Tensor weight) -> int");
  m.def("packed_weight_bytes() -> int");
  m.def("forget_packed_weights() -> ()");
}

TORCH_LIBRARY_IMPL(tokenswift_cpu, CPU, m) { m.impl("few_rows_linear", &few_rows_linear); }

TORCH_LIBRARY_IMPL(tokenswift_cpu, CompositeExplicitAutograd, m) {
  m.impl("few_rows_linear_path", &few_rows_linear_path);
  m.impl("packed_size", &packed_size);
  m.impl("packed_weight_bytes", &packed_weight_bytes);
  m.impl("forget_packed_weights", &forget_packed_weights);
}
