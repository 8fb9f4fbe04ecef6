// Decode attention for CPUs: the new tokens of one forward (1 to ~64, each KV head's
// query heads folded in) over a layer's committed KV, in one pass over the KV.
//
// The keys [0, prefix) are seen by every row; the last n keys (the new tokens' own)
// under the tree mask. The KV range is split into chunks across threads (at::parallel_for),
// each chunk giving per row a partial (max, sum, output) with the softmax accumulated in
// float32 (float64 for float64 inputs); the partials are merged by log-sum-exp. Inner
// loops are written so that the compiler vectorises them for the CPU it builds on
// (-march=native: AVX2+FMA, AVX512, AVX512-BF16 conversions); with AMX, the products of
// bfloat16 chunks of 3+ rows run on tiles (logits_amx, values_amx); with AVX512-BF16 but
// no AMX, those of 9+ rows by pairs of bfloat16 products (logits_pairs, accumulate_pairs);
// on AVX2 without AVX512, blocks of keys and values converted once for all rows
// (chunk_avx2).
//
// Built at first use by tokenswift.kernels (torch.utils.cpp_extension), registered as
// torch.ops.tokenswift_cpu.decode_attention.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "amx.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 in float32: 2^(x log2 e) split into an integer power (exponent
// bits) and a Cephes polynomial for 2^f on [-0.5, 0.5]; ~2 ulp, and branch-free so
// that loops over it vectorise. Below -87 it returns 2^-126-ish (~0 after the sum).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t + 0.5f);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(fi) * (1 << 23);
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

inline double exp_nonpositive(double x) { return std::exp(x); }



// -- SIMD helpers (float32 accumulation) ------------------------------------------
#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline float vhmax(vec a) { return _mm512_reduce_max_ps(a); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec p, vec fi) {  // p * 2^fi, fi integral: added to the exponent bits
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(fi), 23)));
}
#define TOKENSWIFT_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vhmax(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline vec vpow2i(vec p, vec fi) {
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(fi), 23)));
}
#define TOKENSWIFT_SIMD 1
#endif

#ifdef TOKENSWIFT_SIMD
// exp_nonpositive, kWidth lanes at a time: the same steps and polynomial. A scalar loop
// over it did not vectorise (floor and the bit cast), and the exponentials were a
// third of a 64K-position decode step (measured on a 2-core Sapphire Rapids).
inline vec vexp_nonpositive(vec x) {
  x = vmax(x, vset(-87.0f));
  const vec t = vmul(x, vset(1.44269504088896341f));
  const vec fi = vfloor(vadd(t, vset(0.5f)));
  const vec f = vsub(t, fi);
  vec p = vset(1.535336188319500e-4f);
  p = vfma(p, f, vset(1.339887440266574e-3f));
  p = vfma(p, f, vset(9.618437357674640e-3f));
  p = vfma(p, f, vset(5.550332471162809e-2f));
  p = vfma(p, f, vset(2.402264791363012e-1f));
  p = vfma(p, f, vset(6.931472028550421e-1f));
  p = vfma(p, f, vset(1.0f));
  return vpow2i(p, fi);
}

// s[j] = exp(s[j] - m) for j < len; returns their sum.
inline float exp_shifted(float* s, int64_t len, float m) {
  const vec mv = vset(m);
  vec total = vzero();
  int64_t j = 0;
  for (; j + kWidth <= len; j += kWidth) {
    const vec e = vexp_nonpositive(vsub(vload(s + j), mv));
    vstore(s + j, e);
    total = vadd(total, e);
  }
  float sum = vsum(total);
  for (; j < len; ++j) {
    s[j] = exp_nonpositive(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// The row's max over len logits, kWidth at a time. The scalar loop it replaces did not
// vectorise (a float max reduction needs -ffast-math): ~4% of a one-token attention
// over 8K keys on a 2-core Zen 3 (AVX2). Exact, like any max.
inline float row_max(const float* s, int64_t len) {
  int64_t j = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (len >= kWidth) {
    vec mv = vload(s);
    for (j = kWidth; j + kWidth <= len; j += kWidth) mv = vmax(mv, vload(s + j));
    m = vhmax(mv);
  }
  for (; j < len; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// Each of R rows of len logits replaced by exp(logit - the row's max); its max and the
// sum of its exponentials into max_out / sum_out; its D outputs zeroed.
inline void exponentiate_rows(float* logits, int64_t R, int64_t len, int64_t D, float* max_out, float* sum_out,
                              float* out) {
  for (int64_t r = 0; r < R; ++r) {
    float* s = logits + r * len;
    const float m = row_max(s, len);
    max_out[r] = m;
    sum_out[r] = exp_shifted(s, len, m);
    std::fill(out + r * D, out + (r + 1) * D, 0.0f);
  }
}

// count rows of src (D values each, `stride` apart) widened to float32 into dst (D
// apart), each row's successor `ahead` rows on prefetched into L2.
template <typename scalar_t, int64_t D>
inline void widen_rows(const scalar_t* src, int64_t stride, int64_t count, int64_t ahead, float* dst) {
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* row = src + j * stride;
    const char* next = reinterpret_cast<const char*>(row + ahead * stride);
    for (int64_t b = 0; b < static_cast<int64_t>(D * sizeof(scalar_t)); b += 64) _mm_prefetch(next + b, _MM_HINT_T1);
    for (int64_t t = 0; t < D; t += kWidth) vstore(dst + j * D + t, vload(row + t));
  }
}
#endif

template <typename scalar_t>
struct Simd : std::false_type {};
#ifdef TOKENSWIFT_SIMD
template <>
struct Simd<float> : std::true_type {};
template <>
struct Simd<c10::BFloat16> : std::true_type {};
constexpr int64_t kMaxVectors = 256 / kWidth;  // head dims up to 256

// The hot loops of an unmasked chunk, float32 accumulation, D a multiple of kWidth.
template <typename scalar_t>
void chunk_simd(const float* q, int64_t R, int64_t D, const scalar_t* k, const scalar_t* v, int64_t stride,
                int64_t start, int64_t len, float* max_out, float* sum_out, float* out, float* logits) {
  const int64_t nv = D / kWidth;
  vec kv[kMaxVectors];
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t* kj = k + (start + j) * stride;
    for (int64_t t = 0; t < nv; ++t) kv[t] = vload(kj + t * kWidth);
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      vec a = vzero(), b = vzero();
      int64_t t = 0;
      for (; t + 1 < nv; t += 2) {
        a = vfma(vload(qr + t * kWidth), kv[t], a);
        b = vfma(vload(qr + (t + 1) * kWidth), kv[t + 1], b);
      }
      if (t < nv) a = vfma(vload(qr + t * kWidth), kv[t], a);
      logits[r * len + j] = vsum(vadd(a, b));
    }
  }
  exponentiate_rows(logits, R, len, D, max_out, sum_out, out);
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t* vj = v + (start + j) * stride;
    for (int64_t t = 0; t < nv; ++t) kv[t] = vload(vj + t * kWidth);
    for (int64_t r = 0; r < R; ++r) {
      const vec p = vset(logits[r * len + j]);
      float* o = out + r * D;
      for (int64_t t = 0; t < nv; ++t) vstore(o + t * kWidth, vfma(p, kv[t], vload(o + t * kWidth)));
    }
  }
}
#endif

// One chunk of keys [start, start + len) of one KV head, for all R rows.
// q: [R, D] (pre-scaled, acc_t); k, v: row j at base + j * stride (D contiguous).
// mask: nullptr (all visible) or [n, n] bool for the tree block (row r uses r % n,
// key j uses j - start).
template <typename scalar_t, typename acc_t>
void chunk(const acc_t* q, int64_t R, int64_t D, const scalar_t* k, const scalar_t* v, int64_t stride,
           int64_t start, int64_t len, const bool* mask, int64_t n, acc_t* max_out, acc_t* sum_out, acc_t* out,
           std::vector<acc_t>& logits, std::vector<acc_t>& row_k) {
  logits.resize(static_cast<size_t>(R * len));
  row_k.resize(static_cast<size_t>(D));
  acc_t* kf = row_k.data();
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  // logits[r, j] = q_r . k_j
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t* kj = k + (start + j) * stride;
    for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<acc_t>(kj[d]);
    for (int64_t r = 0; r < R; ++r) {
      const acc_t* qr = q + r * D;
      acc_t s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qr[d] * kf[d];
      logits[r * len + j] = s;
    }
  }
  if (mask != nullptr) {
    for (int64_t r = 0; r < R; ++r) {
      const bool* allowed = mask + (r % n) * n;
      for (int64_t j = 0; j < len; ++j)
        if (!allowed[j]) logits[r * len + j] = neg_inf;
    }
  }
  // per row: max, p = exp(s - max), sum
  for (int64_t r = 0; r < R; ++r) {
    acc_t* s = logits.data() + r * len;
    acc_t m = neg_inf;
    for (int64_t j = 0; j < len; ++j) m = s[j] > m ? s[j] : m;
    acc_t total = 0;
    if (m == neg_inf) {  // nothing visible in this chunk for this row
      for (int64_t j = 0; j < len; ++j) s[j] = 0;
    } else if (mask != nullptr) {
      for (int64_t j = 0; j < len; ++j) {
        s[j] = s[j] == neg_inf ? acc_t(0) : exp_nonpositive(s[j] - m);
        total += s[j];
      }
    } else {
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < len; ++j) {
        s[j] = exp_nonpositive(s[j] - m);
        total += s[j];
      }
    }
    max_out[r] = m;
    sum_out[r] = total;
    std::fill(out + r * D, out + (r + 1) * D, acc_t(0));
  }
  // out_r += p[r, j] v_j
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t* vj = v + (start + j) * stride;
    for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<acc_t>(vj[d]);
    for (int64_t r = 0; r < R; ++r) {
      const acc_t p = logits[r * len + j];
      acc_t* o = out + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * kf[d];
    }
  }
}

