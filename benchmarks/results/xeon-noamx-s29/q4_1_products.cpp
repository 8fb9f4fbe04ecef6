// A prototype (not part of the library): y = x W^T for x bfloat16 [n, K] and W held as the
// GGUF's Q4_1 blocks repacked for 16 outputs at a time: per 32 of K, the 16 outputs' d and
// m (float16) and 16 pairs of 16 bytes, byte i of pair p holding (low nibble) output i / 2
// and (high nibble) output 8 + i / 2 at k = 2p + i % 2. Each weight is dequantized as the
// GGUF reader does (float32 d * q, then + m, each rounded) and rounded to bfloat16, then
// multiplied by vdpbf16ps in the order the bfloat16 kernel's packed path uses, so the
// outputs equal that kernel's bit for bit (q4_1_products.py checks it).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {
constexpr int64_t kBlock = 320;  // 16 outputs x 32 of K: d[16] fp16, m[16] fp16, 16 pairs x 16 bytes

template <int R, int B>
inline void tile(const c10::BFloat16* x, int64_t K, const uint8_t* g, int64_t NB, c10::BFloat16* y, int64_t O, int64_t o0) {
  // B groups of 16 outputs (consecutive, NB * kBlock bytes apart), R rows of x
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const __m512i idx_e = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i idx_o = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  const __m512i low = _mm512_set1_epi32(0xF);
  const int64_t gstride = NB * kBlock;
  for (int64_t kb = 0; kb < NB; ++kb) {
    __m512 de[B], dodd[B], me[B], mo[B];
    const uint8_t* qs[B];
    for (int b = 0; b < B; ++b) {
      const uint8_t* blk = g + b * gstride + kb * kBlock;
      for (int l = 0; l < kBlock; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * kBlock + l), _MM_HINT_T0);
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      de[b] = _mm512_permutexvar_ps(idx_e, dv); dodd[b] = _mm512_permutexvar_ps(idx_o, dv);
      me[b] = _mm512_permutexvar_ps(idx_e, mv); mo[b] = _mm512_permutexvar_ps(idx_o, mv);
      qs[b] = blk + 64;
    }
    for (int p = 0; p < 16; ++p) {
      __m512bh w[B];
      for (int b = 0; b < B; ++b) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs[b] + 16 * p)));
        const __m512 e = _mm512_add_round_ps(
            _mm512_mul_round_ps(de[b], _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            me[b], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 o = _mm512_add_round_ps(
            _mm512_mul_round_ps(dodd[b], _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            mo[b], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        w[b] = _mm512_cvtne2ps_pbh(o, e);
      }
      const int64_t k2 = kb * 32 + 2 * p;
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + k2, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, w[b]);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t lanes = std::min<int64_t>(16, O - o0 - 16 * b);
    if (lanes <= 0) break;
    const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1);
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + r * O + o0 + 16 * b, keep, (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
  }
}

template <int B>
inline void rows_tile(int64_t rows, const c10::BFloat16* x, int64_t K, const uint8_t* g, int64_t NB, c10::BFloat16* y, int64_t O, int64_t o0) {
  switch (rows) {
    case 1: return tile<1, B>(x, K, g, NB, y, O, o0);
    case 2: return tile<2, B>(x, K, g, NB, y, O, o0);
    case 3: return tile<3, B>(x, K, g, NB, y, O, o0);
    default: return tile<4, B>(x, K, g, NB, y, O, o0);
  }
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t O) {
  const int64_t K = x.size(-1), NB = K / 32, G = (O + 15) / 16;
  const at::Tensor xc = x.reshape({-1, K}).contiguous();
  const int64_t n = xc.size(0);
  at::Tensor y = at::empty({n, O}, x.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  constexpr int64_t BG = 4;
  const int64_t units = (G + BG - 1) / BG;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g0 = u * BG, count = std::min<int64_t>(BG, G - g0);
      const uint8_t* gp = base + g0 * NB * kBlock;
      for (int64_t r = 0; r < n; r += 4) {
        const int64_t rows = std::min<int64_t>(4, n - r);
        if (count == 4) rows_tile<4>(rows, xp + r * K, K, gp, NB, yp + r * O, O, g0 * 16);
        else for (int64_t c = 0; c < count; ++c) rows_tile<1>(rows, xp + r * K, K, gp + c * NB * kBlock, NB, yp + r * O, O, (g0 + c) * 16);
      }
    }
  });
  return y;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("q4_linear", &q4_linear); }
