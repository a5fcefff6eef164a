// verify's emulation of XNNPACK's dynamically quantized 4-bit GEMM (pipeline/backends/xnnpack/numerics.py), part of
// libllmpipe_kernels.so's C API:
//   llmpipe_fma_chain: the fp32 running sum over the groups, given every group's integer dot;
//   llmpipe_qb4w_gemm: the whole GEMM from packed 4-bit weights (qb4w.h), on AVX-512 VNNI (0 when it ran; -1 when
//   this CPU lacks it or the shapes are not its).
// Both give the bits of numerics.py's torch path: integer dots are exact in any order, and every fp32 step (the
// int32 -> fp32 conversion, one fma per group in group order) is the same correctly rounded operation.
#include <cmath>
#include <cstdint>

#include "kernels/qb4w.h"

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

// a [rows][k] u8 activations; w4 and scales as qb4w.h packs them (scales: bf16 bits); out [rows][cols] holds the
// start of every sum (ksum x zero point) and receives the sums. The op's own GEMM (qb4w::gemm): 0, or -1 when the CPU
// lacks AVX-512 VNNI (verify takes the torch path there: the plain C one is exact but slow) or the shapes are not its.
int llmpipe_qb4w_gemm(const uint8_t* a, int64_t rows, int64_t k, const uint8_t* w4, int64_t cols, int64_t group,
                      const uint16_t* scales, float* out) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return -1;
  return llmrt::qb4w::gemm(a, rows, k, w4, cols, group, scales, out) ? 0 : -1;
#else
  (void)a, (void)rows, (void)k, (void)w4, (void)cols, (void)group, (void)scales, (void)out;
  return -1;
#endif
}

}  // extern "C"