#if defined(__AVX512F__)
// Rows this far ahead are prefetched into L2 (measured on a 2-core Sapphire Rapids:
// into L1 or 96 rows ahead streams slower; the L2's deeper miss queue is what helps).
// Without AMX (an AMD EPYC Zen 4, 2 cores, 30 layers read from memory, in turns in one
// process) 32 rows ahead was the slowest distance tried: 128 took 0.88x its time for one
// token over 2K, 8K and 32K keys, 0.91-1.00x for 2 tokens, 0.98x for 3; 64 to 256 were
// within 3% of each other, 16 1.11-1.13x.
#if defined(__AMX_TILE__)
constexpr int64_t kPrefetchKeys = 32;
#else
constexpr int64_t kPrefetchKeys = 128;
#endif

// 16 accumulators (one per key) -> one vector of their 16 horizontal sums, in key order.
inline __m512 reduce16(const __m512* a) {
  __m512 s[8], u[4], w[2];
  for (int p = 0; p < 8; ++p)
    s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44), _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; ++p)
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0x88), _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)
    w[p] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 v = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4b + i holds key b + 4i
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, v);
}

// Rows of a value product held in registers at once: ROWS x NV accumulators (NV 16-wide
// vectors per row) and the value row's vectors within the 32 registers.
constexpr int value_rows(int NV) { return NV >= 8 ? 2 : (NV >= 4 ? 6 : 12); }

// f(rows, r0) for R rows in blocks of up to RB from r0 on, ``rows`` a
// std::integral_constant (a compile-time row count keeps the accumulators in
// registers); blocks of more than 6 rows run as single rows.
template <int RB, typename F>
inline void row_blocks(int64_t R, F&& f) {
  for (int64_t r0 = 0; r0 < R; r0 += RB) {
    const int rows = static_cast<int>(std::min<int64_t>(RB, R - r0));
    switch (rows) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: if constexpr (RB >= 3) f(std::integral_constant<int, 3>{}, r0); break;
      case 4: if constexpr (RB >= 4) f(std::integral_constant<int, 4>{}, r0); break;
      case 5: if constexpr (RB >= 5) f(std::integral_constant<int, 5>{}, r0); break;
      case 6: if constexpr (RB >= 6) f(std::integral_constant<int, 6>{}, r0); break;
      default: for (int rr = 0; rr < rows; ++rr) f(std::integral_constant<int, 1>{}, r0 + rr);
    }
  }
}

// out[r] = sum_j p[r * len + j] v_j for ROWS rows, v's rows converted once for all.
template <typename scalar_t, int NV, int ROWS>
inline void accumulate(const float* p, int64_t len, const scalar_t* v, int64_t stride, int64_t start, float* out) {
  constexpr int64_t D = NV * 16;
  __m512 acc[ROWS][NV];
  for (int rr = 0; rr < ROWS; ++rr)
    for (int t = 0; t < NV; ++t) acc[rr][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t* vj = v + (start + j) * stride;
    const char* ahead = reinterpret_cast<const char*>(vj + kPrefetchKeys * stride);
    for (int64_t b = 0; b < static_cast<int64_t>(D * sizeof(scalar_t)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
    __m512 vv[NV];
    for (int t = 0; t < NV; ++t) vv[t] = vload(vj + t * 16);
    for (int rr = 0; rr < ROWS; ++rr) {
      const __m512 w = _mm512_set1_ps(p[rr * len + j]);
      for (int t = 0; t < NV; ++t) acc[rr][t] = _mm512_fmadd_ps(w, vv[t], acc[rr][t]);
    }
  }
  for (int rr = 0; rr < ROWS; ++rr)
    for (int t = 0; t < NV; ++t) _mm512_storeu_ps(out + rr * D + t * 16, acc[rr][t]);
}

// c (16 keys x 16 rows of float32, key-major) transposed: rows[r] = the 16 keys of row r.
// Four shuffle stages (pairs, quads, then 128-bit lanes twice), 32 shuffles in all. In
// place of a gather per row and 16 keys: 24 rows (an 8-token tree) over 8K-32K positions
// 2.03-2.10 -> 1.83-1.85 ms per 1K, 3 rows unchanged (2-core Sapphire Rapids, in turns).
inline void transpose16(__m512* r, __m512* rows) {  // r: the 16 keys (clobbered)
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // lane L of t[2i]: keys 2i, 2i+1 of rows 4L, 4L+1; of t[2i+1]: rows 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i + m]: keys 4i..4i+3 of row 4L + m
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c2 = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c2, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c2, d));
  }
  for (int m = 0; m < 4; ++m) {  // row 4L + m gathers lane L of r[m], r[4 + m], r[8 + m], r[12 + m]
    const __m512 u0 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88), u1 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xDD);
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88), u3 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xDD);
    rows[m] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    rows[4 + m] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    rows[8 + m] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    rows[12 + m] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
}

