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
#include <type_traits>
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
    if constexpr (widening) scratch.resize(kCols * K);
    float sums[kRows * kCols];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t o0 = b * kCols;
      const int64_t count = std::min<int64_t>(kCols, O - o0);
      // A short last block repeats its last row; the repeats are computed and dropped.
      const T* rows[kCols];
      for (int64_t j = 0; j < kCols; ++j) rows[j] = w + (o0 + std::min(j, count - 1)) * K;
      const float* frows[kCols];
      if constexpr (widening) {
        for (int64_t j = 0; j < count; ++j) widen_row(rows[j], scratch.data() + j * K, K);
        for (int64_t j = 0; j < kCols; ++j) frows[j] = scratch.data() + std::min(j, count - 1) * K;
      } else if constexpr (std::is_same_v<T, float>) {
        for (int64_t j = 0; j < kCols; ++j) frows[j] = rows[j];
      }
      for (int64_t r = 0; r < n; r += kRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, n - r));
        if constexpr (native) tile(tile_rows, x + r * K, K, rows, sums, stream);
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
}

TORCH_LIBRARY_IMPL(tokenswift_cpu, CPU, m) { m.impl("few_rows_linear", &few_rows_linear); }

TORCH_LIBRARY_IMPL(tokenswift_cpu, CompositeExplicitAutograd, m) { m.impl("few_rows_linear_path", &few_rows_linear_path); }
