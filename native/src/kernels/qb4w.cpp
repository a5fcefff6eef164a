// See qb4w.h. Built with -ffp-contract=off (CMakeLists.txt): every fp32 step here is rounded on its own, as XNNPACK's
// are, unless written as an fma.
#include "kernels/qb4w.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace llmrt::qb4w {
namespace {

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The same sums in plain C: exact integer dots, one fmaf per group.
void columns_plain(const uint8_t* a, int64_t rows, int64_t k, const uint8_t* w4, int64_t cols, int64_t group,
                   const uint16_t* scales, float* out, int64_t block0, int64_t block1) {
  const int64_t groups = k / group;
  for (int64_t b = block0; b < block1; ++b) {
    const uint8_t* wb = w4 + b * k * 8;
    const uint16_t* sb = scales + b * groups * 16;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* ar = a + r * k;
      for (int64_t c = 0; c < 16; ++c) {
        float sum = out[r * cols + b * 16 + c];
        for (int64_t g = 0; g < groups; ++g) {
          int32_t dot = 0;
          for (int64_t i = g * group; i < (g + 1) * group; ++i) {
            const uint8_t byte = wb[(i / 8) * 64 + c * 4 + i % 4];
            const int32_t u = (i % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
            dot += static_cast<int32_t>(ar[i]) * (u - 8);
          }
          sum = std::fmaf(static_cast<float>(dot * 16), bf16_to_float(sb[g * 16 + c]), sum);
        }
        out[r * cols + b * 16 + c] = sum;
      }
    }
  }
}

#if defined(__x86_64__)
// One 64-byte load feeds two vpdpbusd (4 activations, u8, times 4 nibbles of each of 16 columns), so a column's group
// dot is sum(a u); sum(a w) = sum(a u) - 8 sum(a) (asum8), exact, then shifted by 4 to XNNPACK's 16 w.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void columns_vnni(const uint8_t* a, const int32_t* asum8,
                                                                           int64_t rows, int64_t k, const uint8_t* w4,
                                                                           int64_t cols, int64_t group,
                                                                           const uint16_t* scales, float* out,
                                                                           int64_t block0, int64_t block1) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int64_t groups = k / group;
  for (int64_t b = block0; b < block1; ++b) {
    const uint8_t* wb = w4 + b * k * 8;  // this block's k x 8 bytes stay in cache across the rows
    const uint16_t* sb = scales + b * groups * 16;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* ar = a + r * k;
      float* o = out + r * cols + b * 16;
      __m512 sum = _mm512_loadu_ps(o);
      for (int64_t g = 0; g < groups; ++g) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
          const __m512i v = _mm512_loadu_si512(wb + i * 8);
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, ar + i, 4);
          std::memcpy(&four_hi, ar + i + 4, 4);
          lo = _mm512_dpbusd_epi32(lo, _mm512_set1_epi32(four_lo), _mm512_and_si512(v, nibble));
          hi = _mm512_dpbusd_epi32(hi, _mm512_set1_epi32(four_hi), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        }
        // full masks throughout: the unmasked forms trip GCC 12's -Wmaybe-uninitialized
        const __m512i dot = _mm512_maskz_slli_epi32(
            0xFFFF, _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(asum8[r * groups + g])), 4);
        const __m512 dotf = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, dot);  // cvtdq2ps
        const __m512i s16 =
            _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + g * 16)));
        const __m512 scale = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, s16, 16));  // bf16 -> fp32, exact
        sum = _mm512_fmadd_ps(dotf, scale, sum);
      }
      _mm512_storeu_ps(o, sum);
    }
  }
}
#endif

bool has_vnni() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int64_t k, uint8_t* a, float* dq, int32_t* zp) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    float rmin = 0.0f, rmax = 0.0f;  // the range always includes 0
    for (int64_t i = 0; i < k; ++i) {
      rmin = std::min(rmin, xr[i]);
      rmax = std::max(rmax, xr[i]);
    }
    const float mult = rmin == rmax ? 1.0f : 255.0f / (rmax - rmin);
    const float lo = rmin * mult, hi = rmax * mult;
    // TFLite's nudged zero point, from the end whose error is smaller, rounded half to even
    float z = (-128.0f + lo) + (127.0f + hi) > 0.0f ? -128.0f - lo : 127.0f - hi;
    z = std::min(127.0f, std::max(-128.0f, z));
    const int32_t zpu = static_cast<int32_t>(std::nearbyint(z)) + 128;
    dq[r] = 1.0f / mult;
    zp[r] = zpu;
    for (int64_t i = 0; i < k; ++i) {
      const float q = std::nearbyint(xr[i] * mult) + static_cast<float>(zpu);
      a[r * k + i] = static_cast<uint8_t>(std::min(255.0f, std::max(0.0f, q)));
    }
  }
}

bool gemm(const uint8_t* a, int64_t rows, int64_t k, const uint8_t* w4, int64_t cols, int64_t group,
          const uint16_t* scales, float* out) {
  if (rows < 0 || k <= 0 || group <= 0 || cols % 16 || group % 8 || k % group) return false;
  const int64_t blocks = cols / 16, groups = k / group;
  // about 64K multiply-adds per task at the least (only a tiny linear stays on one thread)
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k * 16));
#if defined(__x86_64__)
  if (has_vnni()) {
    std::vector<int32_t> asum8(static_cast<size_t>(rows * groups));  // 8 x each row's activation sum per group
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t t = 0;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) t += a[r * k + i];
        asum8[r * groups + g] = 8 * t;
      }
    return executorch::extension::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      columns_vnni(a, asum8.data(), rows, k, w4, cols, group, scales, out, b0, b1);
    });
  }
#endif
  return executorch::extension::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    columns_plain(a, rows, k, w4, cols, group, scales, out, b0, b1);
  });
}

}  // namespace llmrt::qb4w