inline void transpose16(const float* c, __m512* rows) {
  __m512 r[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_load_ps(c + 16 * k);
  transpose16(r, rows);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Rows of a KV head from which a bfloat16 chunk takes the AMX tiles (logits_amx,
// values_amx). Measured on a 2-core Sapphire Rapids, 30 layers of bfloat16 KV read
// from memory, 8K to 32K positions, ms per 1K positions against the AVX512-BF16 path:
// 1 row 0.98 vs 0.92 (the tiles' fixed cost), 3 rows (one token of 9 query heads over
// 3 KV heads) 1.03 vs 1.09, 6 rows 1.12 vs 1.28, 24 rows (an 8-token tree) 1.99 vs 3.47.
constexpr int64_t kAmxRows = 3;


// Query-key products by AMX tiles: S^T = K Q^T for up to 16 rows at a time, the keys as
// the A tiles straight from the store (16 keys x 32 dims of bfloat16 each, any row
// stride), the rows' query packed once as the B tile in the pairs layout the instruction
// reads ([dim pairs][16 columns], 32 bits each, columns past the rows zero), four C
// tiles of 16 keys x 16 columns float32 per pass, each transposed into the rows' logits.
// Each logit is one C element, summed over the same dim steps whatever the other rows
// are: a row's logits do not depend on which rows share the call. Writes
// logits[r * len + j] = scale * q_r . k_j for j < the returned count (a multiple of 16);
// the rest is the caller's.
template <int NV>
int64_t logits_amx(const c10::BFloat16* qb, float scale, int64_t R, const c10::BFloat16* k, int64_t stride,
                   int64_t start, int64_t len, float* logits) {
  constexpr int64_t D = NV * 16;
  constexpr int64_t kSteps = D / 32;  // dim steps of 32 (16 pairs)
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  const int64_t whole = len / 16 * 16;
  alignas(64) uint32_t b[kSteps * 16 * 16];
  alignas(64) float c[4 * 16 * 16];
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t cols = std::min<int64_t>(16, R - r0);
    std::memset(b, 0, sizeof(b));
    for (int64_t st = 0; st < kSteps; ++st)
      for (int64_t pr = 0; pr < 16; ++pr)
        for (int64_t r = 0; r < cols; ++r) std::memcpy(b + (st * 16 + pr) * 16 + r, qb + (r0 + r) * D + st * 32 + 2 * pr, 4);
    tokenswift_amx::TileConfig config;
    for (int t = 0; t < 5; ++t) {  // tmm0-3: C, 16 keys x 16 columns; tmm4: B, 16 pairs x 16 columns
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    for (int t = 5; t < 7; ++t) {  // tmm5-6: A, 16 keys x 32 dims
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    int64_t j0 = 0;
    for (; j0 < whole; j0 += 64) {
      const int64_t groups = std::min<int64_t>(4, (whole - j0) / 16);
      const c10::BFloat16* a = k + (start + j0) * stride;
      // kPrefetchKeys ahead, as the other paths: one 64-key block ahead measured 0.99-1.05 ms
      // per 1K positions, 32 keys 0.93-0.96 (3 rows, 30 layers over 32K keys from memory,
      // 2-core Sapphire Rapids; 6 rows 1.05 -> 1.00, 15 rows 1.31 -> 1.26; 16 or 48 keys
      // ahead, or none, slower; hinted into L3 only (T2), slower)
      for (int64_t j = 0; j < 16 * groups; ++j) {
        const char* ahead = reinterpret_cast<const char*>(a + (j + kPrefetchKeys) * stride);
        for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t st = 0; st < kSteps; ++st) {
        _tile_loadd(4, b + st * 16 * 16, 64);
        _tile_loadd(5, a + st * 32, bytes);
        _tile_dpbf16ps(0, 5, 4);
        if (groups > 1) {
          _tile_loadd(6, a + 16 * stride + st * 32, bytes);
          _tile_dpbf16ps(1, 6, 4);
        }
        if (groups > 2) {
          _tile_loadd(5, a + 32 * stride + st * 32, bytes);
          _tile_dpbf16ps(2, 5, 4);
        }
        if (groups > 3) {
          _tile_loadd(6, a + 48 * stride + st * 32, bytes);
          _tile_dpbf16ps(3, 6, 4);
        }
      }
      _tile_stored(0, c, 64);
      if (groups > 1) _tile_stored(1, c + 256, 64);
      if (groups > 2) _tile_stored(2, c + 512, 64);
      if (groups > 3) _tile_stored(3, c + 768, 64);
      for (int64_t gi = 0; gi < groups; ++gi) {  // key-major C to the rows' logits
        __m512 rows[16];
        transpose16(c + gi * 256, rows);
        for (int64_t r = 0; r < cols; ++r)
          _mm512_storeu_ps(logits + (r0 + r) * len + j0 + 16 * gi, _mm512_mul_ps(rows[r], scale_v));
      }
    }
  }
  _tile_release();
  return whole;
}

// Value products by AMX tiles: out[r] = sum_j p[r, j] v_j for up to 16 rows at a time,
// the rows' bfloat16 probabilities as the A tile (16 rows x 32 keys, straight from pb),
// each 32 keys' values repacked as B tiles in the pairs layout the instruction reads (16
// key pairs x 16 dims, one tile per 16 dims: vpermt2w interleaves two keys' rows), four
// C tiles of rows x 16 dims float32 per 64 dims. A row's sums do not depend on the other
// rows. pb: [R][lenp] bfloat16 bits, lenp a multiple of 32, zero from len on.
template <int NV>
void values_amx(const uint16_t* pb, int64_t lenp, int64_t R, const c10::BFloat16* v, int64_t stride, int64_t start,
                int64_t len, float* out) {
  constexpr int64_t D = NV * 16;
  static_assert(NV % 4 == 0, "values_amx: head dims of 64 or 128");
  constexpr int64_t kBlock = 4 * 16 * 32;  // one 32-key step of 64 dims: four B tiles
  // The repacked values, kept for the row groups after the first (R > 16), which read
  // them instead of repacking: 48 rows 2.85 -> 2.70 ms per 1K positions (in turns).
  thread_local std::vector<uint16_t> packed;
  const int64_t steps = lenp / 32;
  const bool keep = R > 16;
  if (keep && packed.size() < static_cast<size_t>(steps * (D / 64) * kBlock)) packed.resize(steps * (D / 64) * kBlock);
  alignas(64) uint16_t scratch[kBlock];
  alignas(64) int16_t lo[32], hi[32];
  for (int i = 0; i < 16; ++i) {
    lo[2 * i] = static_cast<int16_t>(i);
    lo[2 * i + 1] = static_cast<int16_t>(32 + i);
    hi[2 * i] = static_cast<int16_t>(16 + i);
    hi[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i lo_idx = _mm512_load_si512(lo), hi_idx = _mm512_load_si512(hi);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    const int64_t rows = std::min<int64_t>(16, R - r0);
    tokenswift_amx::TileConfig config;
    for (int t = 0; t < 5; ++t) {  // tmm0-3: C, rows x 16 dims; tmm4: A, rows x 32 keys
      config.rows[t] = static_cast<uint8_t>(rows);
      config.colsb[t] = 64;
    }
    for (int t = 5; t < 8; ++t) {  // tmm5-7: B, 16 key pairs x 16 dims
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    for (int64_t g = 0; g < D; g += 64) {  // 64 dims: 4 C tiles
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j0 = 0; j0 < len; j0 += 32) {
        uint16_t* b = keep ? packed.data() + ((j0 / 32) * (D / 64) + g / 64) * kBlock : scratch;
        if (r0 == 0) {  // repack: b[t][pr] = the 16 dims t*16.. of keys j0 + 2pr and j0 + 2pr + 1, interleaved
          for (int64_t pr = 0; pr < 16; ++pr) {
            const int64_t j = j0 + 2 * pr;
            const c10::BFloat16* v0 = v + (start + j) * stride + g;
            const char* ahead = reinterpret_cast<const char*>(v0 + kPrefetchKeys * stride);
            _mm_prefetch(ahead, _MM_HINT_T1);
            _mm_prefetch(ahead + 64, _MM_HINT_T1);
            _mm_prefetch(ahead + stride * 2, _MM_HINT_T1);
            _mm_prefetch(ahead + stride * 2 + 64, _MM_HINT_T1);
            const __m512i a0 = j < len ? _mm512_loadu_si512(v0) : zero;
            const __m512i a1 = j < len ? _mm512_loadu_si512(v0 + 32) : zero;
            const __m512i c0 = j + 1 < len ? _mm512_loadu_si512(v0 + stride) : zero;
            const __m512i c1 = j + 1 < len ? _mm512_loadu_si512(v0 + stride + 32) : zero;
            _mm512_storeu_si512(b + (0 * 16 + pr) * 32, _mm512_permutex2var_epi16(a0, lo_idx, c0));
            _mm512_storeu_si512(b + (1 * 16 + pr) * 32, _mm512_permutex2var_epi16(a0, hi_idx, c0));
            _mm512_storeu_si512(b + (2 * 16 + pr) * 32, _mm512_permutex2var_epi16(a1, lo_idx, c1));
            _mm512_storeu_si512(b + (3 * 16 + pr) * 32, _mm512_permutex2var_epi16(a1, hi_idx, c1));
          }
        }
        // three B tiles in turn, so that a load need not wait for the product before it
        _tile_loadd(4, pb + r0 * lenp + j0, lenp * 2);
        _tile_loadd(5, b, 64);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 1536, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
      }
      _tile_stored(0, out + r0 * D + g, D * 4);
      _tile_stored(1, out + r0 * D + g + 16, D * 4);
      _tile_stored(2, out + r0 * D + g + 32, D * 4);
      _tile_stored(3, out + r0 * D + g + 48, D * 4);
    }
  }
  _tile_release();
}
#endif

#if defined(__AVX512BF16__)
// p (float32, [R][len]) rounded to bfloat16 (nearest even, as PyTorch's bfloat16
// attention rounds its probabilities before the value product) into pb ([R][lenp]),
// zero from len to lenp.
inline void probabilities_bf16(const float* p, int64_t R, int64_t len, uint16_t* pb, int64_t lenp) {
  for (int64_t r = 0; r < R; ++r) {
    const float* src = p + r * len;
    uint16_t* dst = pb + r * lenp;
    int64_t j = 0;
    for (; j + 16 <= len; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
    for (; j < len; ++j) {
      const c10::BFloat16 x(src[j]);
      std::memcpy(dst + j, &x, 2);
    }
    std::fill(dst + len, dst + lenp, uint16_t(0));
  }
}
#endif

#if defined(__AVX512BF16__)
// Query-key products of RG rows by vdpbf16ps with the keys transposed: a block of 16
// keys' dim pairs (32-bit words) is transposed once for all rows into kt (word m of the
// 16 keys in one vector), then each row's 16 logits are D/2 instructions of the
// broadcast query pair m against kt[m], into two accumulators (even and odd m), with
// no horizontal sums. A row's logits are the same instructions whatever rows share
// the call.
template <int NV, int RG>
inline void logits_rows(const c10::BFloat16* qb, int64_t D, const __m512* kt, __m512 scale_v, float* s, int64_t len) {
  constexpr int W = NV * 8;  // dim pairs
  __m512 even[RG], odd[RG];
  for (int g = 0; g < RG; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int m = 0; m < W; m += 2) {
    for (int g = 0; g < RG; ++g) {
      int32_t a, b;
      std::memcpy(&a, qb + g * D + 2 * m, 4);
      std::memcpy(&b, qb + g * D + 2 * m + 2, 4);
      even[g] = _mm512_dpbf16_ps(even[g], (__m512bh)_mm512_set1_epi32(a), (__m512bh)_mm512_castps_si512(kt[m]));
      odd[g] = _mm512_dpbf16_ps(odd[g], (__m512bh)_mm512_set1_epi32(b), (__m512bh)_mm512_castps_si512(kt[m + 1]));
    }
  }
  for (int g = 0; g < RG; ++g) _mm512_storeu_ps(s + g * len, _mm512_mul_ps(_mm512_add_ps(even[g], odd[g]), scale_v));
}

// The logits of whole blocks of 16 keys (logits_rows); returns the keys done.
template <int NV>
int64_t logits_pairs(const c10::BFloat16* qb, float scale, int64_t R, const c10::BFloat16* k, int64_t stride,
                     int64_t start, int64_t len, float* logits) {
  constexpr int64_t D = NV * 16;
  constexpr int W = NV * 8;
  alignas(64) __m512 kt[W];
  const __m512 scale_v = _mm512_set1_ps(scale);
  int64_t j0 = 0;
  for (; j0 + 16 <= len; j0 += 16) {
    for (int h = 0; h < NV / 2; ++h) {  // words 16h .. 16h + 15 of the 16 keys
      __m512 r[16];
      for (int j = 0; j < 16; ++j) {
        const c10::BFloat16* kj = k + (start + j0 + j) * stride;
        if (h == 0) {
          const char* ahead = reinterpret_cast<const char*>(kj + kPrefetchKeys * stride);
          for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
        }
        r[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(kj + h * 32));
      }
      transpose16(r, kt + 16 * h);
    }
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) logits_rows<NV, 4>(qb + r0 * D, D, kt, scale_v, logits + r0 * len + j0, len);
    for (; r0 < R; ++r0) logits_rows<NV, 1>(qb + r0 * D, D, kt, scale_v, logits + r0 * len + j0, len);
  }
  return j0;
}
#endif

#if defined(__AVX512BF16__)
// out[r] = sum_j pb[r][j] v_j for ROWS rows (r0 on), bfloat16 probabilities and values,
// pairs of keys per instruction (vdpbf16ps: two products summed into each float32
// lane): half the arithmetic of widening v and one FMA per key. A pair's two value
// rows are interleaved once for all ROWS rows (unpacklo/hi by 16 bits, within 128-bit
// lanes); the accumulators then hold the head dims in that lane order, put back at the
// store. An odd chunk's last key pairs with zeros.
template <int NV, int ROWS>
inline void accumulate_pairs(const uint16_t* pb, int64_t lenp, const c10::BFloat16* v, int64_t stride, int64_t start,
                             int64_t len, float* out) {
  constexpr int NB = NV / 2;  // 32-value vectors of bfloat16 per value row
  constexpr int64_t D = NV * 16;
  __m512 acc[ROWS][2 * NB];
  for (int rr = 0; rr < ROWS; ++rr)
    for (int t = 0; t < 2 * NB; ++t) acc[rr][t] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < len; j += 2) {
    const c10::BFloat16* v0 = v + (start + j) * stride;
    const char* ahead = reinterpret_cast<const char*>(v0 + kPrefetchKeys * stride);
    for (int64_t b = 0; b < D * 2; b += 64) {
      _mm_prefetch(ahead + b, _MM_HINT_T1);
      _mm_prefetch(ahead + stride * 2 + b, _MM_HINT_T1);
    }
    __m512i pairs[2 * NB];
    for (int b = 0; b < NB; ++b) {
      const __m512i a = _mm512_loadu_si512(v0 + b * 32);
      const __m512i c = j + 1 < len ? _mm512_loadu_si512(v0 + stride + b * 32) : zero;
      pairs[2 * b] = _mm512_unpacklo_epi16(a, c);
      pairs[2 * b + 1] = _mm512_unpackhi_epi16(a, c);
    }
    for (int rr = 0; rr < ROWS; ++rr) {
      int32_t w32;
      std::memcpy(&w32, pb + rr * lenp + j, sizeof(w32));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(w32);
      for (int t = 0; t < 2 * NB; ++t) acc[rr][t] = _mm512_dpbf16_ps(acc[rr][t], w, (__m512bh)pairs[t]);
    }
  }
  // lo lane 4l + i holds dim 8l + i, hi lane 4l + i dim 8l + 4 + i (of its 32)
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int rr = 0; rr < ROWS; ++rr)
    for (int b = 0; b < NB; ++b) {
      _mm512_storeu_ps(out + rr * D + b * 32, _mm512_permutex2var_ps(acc[rr][2 * b], first, acc[rr][2 * b + 1]));
      _mm512_storeu_ps(out + rr * D + b * 32 + 16, _mm512_permutex2var_ps(acc[rr][2 * b], second, acc[rr][2 * b + 1]));
    }
}

// Rows of a KV head from which a bfloat16 chunk without AMX takes the pairs path for
// its logits (logits_pairs; its values take pairs from kPairValueRows, below, with the
// probabilities rounded to bfloat16, as PyTorch's bfloat16 attention and the AMX path
// round them). Measured, before the values' own threshold, on
// a 2-core AMD EPYC Zen 4 (AVX512-BF16), 30 layers of bfloat16 KV, ms against the
// per-row path: over 32K keys 1 token (3 rows) 29.5-30.0 vs 27.3-27.5, 2 tokens 32.1-32.4
// vs 30.0-30.6, 3 tokens 37.7-38.1 vs 41.2-41.6, 4 / 8 / 16 tokens 42.9 / 69.0 / 121.8
// vs 53.6 / 99.5 / 191.3; over 2K keys 4 / 16 tokens 4.7 / 12.2 vs 5.7 / 17.9.
constexpr int64_t kPairRows = 9;
// Rows from which the value products alone take pairs (accumulate_pairs), the logits
// still row by row below kPairRows: half the arithmetic of widened values, for one
// more pass rounding the probabilities. Measured on a 2-core AMD EPYC Zen 4, 30 layers,
// in turns in one process: 2 tokens (6 rows) over 2K keys 0.87x the time, over 8K and
// 32K keys (read from memory) 1.00x and 0.98x; in cache 0.89x at 32K. One token (3
// rows) 1.01-1.03x from memory, so it stays on widened values.
constexpr int64_t kPairValueRows = 4;
#endif

// An unmasked chunk with head dim NV * 16: keys in blocks of 16 (converted once, each
// row's 16 dot products reduced together), values accumulated for up to RB rows in
// registers.
template <typename scalar_t, int NV>
void chunk_blocked(const float* q, const c10::BFloat16* qb, float scale, int64_t R, const scalar_t* k,
                   const scalar_t* v, int64_t stride, int64_t start, int64_t len, float* max_out, float* sum_out,
                   float* out, float* logits, float* scratch, uint16_t* pb) {
  constexpr int64_t D = NV * 16;
  int64_t j0 = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  // bfloat16 keys and values, an exactly-bfloat16 query, rows enough to repay the tiles
  const bool tiles = std::is_same<scalar_t, c10::BFloat16>::value && qb != nullptr && R >= kAmxRows && tokenswift_amx::permitted();
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value && NV % 2 == 0)
    if (tiles) j0 = logits_amx<NV>(qb, scale, R, k, stride, start, len, logits);
#endif
#if defined(__AVX512BF16__)
  // bfloat16 keys and an exactly-bfloat16 query (qb): pairs of products summed in
  // float32 by the hardware, no conversion of the keys; the scale applied after.
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value && NV % 2 == 0) {
    if (qb != nullptr && j0 == 0 && R >= kPairRows) j0 = logits_pairs<NV>(qb, scale, R, k, stride, start, len, logits);
    if (qb != nullptr) {
      const __m512 scale_v = _mm512_set1_ps(scale);
      for (; j0 + 16 <= len; j0 += 16) {
        for (int64_t j = 0; j < 16; ++j) {
          const char* ahead = reinterpret_cast<const char*>(k + (start + j0 + j + kPrefetchKeys) * stride);
          for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
        }
        for (int64_t r = 0; r < R; ++r) {
          __m512bh qv[NV / 2];
          for (int t = 0; t < NV / 2; ++t) qv[t] = (__m512bh)_mm512_loadu_si512(qb + r * D + t * 32);
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            const scalar_t* kj = k + (start + j0 + j) * stride;
            __m512 a = _mm512_setzero_ps();
            for (int t = 0; t < NV / 2; ++t) a = _mm512_dpbf16_ps(a, qv[t], (__m512bh)_mm512_loadu_si512(kj + t * 32));
            acc[j] = a;
          }
          _mm512_storeu_ps(logits + r * len + j0, _mm512_mul_ps(reduce16(acc), scale_v));
        }
      }
    }
  }
#endif
  for (; j0 + 16 <= len; j0 += 16) {
    widen_rows<scalar_t, D>(k + (start + j0) * stride, stride, 16, kPrefetchKeys, scratch);
    for (int64_t r = 0; r < R; ++r) {
      __m512 qv[NV];
      for (int t = 0; t < NV; ++t) qv[t] = _mm512_loadu_ps(q + r * D + t * 16);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(scratch + j * D));
        for (int t = 1; t < NV; ++t) a = _mm512_fmadd_ps(qv[t], _mm512_loadu_ps(scratch + j * D + t * 16), a);
        acc[j] = a;
      }
      _mm512_storeu_ps(logits + r * len + j0, reduce16(acc));
    }
  }
  for (; j0 < len; ++j0) {  // the tail
    const scalar_t* kj = k + (start + j0) * stride;
    __m512 kv[NV];
    for (int t = 0; t < NV; ++t) kv[t] = vload(kj + t * 16);
    for (int64_t r = 0; r < R; ++r) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + r * D), kv[0]);
      for (int t = 1; t < NV; ++t) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + t * 16), kv[t], a);
      logits[r * len + j0] = _mm512_reduce_add_ps(a);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* s = logits + r * len;
    const float m = row_max(s, len);
    max_out[r] = m;
    sum_out[r] = exp_shifted(s, len, m);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value && NV % 4 == 0) {
    if (tiles) {
      const int64_t lenp = (len + 31) / 32 * 32;
      probabilities_bf16(logits, R, len, pb, lenp);
      values_amx<NV>(pb, lenp, R, v, stride, start, len, out);
      return;
    }
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
    if (qb != nullptr && R >= kPairValueRows) {
      const int64_t lenp = (len + 1) / 2 * 2;
      probabilities_bf16(logits, R, len, pb, lenp);
      row_blocks<value_rows(NV)>(R, [&](auto rows, int64_t r0) {
        accumulate_pairs<NV, decltype(rows)::value>(pb + r0 * lenp, lenp, v, stride, start, len, out + r0 * D);
      });
      return;
    }
  }
