// The attention core's inner loops over a head dimension or a block of scores: dots (one row, four rows), the
// weighted sum of a block of rows, row conversion from the storage type, and an in-place exp. Written once over an
// 8-lane fp32 vector, V8: AVX2 + FMA + F16C registers on x86-64, a pair of NEON registers on ARM64, with the same
// operations in the same order (fused multiply-adds, the same reduction trees, the same exp polynomial), so the two
// give the same bits; without either (the scalar path, each kernel's twin) the plain loops after the vector ones.
// Which one a copy gets is the compiler's flags (native/CMakeLists.txt builds a copy per path: kernels/isa.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && !defined(LLMPIPE_NO_SIMD)
#include <immintrin.h>
#define LLMPIPE_AVX2 1
#define LLMPIPE_V8 1
#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(LLMPIPE_NO_SIMD)
#include <arm_neon.h>
#define LLMPIPE_NEON 1
#define LLMPIPE_V8 1
#endif

// The path is part of every name here: a file built for another path that includes this header gets its own
// copies, never the linker's pick of another file's (an inline function is one symbol across files).
#ifndef LLMPIPE_ISA_NS
#define LLMPIPE_ISA_NS isa_default
#endif

namespace llmrt::kv::simd {
inline namespace LLMPIPE_ISA_NS {

#ifdef LLMPIPE_AVX2
struct V8 {
  __m256 v;
};
inline V8 zero8() { return {_mm256_setzero_ps()}; }
inline V8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store8(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
inline V8 splat8(float x) { return {_mm256_set1_ps(x)}; }
inline V8 fma8(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c, one rounding
inline V8 fnma8(V8 a, V8 b, V8 c) { return {_mm256_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b, one rounding
inline V8 add8(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 sub8(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 mul8(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 max8(V8 x, V8 keep) { return {_mm256_max_ps(x.v, keep.v)}; }  // a NaN in x keeps `keep`
// lanes 0-3 + lanes 4-7, then (0 + 2) + (1 + 3)
inline float hsum(V8 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float hmax(V8 a) {
  __m128 h = _mm_max_ps(_mm256_extractf128_ps(a.v, 1), _mm256_castps256_ps128(a.v));
  h = _mm_max_ps(_mm_movehl_ps(h, h), h);
  h = _mm_max_ss(_mm_movehdup_ps(h), h);
  return _mm_cvtss_f32(h);
}
// r[j] = ((aj0 + aj1) + (aj2 + aj3)) + ((aj4 + aj5) + (aj6 + aj7)) for the four vectors a0..a3
inline void hsum4(V8 a0, V8 a1, V8 a2, V8 a3, float* r) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0.v, a1.v), _mm256_hadd_ps(a2.v, a3.v));
  _mm_storeu_ps(r, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
// 2^n for integral n in [-126, 127] times p, and n = round-to-nearest-even(x)
inline V8 round8(V8 x) { return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V8 scale_pow2(V8 p, V8 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return {_mm256_mul_ps(p.v, _mm256_castsi256_ps(e))};
}
inline V8 f16x8(const uint16_t* p) {
#ifdef __F16C__
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
#else
#error "the AVX2 path needs F16C (native/CMakeLists.txt builds it with -mf16c)"
#endif
}
inline V8 bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline V8 i8x8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
}
// eight 4-bit values at p (four bytes, element 2i the low nibble), each stored + 8
inline V8 i4x8(const uint8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  const __m128i b = _mm_cvtsi32_si128(w), m = _mm_set1_epi8(0x0F);
  const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_sub_epi8(x, _mm_set1_epi8(8))))};
}
inline float half1(uint16_t h) { return _cvtsh_ss(h); }
#endif

#ifdef LLMPIPE_NEON
struct V8 {
  float32x4_t lo, hi;  // lanes 0-3, 4-7
};
inline V8 zero8() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline V8 load8(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store8(float* p, V8 a) { vst1q_f32(p, a.lo), vst1q_f32(p + 4, a.hi); }
inline V8 splat8(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
inline V8 fma8(V8 a, V8 b, V8 c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline V8 fnma8(V8 a, V8 b, V8 c) { return {vfmsq_f32(c.lo, a.lo, b.lo), vfmsq_f32(c.hi, a.hi, b.hi)}; }
inline V8 add8(V8 a, V8 b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline V8 sub8(V8 a, V8 b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline V8 mul8(V8 a, V8 b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
// maxNum: a NaN in x keeps `keep`, as x86's max does with x first
inline V8 max8(V8 x, V8 keep) { return {vmaxnmq_f32(x.lo, keep.lo), vmaxnmq_f32(x.hi, keep.hi)}; }
inline float hsum(V8 a) {
  const float32x4_t s = vaddq_f32(a.lo, a.hi);
  const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));  // (0 + 2), (1 + 3)
  return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}
inline float hmax(V8 a) { return vmaxnmvq_f32(vmaxnmq_f32(a.lo, a.hi)); }
inline void hsum4(V8 a0, V8 a1, V8 a2, V8 a3, float* r) {
  const float32x4_t lo = vpaddq_f32(vpaddq_f32(a0.lo, a1.lo), vpaddq_f32(a2.lo, a3.lo));
  const float32x4_t hi = vpaddq_f32(vpaddq_f32(a0.hi, a1.hi), vpaddq_f32(a2.hi, a3.hi));
  vst1q_f32(r, vaddq_f32(lo, hi));
}
inline V8 round8(V8 x) { return {vrndnq_f32(x.lo), vrndnq_f32(x.hi)}; }
inline V8 scale_pow2(V8 p, V8 n) {
  const int32x4_t b = vdupq_n_s32(127);
  const int32x4_t elo = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.lo), b), 23);
  const int32x4_t ehi = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n.hi), b), 23);
  return {vmulq_f32(p.lo, vreinterpretq_f32_s32(elo)), vmulq_f32(p.hi, vreinterpretq_f32_s32(ehi))};
}
inline V8 f16x8(const uint16_t* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline V8 bf16x8(const uint16_t* p) {
  const uint16x8_t w = vld1q_u16(p);
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(w), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(w, 16))};
}
inline V8 i8x8(const int8_t* p) {
  const int16x8_t w = vmovl_s8(vld1_s8(p));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_high_s16(w))};
}
inline V8 i4x8(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(w));
  const uint8x8_t x = vzip1_u8(vand_u8(b, vdup_n_u8(0x0F)), vshr_n_u8(b, 4));  // lo0 hi0 lo1 hi1 ...
  const int16x8_t v = vmovl_s8(vsub_s8(vreinterpret_s8_u8(x), vdup_n_s8(8)));
  return {vcvtq_f32_s32(vmovl_s16(vget_low_s16(v))), vcvtq_f32_s32(vmovl_high_s16(v))};
}
inline float half1(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
#endif

// How element i of a K/V row (its first element at p) loads as fp32, by storage type: one at a time, and (V8) eight
// at a time from an i that is a multiple of 8. The loops below take rows of any of them and convert in registers, so
// a half or quantized row is never copied to fp32 first (the same values: the float conversions are exact, a
// quantized value times its group's scale rounds once, as the Python twin's dequantization does).
struct F32Rows {
  using E = float;
  static float one(const float* p, int64_t i) { return p[i]; }
#ifdef LLMPIPE_V8
  static V8 eight(const float* p, int64_t i) { return load8(p + i); }
#endif
};
inline float half_to_float(uint16_t h);
struct F16Rows {
  using E = uint16_t;
  static float one(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }
#ifdef LLMPIPE_V8
  static V8 eight(const uint16_t* p, int64_t i) { return f16x8(p + i); }
#endif
};
struct BF16Rows {
  using E = uint16_t;
  static float one(const uint16_t* p, int64_t i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
#ifdef LLMPIPE_V8
  static V8 eight(const uint16_t* p, int64_t i) { return bf16x8(p + i); }
#endif
};
// int8 values in groups of 32, each group's fp32 scale stored before the values, the first group's nearest
// (kv_attention.h): the scale of element i sits 4 * (i / 32 + 1) bytes before the values.
struct I8Rows {
  using E = int8_t;
  static float scale(const int8_t* p, int64_t i) {
    float s;
    std::memcpy(&s, p - 4 * (i / 32 + 1), 4);
    return s;
  }
  static float one(const int8_t* p, int64_t i) { return static_cast<float>(p[i]) * scale(p, i); }
#ifdef LLMPIPE_V8
  static V8 eight(const int8_t* p, int64_t i) { return mul8(i8x8(p + i), splat8(scale(p, i))); }
#endif
};

// int4 values (two a byte, + 8) in groups of 32, each group's fp16 scale stored before the values, the first
// group's nearest (kv_attention.h): the scale of element i sits 2 * (i / 32 + 1) bytes before the values. The row is
// in the rotated basis; the core rotates queries and outputs to match.
struct I4Rows {
  using E = uint8_t;
  static float scale(const uint8_t* p, int64_t i) {
    uint16_t h;
    std::memcpy(&h, p - 2 * (i / 32 + 1), 2);
#ifdef LLMPIPE_V8
    return half1(h);
#else
    return half_to_float(h);
#endif
  }
  static float one(const uint8_t* p, int64_t i) {
    return static_cast<float>(((p[i / 2] >> (4 * (i % 2))) & 0x0F) - 8) * scale(p, i);
  }
#ifdef LLMPIPE_V8
  static V8 eight(const uint8_t* p, int64_t i) { return mul8(i4x8(p + i / 2), splat8(scale(p, i))); }
#endif
};

// sum_d a[d] * b[d]
template <class R = F32Rows>
inline float dot(const float* a, const typename R::E* b, int64_t n) {
  int64_t d = 0;
  float tail = 0.f;
#ifdef LLMPIPE_V8
  V8 s0 = zero8(), s1 = zero8();
  for (; d + 16 <= n; d += 16) {
    s0 = fma8(load8(a + d), R::eight(b, d), s0);
    s1 = fma8(load8(a + d + 8), R::eight(b, d + 8), s1);
  }
  for (; d + 8 <= n; d += 8) s0 = fma8(load8(a + d), R::eight(b, d), s0);
  tail = hsum(add8(s0, s1));
#endif
  for (; d < n; ++d) tail += a[d] * R::one(b, d);
  return tail;
}

// out[j] = sum_d q[d] * k[j][d] for four rows k[0..3]: one pass over q, one reduction for the four
template <class R = F32Rows>
inline void dot4(const float* q, const typename R::E* const* k, int64_t n, float* out) {
  int64_t d = 0;
  float t0 = 0.f, t1 = 0.f, t2 = 0.f, t3 = 0.f;
#ifdef LLMPIPE_V8
  V8 a0 = zero8(), a1 = zero8(), a2 = zero8(), a3 = zero8();
  for (; d + 8 <= n; d += 8) {
    const V8 x = load8(q + d);
    a0 = fma8(x, R::eight(k[0], d), a0);
    a1 = fma8(x, R::eight(k[1], d), a1);
    a2 = fma8(x, R::eight(k[2], d), a2);
    a3 = fma8(x, R::eight(k[3], d), a3);
  }
  float r[4];
  hsum4(a0, a1, a2, a3, r);
  t0 = r[0], t1 = r[1], t2 = r[2], t3 = r[3];
#endif
  for (; d < n; ++d) {
    t0 += q[d] * R::one(k[0], d);
    t1 += q[d] * R::one(k[1], d);
    t2 += q[d] * R::one(k[2], d);
    t3 += q[d] * R::one(k[3], d);
  }
  out[0] = t0, out[1] = t1, out[2] = t2, out[3] = t3;
}

// acc[d] += sum_j w[j] * rows[j][d], the accumulators held in registers across the rows (32 columns at a time)
// (off: the rows' first column, for a caller that did the columns before it)
template <class R = F32Rows>
inline void accumulate_rows(float* acc, const float* w, const typename R::E* const* rows, int64_t nrows, int64_t n,
                            int64_t off = 0) {
  int64_t d = 0;
#ifdef LLMPIPE_V8
  for (; d + 32 <= n; d += 32) {
    V8 a0 = load8(acc + d), a1 = load8(acc + d + 8), a2 = load8(acc + d + 16), a3 = load8(acc + d + 24);
    for (int64_t j = 0; j < nrows; ++j) {
      const V8 wj = splat8(w[j]);
      const typename R::E* r = rows[j];
      a0 = fma8(wj, R::eight(r, off + d), a0);
      a1 = fma8(wj, R::eight(r, off + d + 8), a1);
      a2 = fma8(wj, R::eight(r, off + d + 16), a2);
      a3 = fma8(wj, R::eight(r, off + d + 24), a3);
    }
    store8(acc + d, a0);
    store8(acc + d + 8, a1);
    store8(acc + d + 16, a2);
    store8(acc + d + 24, a3);
  }
  for (; d + 8 <= n; d += 8) {
    V8 a = load8(acc + d);
    for (int64_t j = 0; j < nrows; ++j) a = fma8(splat8(w[j]), R::eight(rows[j], off + d), a);
    store8(acc + d, a);
  }
#endif
  for (; d < n; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < nrows; ++j) a += w[j] * R::one(rows[j], off + d);
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
#ifdef LLMPIPE_V8
  V8 a[HB][4];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = zero8();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const V8 k0 = R::eight(k[0], d), k1 = R::eight(k[1], d), k2 = R::eight(k[2], d), k3 = R::eight(k[3], d);
    for (int h = 0; h < HB; ++h) {
      const V8 x = load8(q + h * D + d);
      a[h][0] = fma8(x, k0, a[h][0]);
      a[h][1] = fma8(x, k1, a[h][1]);
      a[h][2] = fma8(x, k2, a[h][2]);
      a[h][3] = fma8(x, k3, a[h][3]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    float r[4];
    hsum4(a[h][0], a[h][1], a[h][2], a[h][3], r);
    const float* qh = q + h * D;
    for (int j = 0; j < 4; ++j) {
      float x = r[j];
      for (int64_t e = d; e < D; ++e) x += qh[e] * R::one(k[j], e);
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
#ifdef LLMPIPE_V8
  for (; d + 8 * C <= n; d += 8 * C) {
    V8 a[HB][C];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) a[h][c] = load8(acc + h * lda + d + 8 * c);
    for (int64_t j = 0; j < nrows; ++j) {
      V8 r[C];
      for (int c = 0; c < C; ++c) r[c] = R::eight(rows[j], d + 8 * c);
      for (int h = 0; h < HB; ++h) {
        const V8 wj = splat8(w[h * ldw + j]);
        for (int c = 0; c < C; ++c) a[h][c] = fma8(wj, r[c], a[h][c]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) store8(acc + h * lda + d + 8 * c, a[h][c]);
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
#ifdef LLMPIPE_V8
  for (; d + 8 <= n; d += 8) store8(y + d, R::eight(x, d));
#endif
  for (; d < n; ++d) y[d] = R::one(x, d);
}

#ifdef LLMPIPE_V8
// exp on 8 lanes, inputs <= 0 (scores minus their max): 2^n * p(r), r in [-ln2/2, ln2/2], relative error ~2e-7
inline V8 exp8(V8 x) {
  x = max8(x, splat8(-87.f));
  const V8 n = round8(mul8(x, splat8(1.44269504f)));
  V8 r = fnma8(n, splat8(0.693145752f), x);
  r = fnma8(n, splat8(1.42860677e-6f), r);
  V8 p = splat8(1.98756912e-4f);
  p = fma8(p, r, splat8(1.39819994e-3f));
  p = fma8(p, r, splat8(8.33345205e-3f));
  p = fma8(p, r, splat8(4.16657962e-2f));
  p = fma8(p, r, splat8(1.66666657e-1f));
  p = fma8(p, r, splat8(0.5f));
  p = fma8(mul8(p, r), r, add8(r, splat8(1.f)));
  return scale_pow2(p, n);
}
#endif

// x[i] *= c
inline void scale_row(float* x, int64_t n, float c) {
  int64_t i = 0;
#ifdef LLMPIPE_V8
  const V8 vc = splat8(c);
  for (; i + 8 <= n; i += 8) store8(x + i, mul8(load8(x + i), vc));
#endif
  for (; i < n; ++i) x[i] *= c;
}

// the largest of m and x[0..n), a NaN in x ignored as std::max(m, x[i]) ignores it (a scalar loop here kept its
// running max in memory: 18 % of a decode step's attention)
inline float max_of(const float* x, int64_t n, float m) {
  int64_t i = 0;
#ifdef LLMPIPE_V8
  if (n >= 8) {
    V8 v = splat8(m);
    for (; i + 8 <= n; i += 8) v = max8(load8(x + i), v);  // NaN in x: keeps v
    m = hmax(v);
  }
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[i] = exp(x[i] - m); returns the sum
inline float exp_sub_sum(float* x, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef LLMPIPE_V8
  const V8 vm = splat8(m);
  V8 acc = zero8();
  for (; i + 8 <= n; i += 8) {
    const V8 e = exp8(sub8(load8(x + i), vm));
    store8(x + i, e);
    acc = add8(acc, e);
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
