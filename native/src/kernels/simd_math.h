// The attention core's inner loops over a head dimension or a block of scores: dots (one row, four rows), the
// weighted sum of a block of rows, row conversion from the storage type, and an in-place exp. AVX2 + FMA + F16C
// where the build enables them (native/CMakeLists.txt compiles kv_attention.cpp for the building machine), scalar
// otherwise.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLMPIPE_AVX2 1
#endif

// The ISA is part of every name here: a file built without these flags that includes this header gets its own
// copies, never the linker's pick of another file's (an inline function is one symbol across files).
#if defined(LLMPIPE_AVX2)
#define LLMPIPE_SIMD_ISA isa_avx2
#else
#define LLMPIPE_SIMD_ISA isa_scalar
#endif

namespace llmrt::kv::simd {
inline namespace LLMPIPE_SIMD_ISA {

#ifdef LLMPIPE_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

// How the elements of a K/V row load as fp32, by storage type: one at a time, and (AVX2) eight at a time. The
// loops below take rows of any of them and convert in registers, so a half row is never copied to fp32 first
// (the same values: the conversions are exact).
struct F32Rows {
  using E = float;
  static float one(float x) { return x; }
#ifdef LLMPIPE_AVX2
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
#endif
};
inline float half_to_float(uint16_t h);
struct F16Rows {
  using E = uint16_t;
  static float one(uint16_t x) { return half_to_float(x); }
#if defined(LLMPIPE_AVX2) && defined(__F16C__)
  static __m256 eight(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#elif defined(LLMPIPE_AVX2)
  static __m256 eight(const uint16_t* p) {
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = half_to_float(p[i]);
    return _mm256_load_ps(f);
  }
#endif
};
struct BF16Rows {
  using E = uint16_t;
  static float one(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
#ifdef LLMPIPE_AVX2
  static __m256 eight(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
#endif
};

// sum_d a[d] * b[d]
template <class R = F32Rows>
inline float dot(const float* a, const typename R::E* b, int64_t n) {
  int64_t d = 0;
  float tail = 0.f;
#ifdef LLMPIPE_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), R::eight(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), R::eight(b + d + 8), s1);
  }
  for (; d + 8 <= n; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), R::eight(b + d), s0);
  tail = hsum(_mm256_add_ps(s0, s1));
#endif
  for (; d < n; ++d) tail += a[d] * R::one(b[d]);
  return tail;
}

// out[j] = sum_d q[d] * k[j][d] for four rows k[0..3]: one pass over q, one reduction for the four
template <class R = F32Rows>
inline void dot4(const float* q, const typename R::E* const* k, int64_t n, float* out) {
  int64_t d = 0;
  float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
#ifdef LLMPIPE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, R::eight(k[0] + d), a0);
    a1 = _mm256_fmadd_ps(x, R::eight(k[1] + d), a1);
    a2 = _mm256_fmadd_ps(x, R::eight(k[2] + d), a2);
    a3 = _mm256_fmadd_ps(x, R::eight(k[3] + d), a3);
  }
  // [a0 a1 a2 a3] lane sums: two horizontal adds, then the 128-bit halves
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  alignas(16) float r[4];
  _mm_store_ps(r, s);
  t0 = r[0], t1 = r[1], t2 = r[2], t3 = r[3];
#endif
  for (; d < n; ++d) {
    t0 += q[d] * R::one(k[0][d]);
    t1 += q[d] * R::one(k[1][d]);
    t2 += q[d] * R::one(k[2][d]);
    t3 += q[d] * R::one(k[3][d]);
  }
  out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

// acc[d] += sum_j w[j] * rows[j][d], the accumulators held in registers across the rows (32 columns at a time)
// (off: the rows' first column, for a caller that did the columns before it)
template <class R = F32Rows>
inline void accumulate_rows(float* acc, const float* w, const typename R::E* const* rows, int64_t nrows, int64_t n,
                            int64_t off = 0) {
  int64_t d = 0;
#ifdef LLMPIPE_AVX2
  for (; d + 32 <= n; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8), a2 = _mm256_loadu_ps(acc + d + 16),
           a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t j = 0; j < nrows; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const typename R::E* r = rows[j] + off + d;
      a0 = _mm256_fmadd_ps(wj, R::eight(r), a0);
      a1 = _mm256_fmadd_ps(wj, R::eight(r + 8), a1);
      a2 = _mm256_fmadd_ps(wj, R::eight(r + 16), a2);
      a3 = _mm256_fmadd_ps(wj, R::eight(r + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= n; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < nrows; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), R::eight(rows[j] + off + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
#endif
  for (; d < n; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < nrows; ++j) a += w[j] * R::one(rows[j][off + d]);
    acc[d] = a;
  }
}

// The same sums for HB query heads at once (a GQA group shares its K/V rows), so a row is read once for all of
// them and HB x 4 (scores) or HB x C (weighted sums) accumulators run side by side instead of one FMA chain
// waiting on the last. Each accumulator still adds its products in dot4's / accumulate_rows' order, and reduces
// the same way: the bits of calling those once per head.

// sc[h * ld + j] = sum_d q[h * D + d] * k[j][d], h < HB, j < 4
template <int HB, class R = F32Rows>
inline void dot4_heads(const float* q, int64_t D, const typename R::E* const* k, float* sc, int64_t ld) {
#ifdef LLMPIPE_AVX2
  __m256 a[HB][4];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 k0 = R::eight(k[0] + d), k1 = R::eight(k[1] + d), k2 = R::eight(k[2] + d),
                 k3 = R::eight(k[3] + d);
    for (int h = 0; h < HB; ++h) {
      const __m256 x = _mm256_loadu_ps(q + h * D + d);
      a[h][0] = _mm256_fmadd_ps(x, k0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(x, k1, a[h][1]);
      a[h][2] = _mm256_fmadd_ps(x, k2, a[h][2]);
      a[h][3] = _mm256_fmadd_ps(x, k3, a[h][3]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[h][0], a[h][1]), _mm256_hadd_ps(a[h][2], a[h][3]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    alignas(16) float r[4];
    _mm_store_ps(r, s);
    const float* qh = q + h * D;
    for (int j = 0; j < 4; ++j) {
      float x = r[j];
      for (int64_t e = d; e < D; ++e) x += qh[e] * R::one(k[j][e]);
      sc[h * ld + j] = x;
    }
  }
#else
  for (int h = 0; h < HB; ++h) dot4<R>(q + h * D, k, D, sc + h * ld);
#endif
}

// acc[h * lda + d] += sum_j w[h * ldw + j] * rows[j][d], h < HB: C chunks of 8 columns at a time
template <int HB, int C, class R = F32Rows>
inline void accumulate_rows_heads(float* acc, int64_t lda, const float* w, int64_t ldw,
                                  const typename R::E* const* rows, int64_t nrows, int64_t n) {
  int64_t d = 0;
#ifdef LLMPIPE_AVX2
  for (; d + 8 * C <= n; d += 8 * C) {
    __m256 a[HB][C];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = _mm256_loadu_ps(acc + h * lda + d + 8 * c);
    for (int64_t j = 0; j < nrows; ++j) {
      __m256 r[C];
      for (int c = 0; c < C; ++c) r[c] = R::eight(rows[j] + d + 8 * c);
      for (int h = 0; h < HB; ++h) {
        const __m256 wj = _mm256_set1_ps(w[h * ldw + j]);
        for (int c = 0; c < C; ++c) a[h][c] = _mm256_fmadd_ps(wj, r[c], a[h][c]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + h * lda + d + 8 * c, a[h][c]);
  }
#endif
  if (d < n)
    for (int h = 0; h < HB; ++h) accumulate_rows<R>(acc + h * lda + d, w + h * ldw, rows, nrows, n - d, d);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// y[d] = x[d] as fp32, d < n, from a row of storage type R
template <class R>
inline void to_float_row(const typename R::E* x, float* y, int64_t n) {
  int64_t d = 0;
#ifdef LLMPIPE_AVX2
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(y + d, R::eight(x + d));
#endif
  for (; d < n; ++d) y[d] = R::one(x[d]);
}

#ifdef LLMPIPE_AVX2
// exp on 8 lanes, inputs <= 0 (scores minus their max): 2^n * p(r), r in [-ln2/2, ln2/2], relative error ~2e-7
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.98756912e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.39819994e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33345205e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16657962e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666657e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// x[i] *= c
inline void scale_row(float* x, int64_t n, float c) {
  int64_t i = 0;
#ifdef LLMPIPE_AVX2
  const __m256 vc = _mm256_set1_ps(c);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vc));
#endif
  for (; i < n; ++i) x[i] *= c;
}

// the largest of m and x[0..n), a NaN in x ignored as std::max(m, x[i]) ignores it (a scalar loop here kept its
// running max in memory: 18 % of a decode step's attention)
inline float max_of(const float* x, int64_t n, float m) {
  int64_t i = 0;
#ifdef LLMPIPE_AVX2
  if (n >= 8) {
    __m256 v = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) v = _mm256_max_ps(_mm256_loadu_ps(x + i), v);  // NaN in x: keeps v
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    h = _mm_max_ps(_mm_movehl_ps(h, h), h);
    h = _mm_max_ss(_mm_movehdup_ps(h), h);
    m = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - m); returns the sum
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef LLMPIPE_AVX2
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

}  // inline namespace
}  // namespace llmrt::kv::simd