#endif
  row_blocks<value_rows(NV)>(R, [&](auto rows, int64_t r0) {
    accumulate<scalar_t, NV, decltype(rows)::value>(logits + r0 * len, len, v, stride, start, out + r0 * D);
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 accumulators (one per key) -> one vector of their 8 horizontal sums, in key order.
inline __m256 reduce8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  // per 128-bit lane: keys 0-3 (4-7) summed over that lane's four elements
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Values converted to float32 this many at a time into an L1 scratch (keys 8 at a time),
// each block's rows prefetched kAvx2ValueAhead rows ahead (into L2), the keys'
// kAvx2KeyAhead. The value pass read its rows in bursts of 64 with the memory idle while
// they were summed; blocks of 16 prefetched 32 ahead (against 64 and 16 before) took
// 0.83-0.97x the time for 1-8 tokens over 2K-32K keys on a 2-core AMD EPYC Zen 3,
// outputs equal bit for bit (benchmarks/attention_revisions.py; 30 layers of bfloat16
// KV). Blocks of 8 or 32, prefetch 24-96 rows ahead or into L1, rows or keys blocked in
// registers, and one fused pass with an online softmax were all slower there.
constexpr int64_t kAvx2Block = 16;
constexpr int64_t kAvx2KeyAhead = 16;
constexpr int64_t kAvx2ValueAhead = 32;

// bfloat16 values on AVX2, widened in registers: 16 bfloat16 unpacked with zeros give
// dims {0-3, 8-11} (unpacklo) and {4-7, 12-15} (unpackhi) as float32, exactly, with no
// scratch copy. Each output element is still the same FMAs over the keys in key order,
// so a row's result is the one the scratch path gave, bit for bit; only the order the
// dims sit in the accumulators differs, undone at the end of values_avx2_bf16.
constexpr int kUnpackedDim[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

inline __m256 widen_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x)); }
inline __m256 widen_hi(__m256i x) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x)); }

