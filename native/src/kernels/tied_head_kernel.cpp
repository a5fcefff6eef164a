// llmpipe::tied_head.out: a tied model's lm_head over the embedding's own int8 table, so the program stores that
// table once (the embedding lookup, quantized_decomposed::embedding_byte, reads the same constant). XNNPACK would
// serialize its own copy of the weight into its payload. Python twin: pipeline/model/tied_head.py.
//
//   x [..., D] Float; qweight [V, D] Char (int8 per row); scales [V] or [V, 1] Float; out [..., V] Float.
//   out[t, v] = scales[v] * sum_d x[t, d] * qweight[v, d]   (fp32 activations: what an 8-bit weight-only linear
//   computes; the sum in fp32, in 16- or 8-wide fmas where the build has AVX-512 or AVX2 + FMA).
#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TIED_HEAD_AVX2 1
#endif

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/checked_kernel.h"

namespace llmrt::tied_head {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kRows = 4;      // weight rows that share one pass over x
constexpr int64_t kBlock = 64;    // weight rows a thread takes at a time
#ifndef TIED_AHEAD
#define TIED_AHEAD 32
#endif
constexpr int64_t kAhead = TIED_AHEAD;

#ifdef TIED_HEAD_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256 eight(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// dots of kRows weight rows (w, stride D) with one activation row x: the sums before their scales
void dot_rows(const float* x, const int8_t* w, int64_t D, float* sums) {
  int64_t d = 0;
  std::fill(sums, sums + kRows, 0.f);
#ifdef __AVX512F__
  // 16 at a time: the int8 -> fp32 conversion is the inner loop's bound, and half as many of them as at 8 wide
  __m512 a[kRows];
  for (int64_t r = 0; r < kRows; ++r) a[r] = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 xv = _mm512_loadu_ps(x + d);
    for (int64_t r = 0; r < kRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + kAhead) * D + d), _MM_HINT_T0);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * D + d));
      a[r] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), a[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) sums[r] = _mm512_reduce_add_ps(a[r]);
#endif
#ifdef TIED_HEAD_AVX2
  __m256 b[kRows];
  for (int64_t r = 0; r < kRows; ++r) b[r] = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    const __m256 xv = _mm256_loadu_ps(x + d);
    for (int64_t r = 0; r < kRows; ++r) b[r] = _mm256_fmadd_ps(xv, eight(w + r * D + d), b[r]);
  }
  for (int64_t r = 0; r < kRows; ++r) sums[r] += hsum(b[r]);
#endif
  for (; d < D; ++d)
    for (int64_t r = 0; r < kRows; ++r) sums[r] += x[d] * static_cast<float>(w[r * D + d]);
}

float dot_row(const float* x, const int8_t* w, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += x[d] * static_cast<float>(w[d]);
  return s;
}

void run(const float* x, int64_t T, const int8_t* w, const float* scales, int64_t V, int64_t D, float* out) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  auto body = [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kBlock, v1 = std::min(V, v0 + kBlock);
      int64_t v = v0;
      // each weight row is read from memory once per step: the activation rows (few) loop inside
      for (; v + kRows <= v1; v += kRows)
        for (int64_t t = 0; t < T; ++t) {
          float sums[kRows];
          dot_rows(x + t * D, w + v * D, D, sums);
          for (int64_t r = 0; r < kRows; ++r) out[t * V + v + r] = sums[r] * scales[v + r];
        }
      for (; v < v1; ++v)
        for (int64_t t = 0; t < T; ++t) out[t * V + v] = dot_row(x + t * D, w + v * D, D) * scales[v];
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
