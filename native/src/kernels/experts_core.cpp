// llmpipe::experts' projection (experts_kernel.cpp; the numerics are its header's), compiled once per ISA path
// (kernels/isa.h). The int8 dots are exact integers and the other sums float64 rounded once, so every path gives the
// same bits: avx2 / avx512 take 16 products an instruction (vpmaddwd, 8 weight rows at a time), neon 8 (smlal),
// dotprod 16 (sdot over the activations' two int8 halves), scalar one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/cores.h"
#include "kernels/experts_core.h"

namespace llmrt::experts::LLMPIPE_ISA_NS {
namespace {

// Rows x [n][in] quantized to int8 as torchao's choose_qparams_affine (asymmetric, the range widened to include 0,
// scale clamped to the smallest normal) and quantize_affine (round half to even of x * (1 / scale), plus the zero
// point, clamped) compute it in fp32: q - zero point into qz [n][in] (|q - zp| <= 255), each row's scale into rs.
void quantize_rows(const float* x, int64_t n, int64_t in, int16_t* qz, float* rs) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * in;
    float lo = 0.f, hi = 0.f;
    for (int64_t i = 0; i < in; ++i) lo = std::min(lo, row[i]), hi = std::max(hi, row[i]);
    const float scale = std::max((hi - lo) / 255.f, 1.17549435e-38f);
    const float zp = std::clamp(-128.f - std::nearbyint(lo / scale), -128.f, 127.f);
    const float inv = 1.f / scale;
    for (int64_t i = 0; i < in; ++i)
      qz[r * in + i] = static_cast<int16_t>(std::clamp(std::nearbyint(row[i] * inv) + zp, -128.f, 127.f) - zp);
    rs[r] = scale;
  }
}

// sum a[i] * w[i], exact in int32 (|a| <= 255, |w| <= 127): in any order the same integer
inline int32_t idot(const int16_t* a, const int8_t* w, int64_t n) {
  int32_t acc = 0;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256i sum = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {  // 16 products, summed in pairs into 8 int32 lanes (vpmaddwd)
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(av, wv));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  acc = _mm_cvtsi128_si32(h);
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  // a = 256 hi + lo, both int8 (|a| <= 255: hi in [-1, 1]), so two sdot give the same integer
  int32x4_t h = vdupq_n_s32(0), l = vdupq_n_s32(0);
  for (; i + 16 <= n; i += 16) {
    const int16x8_t a0 = vld1q_s16(a + i), a1 = vld1q_s16(a + i + 8);
    const int16x8_t l0 = vsubq_s16(vandq_s16(vaddq_s16(a0, vdupq_n_s16(128)), vdupq_n_s16(255)), vdupq_n_s16(128));
    const int16x8_t l1 = vsubq_s16(vandq_s16(vaddq_s16(a1, vdupq_n_s16(128)), vdupq_n_s16(255)), vdupq_n_s16(128));
    const int8x16_t lo = vcombine_s8(vmovn_s16(l0), vmovn_s16(l1));
    const int8x16_t hi = vcombine_s8(vmovn_s16(vshrq_n_s16(vsubq_s16(a0, l0), 8)),
                                     vmovn_s16(vshrq_n_s16(vsubq_s16(a1, l1), 8)));
    const int8x16_t wv = vld1q_s8(w + i);
    h = vdotq_s32(h, hi, wv);
    l = vdotq_s32(l, lo, wv);
  }
  acc = 256 * vaddvq_s32(h) + vaddvq_s32(l);
#elif defined(__aarch64__) && defined(__ARM_NEON)
  int32x4_t s0 = vdupq_n_s32(0), s1 = vdupq_n_s32(0);
  for (; i + 8 <= n; i += 8) {  // 8 products: the int8 weights widened, multiplied and added into 4 int32 lanes twice
    const int16x8_t av = vld1q_s16(a + i), wv = vmovl_s8(vld1_s8(w + i));
    s0 = vmlal_s16(s0, vget_low_s16(av), vget_low_s16(wv));
    s1 = vmlal_high_s16(s1, av, wv);
  }
  acc = vaddvq_s32(vaddq_s32(s0, s1));
#endif
  for (; i < n; ++i) acc += static_cast<int32_t>(a[i]) * static_cast<int32_t>(w[i]);
  return acc;
}

#if defined(__AVX2__)
// The exact int32 dots of 8 consecutive weight rows (w, rows `in` apart) with a (n elements, a multiple of 16), as
// one vector [row 0 .. row 7]: 8 rows share each activation load, and one horizontal-add tree replaces 8 reductions.
inline __m256i dots8(const int16_t* a, const int8_t* w, int64_t in, int64_t n) {
  __m256i v[8];
  for (auto& x : v) x = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    for (int k = 0; k < 8; ++k) {
      const __m128i wk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * in + i));
      v[k] = _mm256_add_epi32(v[k], _mm256_madd_epi16(av, _mm256_cvtepi8_epi16(wk)));
    }
  }
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // u0 holds rows 0-3 twice (one partial per 128-bit half), u1 rows 4-7: the halves added
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// y rows ob..ob+7 of one input row (its int16 activations a, row scale rs): per group the 8 exact dots, times the
// groups' scales, summed in float64 (a product, then a sum: the twin's order per group); true if it ran
bool rows8_int(const int16_t* a, const int8_t* w, const float* sc, int64_t in, int64_t groups, double rs,
               double* acc) {
  const int64_t group = in / groups;
  if (group % 16) return false;
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i d = dots8(a + g * group, w + g * group, in, group);
    alignas(32) float s8[8];
    for (int k = 0; k < 8; ++k) s8[k] = sc[k * groups + g];
    const __m256 s = _mm256_load_ps(s8);
    lo = _mm256_add_pd(lo, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)),
                                         _mm256_cvtepi32_pd(_mm256_castsi256_si128(d))));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)),
                                         _mm256_cvtepi32_pd(_mm256_extracti128_si256(d, 1))));
  }
  const __m256d r = _mm256_set1_pd(rs);
  _mm256_storeu_pd(acc, _mm256_mul_pd(lo, r));
  _mm256_storeu_pd(acc + 4, _mm256_mul_pd(hi, r));
  return true;
}
#endif