// Rows a (and b, with TWO) accumulate dims [32g, 32g + 32) of their outputs (unpacked
// order) over blen value rows: four vectors each, eight FMA chains for two rows, each
// chain one FMA per key.
template <bool TWO>
inline void values_32(const float* pa, const float* pb, const c10::BFloat16* v, int64_t stride, int64_t blen, float* oa,
                      float* ob) {
  __m256 a[4], b[4];
  for (int t = 0; t < 4; ++t) {
    a[t] = _mm256_loadu_ps(oa + 8 * t);
    if (TWO) b[t] = _mm256_loadu_ps(ob + 8 * t);
  }
  for (int64_t j = 0; j < blen; ++j) {
    const __m256 wa = _mm256_broadcast_ss(pa + j);
    __m256 wb;
    if (TWO) wb = _mm256_broadcast_ss(pb + j);
    const __m256i* row = reinterpret_cast<const __m256i*>(v + j * stride);
    const __m256i x0 = _mm256_loadu_si256(row), x1 = _mm256_loadu_si256(row + 1);
    const __m256 e[4] = {widen_lo(x0), widen_hi(x0), widen_lo(x1), widen_hi(x1)};
    for (int t = 0; t < 4; ++t) {
      a[t] = _mm256_fmadd_ps(wa, e[t], a[t]);
      if (TWO) b[t] = _mm256_fmadd_ps(wb, e[t], b[t]);
    }
  }
  for (int t = 0; t < 4; ++t) {
    _mm256_storeu_ps(oa + 8 * t, a[t]);
    if (TWO) _mm256_storeu_ps(ob + 8 * t, b[t]);
  }
}

