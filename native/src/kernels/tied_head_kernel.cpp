// llmpipe::tied_head.out: a tied model's lm_head over the embedding's own int8 table, so the program stores that
// table once (the embedding lookup, quantized_decomposed::embedding_byte, reads the same constant). XNNPACK would
// serialize its own copy of the weight into its payload. Python twin: pipeline/model/layers/tied_head.py.
//
//   x [..., D] Float; qweight [V, D] Char (int8 per row); scales [V] or [V, 1] Float; out [..., V] Float.
//   out[t, v] = scales[v] * sum_d x[t, d] * qweight[v, d]. Each activation row is rounded to int16 first (its scale
//   amax / 32639: an error of at most 2^-16 of its largest value, far below the weights' 8-bit rounding), so the sums
//   are exact integers of int16 x int8 products, which every ISA path (tied_head_core.cpp) computes to the same
//   value and converts to fp32 once: the paths give the same bits.
#include <algorithm>
#include <cstdint>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/cores.h"

namespace llmrt::tied_head {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

Tensor& tied_head_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& qweight, const Tensor& scales,
                      Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::tied_head", why);
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
  cores().tied_head(x.const_data_ptr<float>(), x.numel() / std::max<int64_t>(D, 1), qweight.const_data_ptr<int8_t>(),
                    scales.const_data_ptr<float>(), V, D, out.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmrt::tied_head

LLMPIPE_KERNEL(llmpipe, "tied_head.out", llmrt::tied_head::tied_head_out);