// rows [n][in] of 4-bit pairs (in / 2 bytes a row) unpacked to int8 values
void unpack4(const uint8_t* w4, int64_t rows, int64_t in, int8_t* out) {
  for (int64_t i = 0; i < rows * in / 2; ++i) {
    out[2 * i] = static_cast<int8_t>((w4[i] & 0x0F) - 8);
    out[2 * i + 1] = static_cast<int8_t>((w4[i] >> 4) - 8);
  }
}

// Sums in float64, rounded to fp32 once: every product of an fp32 and a weight is exact in float64, and a sum of
// them differs from the twin's (torch's float64 matmul, in its own order) by far less than an fp32 step, so the two
// give the same fp32 bits but at the rarest ties, wherever the order.
template <class W>
double dot(const float* x, const W* w, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(w[i]);
  return acc;
}

// y [n][out] = fp32(x [n][in] W_e^T + b_e), output rows over the thread pool. With dynamic activations (act_quant)
// each group's dot is exact in int32 (int8 activations minus their zero point, times int8 weights) and scaled by the
// weight group's and the row's scales in float64; otherwise the sums are float64 (dot). Both rounded to fp32 once.
}  // namespace

void project(const Proj& p, int64_t e, const float* x, int64_t n, float* y, std::vector<int16_t>& qz,
             std::vector<float>& rs) {
  const int64_t in = p.in, group = in / p.groups;
  const bool ints = p.act_quant;  // load_proj: dynamic activations come with int8 weights
  if (ints) {
    qz.resize(n * in), rs.resize(n);
    quantize_rows(x, n, in, qz.data(), rs.data());
  }
  // kRows output rows at a time: their dots are independent chains, which the core overlaps (one row at a time,
  // each group's dot waits on the last: bound by latency, not by the weights' bandwidth)
  constexpr int64_t kRows = 8;
  constexpr int64_t kAhead = 1;  // 4 and 8 blocks ahead measured no faster (bench/moe.py --hidden 1024)
  auto rows = [&](int64_t o0, int64_t o1) {
    std::vector<int8_t> unpacked(p.w4 ? static_cast<size_t>(kRows * in) : 0);  // a block's 4-bit rows as int8
    for (int64_t ob = o0; ob < o1; ob += kRows) {
      const int64_t nr = std::min(kRows, o1 - ob);
      const int64_t ahead = ob + kAhead * kRows;  // a block this many ahead, asked for while this one computes
      if (ahead < o1 && !p.wf) {
        const int64_t bytes = std::min(kRows, o1 - ahead) * (p.w4 ? in / 2 : in);
        const void* next = p.w4 ? static_cast<const void*>(p.w4 + (e * p.out + ahead) * in / 2)
                                : static_cast<const void*>(p.wq + (e * p.out + ahead) * in);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(next) + b, 0, 0);
      }
      const int8_t* wblock = p.wq ? p.wq + (e * p.out + ob) * in : nullptr;
      if (p.w4) {
        unpack4(p.w4 + (e * p.out + ob) * in / 2, nr, in, unpacked.data());
        wblock = unpacked.data();
      }
      for (int64_t r = 0; r < n; ++r) {
        double acc[kRows] = {};
        bool scaled = false;  // acc already times the row's scale
#if defined(__AVX2__)
        if (ints && nr == kRows)
          scaled = rows8_int(qz.data() + r * in, wblock, p.s + (e * p.out + ob) * p.groups, in, p.groups,
                             static_cast<double>(rs[r]), acc);
#endif
        for (int64_t k = 0; k < nr; ++k)
          if (p.wf) acc[k] = dot(x + r * in, p.wf + (e * p.out + ob + k) * in, in);
        if (!p.wf && !scaled) {
          const int8_t* w = wblock;
          const float* sc = p.s + (e * p.out + ob) * p.groups;
          for (int64_t g = 0; g < p.groups; ++g)
            for (int64_t k = 0; k < nr; ++k) {
              const int8_t* wk = w + k * in + g * group;
              const double d = ints ? static_cast<double>(idot(qz.data() + r * in + g * group, wk, group))
                                    : dot(x + r * in + g * group, wk, group);
              acc[k] += static_cast<double>(sc[k * p.groups + g]) * d;
            }
        }
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t row = e * p.out + ob + k;
          const double v = ints && !scaled ? acc[k] * static_cast<double>(rs[r]) : acc[k];
          y[r * p.out + ob + k] = static_cast<float>(v + (p.b ? static_cast<double>(p.b[row]) : 0.0));
        }
      }
    }
  };
  // about 16K multiply-adds per task at the least
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, n * in));
  executorch::extension::parallel_for(0, p.out, grain, rows);
}

}  // namespace llmrt::experts::LLMPIPE_ISA_NS