// One row over dims [64g, 64g + 64) (unpacked order): eight FMA chains, as two rows
// over 32 dims give (one row over 32 dims leaves the FMA units waiting on four chains).
inline void values_64(const float* p, const c10::BFloat16* v, int64_t stride, int64_t blen, float* o) {
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_loadu_ps(o + 8 * t);
  for (int64_t j = 0; j < blen; ++j) {
    const __m256 w = _mm256_broadcast_ss(p + j);
    const __m256i* row = reinterpret_cast<const __m256i*>(v + j * stride);
    for (int h = 0; h < 4; ++h) {
      const __m256i x = _mm256_loadu_si256(row + h);
      a[2 * h] = _mm256_fmadd_ps(w, widen_lo(x), a[2 * h]);
      a[2 * h + 1] = _mm256_fmadd_ps(w, widen_hi(x), a[2 * h + 1]);
    }
  }
  for (int t = 0; t < 8; ++t) _mm256_storeu_ps(o + 8 * t, a[t]);
}

// The value pass of an AVX2 chunk over bfloat16 values: blocks of kAvx2Block keys,
// prefetched kAvx2ValueAhead rows ahead into L1, rows in pairs over 32 dims at a time
// (an odd row alone over 64). Against widening each block into a float32 scratch first
// (the path in chunk_avx2, which float32 values and chunks of fewer rows keep): 0.83-0.95x
// the time of 2-8 tokens over 2K-32K keys in most cells (30 layers, a 2-core AMD EPYC
// Zen 3; benchmarks/attention_revisions.py, in turns, median of 9-15;
// benchmarks/results/avx2-zen3-s23). Each element is the same FMAs in the same order as
// there: a build without the threshold below gave outputs equal bit for bit; this one's
// differ from the build before it by <= 1.2e-7 in every path (the compiler contracts
// other code differently under -ffp-contract=fast).
//
// The fewest rows that take values_avx2_bf16: one token of 9 query heads over 3 KV heads
// (3 rows) read 1.02-1.06x the time that way, in the same turns.
constexpr int64_t kAvx2PairedRows = 4;

template <int64_t D>
void values_avx2_bf16(const float* logits, int64_t R, int64_t len, const c10::BFloat16* v, int64_t stride, float* out) {
  for (int64_t b0 = 0; b0 < len; b0 += kAvx2Block) {
    const int64_t blen = std::min(kAvx2Block, len - b0);
    for (int64_t j = 0; j < blen; ++j) {
      const char* next = reinterpret_cast<const char*>(v + (b0 + j + kAvx2ValueAhead) * stride);
      for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    const int64_t pairs = R / 2 * 2;
    for (int64_t g = 0; g < D; g += 32)
      for (int64_t r = 0; r < pairs; r += 2)
        values_32<true>(logits + r * len + b0, logits + (r + 1) * len + b0, v + b0 * stride + g, stride, blen,
                        out + r * D + g, out + (r + 1) * D + g);
    if (pairs < R) {  // the odd row: 64 dims at a time where the head has them
      const float* p = logits + pairs * len + b0;
      float* o = out + pairs * D;
      int64_t g = 0;
      for (; g + 64 <= D; g += 64) values_64(p, v + b0 * stride + g, stride, blen, o + g);
      if (g < D) values_32<false>(p, nullptr, v + b0 * stride + g, stride, blen, o + g, nullptr);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // each 16 dims back from the unpacked order
    float* o = out + r * D;
    for (int64_t s = 0; s < D; s += 16) {
      float slice[16];
      for (int i = 0; i < 16; ++i) slice[kUnpackedDim[i]] = o[s + i];
      std::memcpy(o + s, slice, sizeof(slice));
    }
  }
}

// An unmasked chunk on AVX2+FMA, head dim NV8 * 8, float32 accumulation. Keys in blocks
// of 8 converted once for all rows; each row's 8 logits are 8 FMA chains reduced
// together (reduce8) instead of one horizontal sum per key. Values in blocks of
// kAvx2Block, widened in registers for bfloat16 chunks of kAvx2PairedRows+ rows
// (values_avx2_bf16), else converted once into a scratch; each row accumulates its output
// in registers over the block instead of loading and storing it at every key. A row's
// result is the same FMAs in the same order whatever rows share the call. Measured on a
// 2-core AMD EPYC Zen 4 built for AVX2 alone (-march=haswell: the AVX2 machines' path),
// 30 layers of bfloat16 KV, against chunk_simd (one horizontal sum per row and key, the
// output loaded and stored at every key): over 32K keys 1 / 2 / 4 / 8 tokens 44-46 /
// 54-64 / 85-106 / 195 ms against 51-53 / 85-88 / 171-177 / 351-362; over 8K 12-13 /
// 16-19 / 25-29 / 46-52 against 14 / 23 / 46-47 / 92. ms per 1K positions of one token,
// 8K to 32K: 1.26-1.35 against 1.47-1.56.
template <typename scalar_t, int NV8>
void chunk_avx2(const float* q, int64_t R, const scalar_t* k, const scalar_t* v, int64_t stride, int64_t start,
                int64_t len, float* max_out, float* sum_out, float* out, float* logits, float* scratch) {
  constexpr int64_t D = NV8 * 8;
  int64_t j0 = 0;
  for (; j0 + 8 <= len; j0 += 8) {
    widen_rows<scalar_t, D>(k + (start + j0) * stride, stride, 8, kAvx2KeyAhead, scratch);
    for (int64_t r = 0; r < R; ++r) {
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int t = 0; t < NV8; ++t) {
        const __m256 qt = _mm256_loadu_ps(q + r * D + t * 8);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qt, _mm256_loadu_ps(scratch + j * D + t * 8), acc[j]);
      }
      _mm256_storeu_ps(logits + r * len + j0, reduce8(acc));
    }
  }
  for (; j0 < len; ++j0) {  // the tail, one key at a time
    widen_rows<scalar_t, D>(k + (start + j0) * stride, stride, 1, kAvx2KeyAhead, scratch);
    for (int64_t r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int t = 0; t < NV8; ++t) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + t * 8), _mm256_loadu_ps(scratch + t * 8), a);
      logits[r * len + j0] = vsum(a);
    }
  }
  exponentiate_rows(logits, R, len, D, max_out, sum_out, out);
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value && D % 32 == 0) {
    if (R >= kAvx2PairedRows) {
      values_avx2_bf16<D>(logits, R, len, v + start * stride, stride, out);
      return;
    }
  }
  constexpr int TV = NV8 < 8 ? NV8 : 8;  // output vectors held in registers at a time
  for (int64_t b0 = 0; b0 < len; b0 += kAvx2Block) {
    const int64_t blen = std::min(kAvx2Block, len - b0);
    widen_rows<scalar_t, D>(v + (start + b0) * stride, stride, blen, kAvx2ValueAhead, scratch);
    for (int64_t r = 0; r < R; ++r) {
      const float* p = logits + r * len + b0;
      for (int t0 = 0; t0 < NV8; t0 += TV) {
        float* o = out + r * D + t0 * 8;
        __m256 acc[TV];
        for (int t = 0; t < TV; ++t) acc[t] = _mm256_loadu_ps(o + t * 8);
        for (int64_t j = 0; j < blen; ++j) {
          const __m256 w = _mm256_broadcast_ss(p + j);
          for (int t = 0; t < TV; ++t) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(scratch + j * D + (t0 + t) * 8), acc[t]);
        }
        for (int t = 0; t < TV; ++t) _mm256_storeu_ps(o + t * 8, acc[t]);
      }
    }
  }
}
#endif

