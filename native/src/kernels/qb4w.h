// XNNPACK's dynamically quantized 4-bit linear (qd8-f32-qb4w with qdu8 activations, the AVX-512 VNNI kernels), bit for
// bit, from packed weights: verify's reference (xnnpack_reference.cpp) and the llmpipe::linear_q4 op (linear_q4.cpp)
// compute with it. pipeline/backends/xnnpack/numerics.py is the step-by-step account of those numerics.
//
// Weights per block of 16 output columns: w4 [K / 8][64] bytes, byte j holding column j / 4's w + 8 for inputs
// 8c + j % 4 (low nibble) and 8c + 4 + j % 4 (high); scales [groups][16] bf16 of (group scale / 16).
#pragma once

#include <cstdint>

namespace llmrt::qb4w {

// XNNPACK's per-row activation parameters and quantization (qdu8): a [rows][k] in [0, 255], the dequantization
// scale 1 / m and the zero point (+ 128) of each row.
void quantize_rows(const float* x, int64_t rows, int64_t k, uint8_t* a, float* dq, int32_t* zp);

// out [rows][cols] holds each sum's start (ksum x zero point) and receives the sums over the groups: per group the
// exact integer dot times 16, converted to fp32 and fma'd with the group's scale, in group order. Columns split over
// ExecuTorch's thread pool; AVX-512 VNNI where the CPU has it, the same bits in plain C elsewhere. False when the
// shapes are not its (cols % 16, group % 8, k % group) or the pool refused.
bool gemm(const uint8_t* a, int64_t rows, int64_t k, const uint8_t* w4, int64_t cols, int64_t group,
          const uint16_t* scales, float* out);

}  // namespace llmrt::qb4w
