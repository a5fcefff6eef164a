// verify's emulation of XNNPACK's dynamically quantized 4-bit GEMM (pipeline/backends/xnnpack/numerics.py), part of
// libllmpipe_kernels.so's C API:
//   llmpipe_fma_chain: the fp32 running sum over the groups, given every group's integer dot;
//   llmpipe_qb4w_gemm: the whole GEMM from int8 weights, on AVX-512 VNNI (0 when it ran; -1 when this CPU lacks it
//   or the shapes are not its).
// Both give the bits of numerics.py's torch path: integer dots are exact in any order, and every fp32 step (the
// int32 -> fp32 conversion, one fma per group in group order) is the same correctly rounded operation.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace {

#if defined(__x86_64__)
// 16 output columns at a time: w holds them as [K / 4][16][4] int8 (16 x the 4-bit value, as XNNPACK packs it), so
// one vpdpbusd adds 4 activations (u8) times 4 weights (s8) into each column's int32 dot. Per group, the exact dot
// converted to fp32 (cvtdq2ps) is fma'd with the column's scale into the running sum (out, which holds the start).
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void qb4w_columns(const uint8_t* a, int64_t rows, int64_t k,
                                                                           const int8_t* w, int64_t cols,
                                                                           int64_t group, const float* scale16,
                                                                           float* out, int64_t block0,
                                                                           int64_t block1) {
  for (int64_t b = block0; b < block1; ++b) {
    const int8_t* wb = w + b * k * 16;  // this block's k x 16 bytes stay in cache across the rows
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* ar = a + r * k;
      float* o = out + r * cols + b * 16;
      __m512 sum = _mm512_loadu_ps(o);
      for (int64_t g0 = 0; g0 < k; g0 += group) {
        __m512i dot = _mm512_setzero_si512();
        for (int64_t i = g0; i < g0 + group; i += 4) {
          int32_t four;
          std::memcpy(&four, ar + i, 4);
          dot = _mm512_dpbusd_epi32(dot, _mm512_set1_epi32(four), _mm512_loadu_si512(wb + i * 16));
        }
        // cvtdq2ps (the full mask: _mm512_cvtepi32_ps trips GCC 12's -Wmaybe-uninitialized)
        const __m512 dotf = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, dot);
        sum = _mm512_fmadd_ps(dotf, _mm512_loadu_ps(scale16 + (g0 / group) * cols + b * 16), sum);
      }
      _mm512_storeu_ps(o, sum);
    }
  }
}
#endif

}  // namespace

extern "C" {

// out[r][c] = fmaf(terms[g][r][c], scales[g][c], out[r][c]) for g = 0, 1, ... in order: the fp32 running sum of
// XNNPACK's 4-bit group GEMM (fmaf rounds once, as vfmadd does). Row by row, so a row's sums stay in cache across
// the groups; every element still takes its groups in order, so the vector fmas (FMA builds, CMakeLists.txt) give
// the scalar ones' bits.
void llmpipe_fma_chain(const float* terms, const float* scales, float* out, int64_t groups, int64_t rows,
                       int64_t cols) {
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

// a [rows][k] u8 activations; w [cols / 16][k / 4][16][4] int8 (16 x w); scale16 [k / group][cols] fp32;
// out [rows][cols] holds the start of every sum (ksum x zero point) and receives the sums. cols % 16 == 0,
// group % 4 == 0. Column blocks split over ExecuTorch's thread pool (the one the Python runtime uses).
int llmpipe_qb4w_gemm(const uint8_t* a, int64_t rows, int64_t k, const int8_t* w, int64_t cols, int64_t group,
                      const float* scale16, float* out) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return -1;
  if (rows < 0 || k <= 0 || group <= 0 || cols % 16 || group % 4 || k % group) return -1;
  const int64_t blocks = cols / 16;
  // about 64K multiply-adds per task at the least (only a tiny linear stays on one thread)
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rows * k * 16));
  const bool ran = executorch::extension::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    qb4w_columns(a, rows, k, w, cols, group, scale16, out, b0, b1);
  });
  return ran ? 0 : -1;
#else
  (void)a, (void)rows, (void)k, (void)w, (void)cols, (void)group, (void)scale16, (void)out;
  return -1;
#endif
}

}  // extern "C"
