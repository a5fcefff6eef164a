// llmpipe::tied_head's core (tied_head_kernel.cpp checks the arguments), compiled once per ISA path (kernels/isa.h):
// out[t][v] = float(sum_d xq[t][d] * w[v][d]) * scales[v] * xs[t], where xq is the activation row rounded to int16
// (|xq| <= 32639) and xs its scale. The sum is an exact integer on every path, converted to fp32 once, so every path
// gives the same bits; the paths differ only in how many products an instruction takes:
//   scalar: one; avx2: 16 (vpmaddwd); avx512: 32 (vpmaddwd, or vpdpwssd where the CPU has VNNI);
//   neon: 16 (int8 widened, smlal); dotprod: 16 (sdot), the int16 row split into two int8 halves, x = 256 hi + lo.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/cores.h"
#include "kernels/isa.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace llmrt::tied_head::LLMPIPE_ISA_NS {
namespace {

constexpr int64_t kBlock = 64;  // weight rows a thread takes at a time
// columns summed in int32 lanes before the int64 total: a lane takes at most 2 x kChunk / 16 products of at most
// 32639 * 128 each (the AVX2 path's), under 2^31
constexpr int64_t kChunk = 2048;
constexpr float kLevels = 32639.f;  // the largest int16 that splits into two int8 halves (the dotprod path's)

// an activation row rounded to int16; returns its scale (0 for a row of zeros)
float round_row(const float* x, int64_t D, int16_t* q) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  if (!(amax > 0.f)) {
    std::fill(q, q + D, int16_t{0});
    return 0.f;
  }
  const float inv = kLevels / amax;
  for (int64_t d = 0; d < D; ++d)
    q[d] = static_cast<int16_t>(std::clamp(std::lrintf(x[d] * inv), -32639L, 32639L));
  return amax / kLevels;
}

#if defined(__AVX2__)
inline int64_t lanes_total(__m256i v) {
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), v);
  int64_t t = 0;
  for (int32_t x : l) t += x;
  return t;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// acc += the pair products of 32 int16 activations and 32 int8 weights (sign-extended)
inline __m512i madd32(__m512i acc, const int16_t* x, const int8_t* w) {
  const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_loadu_si512(x), wv));
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dpw32(__m512i acc, const int16_t* x,
                                                                           const int8_t* w) {
  const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_dpwssd_epi32(acc, _mm512_loadu_si512(x), wv);
}
inline int64_t lanes_total512(__m512i v) {
  alignas(64) int32_t l[16];
  _mm512_store_si512(l, v);
  int64_t t = 0;
  for (int32_t x : l) t += x;
  return t;
}
template <bool Vnni>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int64_t chunk512(const int16_t* x, const int8_t* w,
                                                                        int64_t c0, int64_t c1, int64_t* d) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  int64_t i = c0;
  for (; i + 64 <= c1; i += 64) {
    a0 = Vnni ? dpw32(a0, x + i, w + i) : madd32(a0, x + i, w + i);
    a1 = Vnni ? dpw32(a1, x + i + 32, w + i + 32) : madd32(a1, x + i + 32, w + i + 32);
  }
  if (i + 32 <= c1) {
    a0 = Vnni ? dpw32(a0, x + i, w + i) : madd32(a0, x + i, w + i);
    i += 32;
  }
  *d = i;
  return lanes_total512(a0) + lanes_total512(a1);
}
#endif

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
// a row's int8 halves: x = 256 hi + lo, lo in [-128, 127], hi in [-127, 127] (|x| <= 32639)
void split_row(const int16_t* x, int64_t D, int8_t* hi, int8_t* lo) {
  for (int64_t d = 0; d < D; ++d) {
    const int32_t l = ((x[d] + 128) & 255) - 128;
    lo[d] = static_cast<int8_t>(l);
    hi[d] = static_cast<int8_t>((x[d] - l) / 256);
  }
}
#endif

// The exact sum of a weight row's products with a rounded activation row (hi / lo: its int8 halves, dotprod path).
// A row is read start to end: the table is then one sequential stream, which the hardware prefetcher follows (four
// rows read side by side ran at half the speed on gemma3's 262,144 x 640 table).
int64_t dot_row(const int16_t* x, const int8_t* hi, const int8_t* lo, const int8_t* w, int64_t D) {
  (void)hi, (void)lo;
  int64_t total = 0;
  for (int64_t c0 = 0; c0 < D; c0 += kChunk) {
    const int64_t c1 = std::min(D, c0 + kChunk);
    int64_t d = c0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    static const bool vnni = isa::has_avx512_vnni();
    total += vnni ? chunk512<true>(x, w, c0, c1, &d) : chunk512<false>(x, w, c0, c1, &d);
#endif
#if defined(__AVX2__)
    __m256i b = _mm256_setzero_si256();
    for (; d + 16 <= c1; d += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + d)));
      b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d)), wv));
    }
    total += lanes_total(b);
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
    int32x4_t h = vdupq_n_s32(0), l = vdupq_n_s32(0);
    for (; d + 16 <= c1; d += 16) {
      const int8x16_t wv = vld1q_s8(w + d);
      h = vdotq_s32(h, vld1q_s8(hi + d), wv);
      l = vdotq_s32(l, vld1q_s8(lo + d), wv);
    }
    total += 256 * static_cast<int64_t>(vaddlvq_s32(h)) + vaddlvq_s32(l);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    int32x4_t a0 = vdupq_n_s32(0), a1 = vdupq_n_s32(0), a2 = vdupq_n_s32(0), a3 = vdupq_n_s32(0);
    for (; d + 16 <= c1; d += 16) {
      const int8x16_t wv = vld1q_s8(w + d);
      const int16x8_t w0 = vmovl_s8(vget_low_s8(wv)), w1 = vmovl_high_s8(wv);
      const int16x8_t x0 = vld1q_s16(x + d), x1 = vld1q_s16(x + d + 8);
      a0 = vmlal_s16(a0, vget_low_s16(x0), vget_low_s16(w0));
      a1 = vmlal_high_s16(a1, x0, w0);
      a2 = vmlal_s16(a2, vget_low_s16(x1), vget_low_s16(w1));
      a3 = vmlal_high_s16(a3, x1, w1);
    }
    total += static_cast<int64_t>(vaddlvq_s32(a0)) + vaddlvq_s32(a1) + vaddlvq_s32(a2) + vaddlvq_s32(a3);
#endif
    for (; d < c1; ++d) total += int64_t{x[d]} * w[d];
  }
  return total;
}

}  // namespace

void run(const float* xf, int64_t T, const int8_t* w, const float* scales, int64_t V, int64_t D, float* out) {
  std::vector<int16_t> xq(static_cast<size_t>(T * D));
  std::vector<int8_t> hi, lo;
  std::vector<float> xs(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) xs[t] = round_row(xf + t * D, D, xq.data() + t * D);
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  hi.resize(xq.size()), lo.resize(xq.size());
  split_row(xq.data(), T * D, hi.data(), lo.data());
#endif
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kBlock, v1 = std::min(V, v0 + kBlock);
      // each weight row is read from memory once per step: the activation rows (few) loop inside
      for (int64_t v = v0; v < v1; ++v)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t o = t * D;
          const int64_t s = dot_row(xq.data() + o, hi.empty() ? nullptr : hi.data() + o,
                                    lo.empty() ? nullptr : lo.data() + o, w + v * D, D);
          out[t * V + v] = static_cast<float>(s) * scales[v] * xs[t];
        }
    }
  };
  executorch::extension::parallel_for(0, blocks, 1, body);
}

}  // namespace llmrt::tied_head::LLMPIPE_ISA_NS