template <typename scalar_t, typename acc_t>
void run(const at::Tensor& q, const c10::BFloat16* qb, float scale, const at::Tensor& key, const at::Tensor& value,
         int64_t prefix, const bool* mask, int64_t n, int64_t chunk_size, at::Tensor& out) {
  // q: [Hkv, R, D] acc_t contiguous; key/value: [1, Hkv, L, D]; out: [Hkv, R, D] acc_t
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2);
  const int64_t L = key.size(2);
  const int64_t tree = mask != nullptr ? n : 0;
  const int64_t visible = mask != nullptr ? prefix : L;  // keys every row sees
  const int64_t chunks = (visible + chunk_size - 1) / chunk_size;
  const int64_t per_head = chunks + (tree > 0 ? 1 : 0);
  const int64_t items = H * per_head;
  // every slot is written by its chunk before the merge reads it: no zero-filling
  std::unique_ptr<acc_t[]> maxes(new acc_t[items * R]), sums(new acc_t[items * R]), outs(new acc_t[items * R * D]);
  const acc_t* qp = q.data_ptr<acc_t>();
  const scalar_t* kp = key.data_ptr<scalar_t>();
  const scalar_t* vp = value.data_ptr<scalar_t>();
  const int64_t k_head = key.stride(1), k_row = key.stride(2);
  const int64_t v_head = value.stride(1), v_row = value.stride(2);
  TORCH_CHECK(k_row == v_row, "decode_attention: keys and values must share their row stride");
  // Each thread takes an equal share of the chunks, then of the tree blocks (small):
  // split as one list of items, a thread could take two chunks more than another.
  const int64_t chunk_items = H * chunks, tree_items = tree > 0 ? H : 0;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), chunk_items + tree_items));
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    std::vector<acc_t> logits, row;
    std::vector<uint16_t> probs;  // bfloat16 probabilities for the AMX value products
    std::vector<int64_t> mine;
    for (int64_t t = first; t < last; ++t) {
      for (int64_t i = t * chunk_items / threads; i < (t + 1) * chunk_items / threads; ++i)
        mine.push_back((i / chunks) * per_head + i % chunks);
      for (int64_t i = t * tree_items / threads; i < (t + 1) * tree_items / threads; ++i)
        mine.push_back(i * per_head + chunks);
    }
    for (const int64_t item : mine) {
      const int64_t h = item / per_head, c = item % per_head;
      const bool is_tree = c == chunks;
      const int64_t start = is_tree ? prefix : c * chunk_size;
      const int64_t len = is_tree ? tree : std::min(chunk_size, visible - start);
#ifdef TOKENSWIFT_SIMD
      if constexpr (Simd<scalar_t>::value && std::is_same<acc_t, float>::value) {
#if defined(__AVX512F__)
        if (!is_tree && (D == 64 || D == 128 || D == 32)) {
          logits.resize(static_cast<size_t>(R * len + 16 * D));
          float* scratch = logits.data() + R * len;
          float* mo = maxes.get() + item * R;
          float* so = sums.get() + item * R;
          float* oo = outs.get() + item * R * D;
          const float* qh = qp + h * R * D;
          const c10::BFloat16* qbh = qb == nullptr ? nullptr : qb + h * R * D;
          probs.resize(static_cast<size_t>(R * ((len + 31) / 32 * 32)));
          uint16_t* pb = probs.data();
          if (D == 64)
            chunk_blocked<scalar_t, 4>(qh, qbh, scale, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch, pb);
          else if (D == 128)
            chunk_blocked<scalar_t, 8>(qh, qbh, scale, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch, pb);
          else
            chunk_blocked<scalar_t, 2>(qh, qbh, scale, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch, pb);
          continue;
        }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        if (!is_tree && (D == 32 || D == 64 || D == 128)) {
          logits.resize(static_cast<size_t>(R * len + std::max<int64_t>(8, kAvx2Block) * D));
          float* scratch = logits.data() + R * len;
          float* mo = maxes.get() + item * R;
          float* so = sums.get() + item * R;
          float* oo = outs.get() + item * R * D;
          const float* qh = qp + h * R * D;
          if (D == 64)
            chunk_avx2<scalar_t, 8>(qh, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch);
          else if (D == 128)
            chunk_avx2<scalar_t, 16>(qh, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch);
          else
            chunk_avx2<scalar_t, 4>(qh, R, kp + h * k_head, vp + h * v_head, k_row, start, len, mo, so, oo, logits.data(), scratch);
          continue;
        }
#endif
        if (!is_tree && D % kWidth == 0 && D <= 256) {
          logits.resize(static_cast<size_t>(R * len));
          chunk_simd<scalar_t>(qp + h * R * D, R, D, kp + h * k_head, vp + h * v_head, k_row, start, len,
                               maxes.get() + item * R, sums.get() + item * R, outs.get() + item * R * D,
                               logits.data());
          continue;
        }
      }
#endif
      chunk<scalar_t, acc_t>(qp + h * R * D, R, D, kp + h * k_head, vp + h * v_head, k_row, start, len,
                             is_tree ? mask : nullptr, n, maxes.get() + item * R, sums.get() + item * R,
                             outs.get() + item * R * D, logits, row);
    }
  });
  // merge the partials of each head's chunks by log-sum-exp
  acc_t* op = out.data_ptr<acc_t>();
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  at::parallel_for(0, H * R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t hr = begin; hr < end; ++hr) {
      const int64_t h = hr / R, r = hr % R;
      acc_t m = neg_inf;
      for (int64_t c = 0; c < per_head; ++c) m = std::max(m, maxes[(h * per_head + c) * R + r]);
      acc_t total = 0;
      acc_t* o = op + hr * D;
      std::fill(o, o + D, acc_t(0));
      for (int64_t c = 0; c < per_head; ++c) {
        const int64_t at = (h * per_head + c) * R + r;
        if (maxes[at] == neg_inf) continue;
        const acc_t w = std::exp(maxes[at] - m);
        total += sums[at] * w;
        const acc_t* part = outs.get() + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] += part[d] * w;
      }
      const acc_t inv = acc_t(1) / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

