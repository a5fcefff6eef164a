// verify's emulation of XNNPACK's dynamically quantized 4-bit GEMM (pipeline/backends/xnnpack/numerics.py), the C API
// of libllmpipe_verify.so:
//   llmpipe_fma_chain: the fp32 running sum over the groups, given every group's integer dot;
//   llmpipe_qb4w_gemm: the whole GEMM from packed 4-bit weights, on AVX-512 VNNI (0 when it ran; -1 when
//   this CPU lacks it or the shapes are not its).
// Both give the bits of numerics.py's torch path: integer dots are exact in any order, and every fp32 step (the
// int32 -> fp32 conversion, one fma per group in group order) is the same correctly rounded operation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace {

#if defined(__x86_64__)
// Weights per block of 16 output columns: w4 [K / 8][64] bytes, byte j holding column j / 4's w + 8 for inputs
// 8c + j % 4 (low nibble) and 8c + 4 + j % 4 (high); scales [groups][16] bf16 of (group scale / 16).
// One 64-byte load feeds two vpdpbusd (4 activations, u8, times 4 nibbles of each of 16 columns), so a column's group
// dot is sum(a u); sum(a w) = sum(a u) - 8 sum(a) (asum8), exact, then shifted by 4 to XNNPACK's 16 w.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void qb4w_columns(const uint8_t* a, const int32_t* asum8,
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

// out[r][c] = fmaf(terms[g][r][c], scales[g][c], out[r][c]) in group order, elementwise (any vector width gives the
// scalar fmaf's bits); inlined into a baseline copy and an AVX2 + FMA one, chosen at run time (one build for every
// x86-64 CPU)
__attribute__((always_inline)) inline void fma_chain_body(const float* terms, const float* scales, float* out,
                                                          int64_t groups, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const float* t = terms + (g * rows + r) * cols;
      const float* s = scales + g * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) o[c] = std::fmaf(t[c], s[c], o[c]);
    }
  }
}
void fma_chain(const float* terms, const float* scales, float* out, int64_t groups, int64_t rows, int64_t cols) {
  fma_chain_body(terms, scales, out, groups, rows, cols);
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void fma_chain_avx2(const float* terms, const float* scales, float* out,
                                                        int64_t groups, int64_t rows, int64_t cols) {
  fma_chain_body(terms, scales, out, groups, rows, cols);
}
#endif

}  // namespace

extern "C" {

// out[r][c] = fmaf(terms[g][r][c], scales[g][c], out[r][c]) for g = 0, 1, ... in order: the fp32 running sum of
// XNNPACK's 4-bit group GEMM (fmaf rounds once, as vfmadd does). Row by row, so a row's sums stay in cache across
// the groups; every element still takes its groups in order, so the vector fmas give the scalar ones' bits.
void llmpipe_fma_chain(const float* terms, const float* scales, float* out, int64_t groups, int64_t rows,
                       int64_t cols) {
#if defined(__x86_64__)
  static const bool fma = __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
  if (fma) return fma_chain_avx2(terms, scales, out, groups, rows, cols);
#endif
  fma_chain(terms, scales, out, groups, rows, cols);
}

// a [rows][k] u8 activations; w4 and scales as qb4w_columns reads them (scales: bf16 bits); out [rows][cols] holds
// the start of every sum (ksum x zero point) and receives the sums. cols % 16 == 0, group % 8 == 0. Column blocks
// split over ExecuTorch's thread pool (the one the Python runtime uses).
int llmpipe_qb4w_gemm(const uint8_t* a, int64_t rows, int64_t k, const uint8_t* w4, int64_t cols, int64_t group,
                      const uint16_t* scales, float* out) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return -1;
  if (rows < 0 || k <= 0 || group <= 0 || cols % 16 || group % 8 || k % group) return -1;
  const int64_t blocks = cols / 16, groups = k / group;
  std::vector<int32_t> asum8(static_cast<size_t>(rows * groups));  // 8 x each row's activation sum per group
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      int32_t t = 0;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) t += a[r * k + i];
      asum8[r * groups + g] = 8 * t;
    }
  // about 64K multiply-adds per task at the least (only a tiny linear stays on one thread)
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k * 16));
  const bool ran = executorch::extension::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    qb4w_columns(a, asum8.data(), rows, k, w4, cols, group, scales, out, b0, b1);
  });
  return ran ? 0 : -1;
#else
  (void)a, (void)rows, (void)k, (void)w4, (void)cols, (void)group, (void)scales, (void)out;
  return -1;
#endif
}

}  // extern "C"
