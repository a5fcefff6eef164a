// llmpipe::linear_q4.out: a dynamically quantized 4-bit linear outside the XNNPACK delegate, with the delegate's
// numerics bit for bit (qb4w.h), streaming its packed weights faster than the delegate's GEMM does at decode's one
// row (the lm_head: pipeline/backends/xnnpack/head_kernel.py). Python twin: the op's eager form there.
//
//   x [..., K] Float; w4 [N / 16, K / 8, 64] Byte; scales [N / 16, K / group, 16] BFloat16 (group scale / 16);
//   ksum [N] Float (the packing's ksum: each sum starts at ksum x the row's zero point); group;
//   out [..., N] Float: per row (ksum zp + the group chain) x the row's dequantization scale.
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/qb4w.h"

namespace llmrt::qb4w {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

Tensor& linear_q4_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& w4, const Tensor& scales,
                      const Tensor& ksum, int64_t group, Tensor& out) {
  auto fail = [&](const std::string& msg) -> Tensor& {
    ET_LOG(Error, "llmpipe::linear_q4: %s", msg.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  };
  if (x.dim() < 1 || x.scalar_type() != ScalarType::Float || out.scalar_type() != ScalarType::Float)
    return fail("x and out must be Float, x [..., K]");
  const int64_t k = x.size(x.dim() - 1);
  if (w4.dim() != 3 || w4.scalar_type() != ScalarType::Byte || w4.size(2) != 64 || w4.size(1) * 8 != k)
    return fail("w4 must be [N/16, K/8, 64] Byte for x's K = " + std::to_string(k));
  const int64_t cols = w4.size(0) * 16;
  if (group <= 0 || group % 8 || k % group) return fail("group " + std::to_string(group) + " must divide K in 8s");
  if (scales.dim() != 3 || scales.scalar_type() != ScalarType::BFloat16 || scales.size(0) != w4.size(0) ||
      scales.size(1) != k / group || scales.size(2) != 16)
    return fail("scales must be [N/16, K/group, 16] BFloat16");
  if (ksum.dim() != 1 || ksum.scalar_type() != ScalarType::Float || ksum.size(0) != cols)
    return fail("ksum must be [N] Float");
  if (x.dim() > 16) return fail("x has too many dimensions");
  SizesType sizes[16];
  for (int64_t d = 0; d + 1 < x.dim(); ++d) sizes[d] = static_cast<SizesType>(x.size(d));
  sizes[x.dim() - 1] = static_cast<SizesType>(cols);
  if (executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(x.dim())}) != Error::Ok)
    return fail("cannot resize out");
  const int64_t rows = k ? x.numel() / k : 0;
  std::vector<uint8_t> a(static_cast<size_t>(rows * k));
  std::vector<float> dq(static_cast<size_t>(rows));
  std::vector<int32_t> zp(static_cast<size_t>(rows));
  quantize_rows(x.const_data_ptr<float>(), rows, k, a.data(), dq.data(), zp.data());
  float* o = out.mutable_data_ptr<float>();
  const float* ks = ksum.const_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = ks[c] * static_cast<float>(zp[r]);
  if (!gemm(a.data(), rows, k, w4.const_data_ptr<uint8_t>(), cols, group,
            reinterpret_cast<const uint16_t*>(scales.const_data_ptr()), o))
    return fail("the thread pool refused the GEMM");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) o[r * cols + c] *= dq[r];  // the row's scale after all groups
  return out;
}

}  // namespace
}  // namespace llmrt::qb4w

LLMPIPE_KERNEL(llmpipe, "linear_q4.out", llmrt::qb4w::linear_q4_out);