// query: [H_kv, R, D] float32, float64 or bfloat16, contiguous (the query heads of each
// KV head folded into rows), not scaled; scale: the softmax scale; key/value: [1, H_kv,
// L, D], D contiguous, float32, float64, bfloat16 or float16; prefix: keys [0, prefix)
// seen by all rows; tree_mask: None (all L keys seen by all rows) or [n, n] bool for
// keys [prefix, prefix + n) (row r uses row r % n). Returns [H_kv, R, D], float64 for a
// float64 query, else float32.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t prefix,
                            const c10::optional<at::Tensor>& tree_mask, int64_t chunk_size, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "decode_attention: query must be [H_kv, R, D] contiguous");
  TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.size(0) == 1, "decode_attention: key/value must be [1, H_kv, L, D]");
  TORCH_CHECK(key.size(1) == query.size(0) && key.size(3) == query.size(2), "decode_attention: shapes disagree");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "decode_attention: key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "decode_attention: key/value dtypes differ");
  TORCH_CHECK(chunk_size >= 1, "decode_attention: chunk_size must be >= 1");
  const bool* mask = nullptr;
  int64_t n = 0;
  at::Tensor mask_c;
  if (tree_mask.has_value()) {
    mask_c = tree_mask->to(at::kBool).contiguous();
    n = mask_c.size(0);
    TORCH_CHECK(mask_c.dim() == 2 && mask_c.size(1) == n && prefix + n == key.size(2),
                "decode_attention: tree_mask must be [n, n] with prefix + n keys");
    mask = mask_c.data_ptr<bool>();
  }
  const bool wide = query.scalar_type() == at::kDouble;
  TORCH_CHECK(wide || query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "decode_attention: query must be float32, float64 or bfloat16");
  // the query scaled, in the accumulation type: one loop here, not two ATen operators (the
  // conversion and the product each dispatched, ~40% of a call's fixed cost over few keys)
  at::Tensor scaled = at::empty(query.sizes(), query.options().dtype(wide ? at::kDouble : at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention_scale", [&] {
    const scalar_t* src = query.data_ptr<scalar_t>();
    const int64_t count = query.numel();
    if (wide) {
      double* dst = scaled.data_ptr<double>();
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<double>(src[i]) * scale;
    } else {
      float* dst = scaled.data_ptr<float>();
      const float factor = static_cast<float>(scale);
      for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(src[i]) * factor;
    }
  });
  const c10::BFloat16* qb = query.scalar_type() == at::kBFloat16 ? query.data_ptr<c10::BFloat16>() : nullptr;
  auto out = at::empty_like(scaled);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "decode_attention", [&] {
    if (wide)
      run<scalar_t, double>(scaled, nullptr, 1.0f, key, value, prefix, mask, n, chunk_size, out);
    else
      run<scalar_t, float>(scaled, qb, static_cast<float>(scale), key, value, prefix, mask, n, chunk_size, out);
  });
  return out;
}

// decode_attention for a query as a layer hands it ([1, H_q, n, D], any strides, any
// floating dtype): its query heads folded into each KV head's rows, the result back as
// [1, n, H_q, D] in the query's dtype (tokenswift.kernels.decode_attention, and
// staged_attention, in one operator call each).
at::Tensor decode_attention_heads(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t prefix,
                                  const c10::optional<at::Tensor>& tree_mask, int64_t chunk_size, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.dim() == 4, "decode_attention: query must be [1, H_q, n, D]");
  const int64_t q_heads = query.size(1), n = query.size(2), D = query.size(3), kv_heads = key.size(1);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "decode_attention: query heads must be a multiple of the KV heads");
  at::Tensor folded = query.reshape({kv_heads, (q_heads / kv_heads) * n, D});
  const auto dtype = folded.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kBFloat16) folded = folded.to(at::kFloat);
  at::Tensor out = decode_attention(folded.contiguous(), key, value, prefix, tree_mask, chunk_size, scale);
  return out.reshape({1, q_heads, n, D}).transpose(1, 2).to(query.scalar_type()).contiguous();
}

// One layer of a verify forward's attention, what the Python fast path
// (tokenswift.model.attention._StagedKernel) did in ten operator calls: the new tokens'
// key/value ([1, H_kv, n, D]) written into the store's layer (store_keys/store_values
// [1, H_kv, capacity, D]) at [prefix, prefix + n), then query ([1, H_q, n, D]) attended
// over positions [0, prefix + n) by decode_attention_heads. On a 2-core Sapphire Rapids,
// compiled SmolLM2 forwards at 2K positions in turns in one process: 1 token 24.0-24.4 ms
// against 25.3-26.1 through the Python path, a 5-token tree 28.4-29.5 against 30.5-31.0
// (its ten calls a layer ~40 us, this one ~12).
at::Tensor staged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            at::Tensor store_keys, at::Tensor store_values, int64_t prefix,
                            const c10::optional<at::Tensor>& tree_mask, int64_t chunk_size, double scale) {
  TORCH_CHECK(key.dim() == 4 && key.sizes() == value.sizes() && query.dim() == 4 && key.size(2) == query.size(2),
              "staged_attention: key/value must be [1, H_kv, n, D] for the query's n tokens");
  const int64_t n = key.size(2);
  TORCH_CHECK(store_keys.dim() == 4 && store_keys.sizes() == store_values.sizes() && store_keys.size(1) == key.size(1),
              "staged_attention: the store's keys/values must be [1, H_kv, capacity, D]");
  TORCH_CHECK(prefix >= 0 && prefix + n <= store_keys.size(2),
              "staged_attention: positions [", prefix, ", ", prefix + n, ") past the store's capacity ", store_keys.size(2));
  store_keys.slice(2, prefix, prefix + n).copy_(key);
  store_values.slice(2, prefix, prefix + n).copy_(value);
  return decode_attention_heads(query, store_keys.slice(2, 0, prefix + n), store_values.slice(2, 0, prefix + n), prefix,
                                tree_mask, chunk_size, scale);
}

// A step's kept positions compacted in every layer's keys and values at once: in each
// buffer ([1, H_kv, capacity, D], rows of D contiguous), row length + kept[i] of every
// head moved to row length + i. kept ascending with kept[i] >= i, so moving in order never
// overwrites a row still to be moved. What KVStore.commit did with an index_select and a
// copy per buffer (60 for SmolLM2, ~0.5 ms a step).
void compact_positions(at::TensorList buffers, at::IntArrayRef kept, int64_t length) {
  for (size_t i = 0; i < kept.size(); ++i)
    TORCH_CHECK(kept[i] >= static_cast<int64_t>(i) && (i == 0 || kept[i] > kept[i - 1]),
                "compact_positions: kept must be ascending staged positions");
  for (const at::Tensor& buf : buffers) {
    TORCH_CHECK(buf.dim() == 4 && buf.size(0) == 1 && buf.stride(3) == 1 && buf.device().is_cpu(),
                "compact_positions: buffers must be [1, H, capacity, D] on the CPU with rows of D contiguous");
    const int64_t row_bytes = buf.size(3) * static_cast<int64_t>(buf.element_size());
    TORCH_CHECK(kept.empty() || length + kept.back() < buf.size(2), "compact_positions: kept positions past the buffer");
    char* base = static_cast<char*>(buf.data_ptr());
    const int64_t head_bytes = buf.stride(1) * static_cast<int64_t>(buf.element_size());
    const int64_t pos_bytes = buf.stride(2) * static_cast<int64_t>(buf.element_size());
    for (int64_t h = 0; h < buf.size(1); ++h)
      for (size_t i = 0; i < kept.size(); ++i)
        if (kept[i] != static_cast<int64_t>(i))
          std::memmove(base + h * head_bytes + (length + static_cast<int64_t>(i)) * pos_bytes,
                       base + h * head_bytes + (length + kept[i]) * pos_bytes, row_bytes);
  }
}

}  // namespace

TORCH_LIBRARY(tokenswift_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, int prefix, Tensor? tree_mask, int chunk_size, float scale) -> Tensor");
  m.def("decode_attention_heads(Tensor query, Tensor key, Tensor value, int prefix, Tensor? tree_mask, int chunk_size, float scale) -> Tensor");
  m.def("staged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) store_keys, Tensor(b!) store_values, "
        "int prefix, Tensor? tree_mask, int chunk_size, float scale) -> Tensor");
  m.def("compact_positions(Tensor(a!)[] buffers, int[] kept, int length) -> ()");
}

TORCH_LIBRARY_IMPL(tokenswift_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_heads", &decode_attention_heads);
  m.impl("staged_attention", &staged_attention);
  m.impl("compact_positions", &compact_positions);
}
