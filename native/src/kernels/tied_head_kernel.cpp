// llmpipe::tied_head.out: a tied model's lm_head over the embedding's own int8 table, so the program stores that
// table once (the embedding lookup, quantized_decomposed::embedding_byte, reads the same constant). XNNPACK would
// serialize its own copy of the weight into its payload. Python twin: pipeline/model/tied_head.py.
//
//   x [..., D] Float; qweight [V, D] Char (int8 per row); scales [V] or [V, 1] Float; out [..., V] Float.
//   out[t, v] = scales[v] * sum_d x[t, d] * qweight[v, d]. Each activation row is rounded to int16 first (its scale
//   amax / 32767: an error of at most 2^-16 of its largest value, far below the weights' 8-bit rounding), so the sums
//   run as int16 pair products into int32 (AVX512-VNNI vpdpwssd, AVX-512 or AVX2 vpmaddwd): 32 or 16 weights an
//   instruction, where converting each int8 weight to fp32 for an fma took three.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>


#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/checked_kernel.h"
#include "kernels/simd_math.h"  // hsum; LLMPIPE_AVX2 where the build has AVX2 + FMA

namespace llmrt::tied_head {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kBlock = 64;    // weight rows a thread takes at a time
// columns summed in int32 before the float sum: an AVX2 lane takes kChunk / 16 steps of two products of at most
// 32767 * 128 each, 2^30 at most
constexpr int64_t kChunk = 2048;

#ifdef LLMPIPE_AVX2
using llmrt::kv::simd::hsum;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TIED_HEAD_AVX512 1
// acc += the pair products of 32 int16 activations and 32 int8 weights (sign-extended)
inline __m512i dp32(__m512i acc, const int16_t* x, const int8_t* w) {
  const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, _mm512_loadu_si512(x), wv);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_loadu_si512(x), wv));
#endif
}
#endif

// an activation row rounded to int16; returns its scale (0 for a row of zeros)
float round_row(const float* x, int64_t D, int16_t* q) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  if (!(amax > 0.f)) {
    std::fill(q, q + D, int16_t{0});
    return 0.f;
  }
  const float inv = 32767.f / amax;
  for (int64_t d = 0; d < D; ++d)
    q[d] = static_cast<int16_t>(std::clamp(std::lrintf(x[d] * inv), -32767L, 32767L));
  return amax / 32767.f;
}

// one weight row's dot with a rounded activation row, before the scales. A row is read start to end: the table is
// then one sequential stream, which the hardware prefetcher follows (four rows read side by side ran at half the
// speed on gemma3's 262,144 x 640 table)
float dot_row(const int16_t* x, const int8_t* w, int64_t D) {
  float sum = 0.f;
  for (int64_t c0 = 0; c0 < D; c0 += kChunk) {
    const int64_t c1 = std::min(D, c0 + kChunk);
    int64_t d = c0;
#ifdef TIED_HEAD_AVX512
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (; d + 64 <= c1; d += 64) {
      a0 = dp32(a0, x + d, w + d);
      a1 = dp32(a1, x + d + 32, w + d + 32);
    }
    if (d + 32 <= c1) {
      a0 = dp32(a0, x + d, w + d);
      d += 32;
    }
    sum += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)));
#endif
#ifdef LLMPIPE_AVX2
    __m256i b = _mm256_setzero_si256();
    for (; d + 16 <= c1; d += 16) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + d)));
      b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + d)), wv));
    }
    sum += hsum(_mm256_cvtepi32_ps(b));
#endif
    int64_t tail = 0;
    for (; d < c1; ++d) tail += int64_t{x[d]} * w[d];
    sum += static_cast<float>(tail);
  }
  return sum;
}

void run(const float* xf, int64_t T, const int8_t* w, const float* scales, int64_t V, int64_t D, float* out) {
  std::vector<int16_t> xq(static_cast<size_t>(T * D));
  std::vector<float> xs(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) xs[t] = round_row(xf + t * D, D, xq.data() + t * D);
  const int16_t* x = xq.data();
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kBlock, v1 = std::min(V, v0 + kBlock);
      // each weight row is read from memory once per step: the activation rows (few) loop inside
      for (int64_t v = v0; v < v1; ++v)
        for (int64_t t = 0; t < T; ++t) out[t * V + v] = dot_row(x + t * D, w + v * D, D) * scales[v] * xs[t];
    }
  };
  executorch::extension::parallel_for(0, blocks, 1, body);
}

Tensor& tied_head_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& qweight, const Tensor& scales,
                      Tensor& out) {
  auto fail = [&](const char* why) -> Tensor& {
    ET_LOG(Error, "llmpipe::tied_head: %s", why);
    ctx.fail(Error::InvalidArgument);
    return out;
  };
  if (qweight.scalar_type() != ScalarType::Char || qweight.dim() != 2) return fail("qweight must be Char [V,D]");
  const int64_t V = qweight.size(0), D = qweight.size(1);
  if (x.scalar_type() != ScalarType::Float || x.dim() < 1 || x.size(x.dim() - 1) != D)
    return fail("x must be Float [..., D] with qweight's D");
  if (scales.scalar_type() != ScalarType::Float || scales.numel() != V || scales.size(0) != V)
    return fail("scales must be Float [V] or [V,1]");
  executorch::aten::SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  for (int64_t i = 0; i + 1 < x.dim(); ++i) sizes[i] = x.size(i);
  sizes[x.dim() - 1] = static_cast<executorch::aten::SizesType>(V);
  if (out.scalar_type() != ScalarType::Float ||
      executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(x.dim())}) != Error::Ok)
    return fail("out must be Float, resizable to [..., V]");
  run(x.const_data_ptr<float>(), x.numel() / std::max<int64_t>(D, 1), qweight.const_data_ptr<int8_t>(),
      scales.const_data_ptr<float>(), V, D, out.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmrt::tied_head

LLMPIPE_KERNEL(llmpipe, "tied_head.out", llmrt::tied_head::tied_head_out);
