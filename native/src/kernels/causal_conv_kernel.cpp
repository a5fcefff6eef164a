// llmpipe::causal_conv.out: a recurrent layer's short depthwise causal conv over the last K-1 inputs it keeps as its
// state, updated in place (Qwen3.5's q|k|v conv, LFM2's short conv). Python twin: pipeline/model/recurrent.py.
//
//   x [1,T,C] Float; weight [C,K] Float; bias [C] Float or none; state [K-1,C] Float (zeroed first when position[0]
//   == 0); position [T] consecutive; activation 0: none, 1: silu; out [1,T,C] Float.
//   out[t] = act(bias + sum_j weight[:, j] * in[t + j]) over in = state then x; the state becomes in's last K-1 rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"

namespace llmrt::causal_conv {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

Tensor& causal_conv_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, Tensor& state, const Tensor& position, int64_t activation,
                        Tensor& out) {
  auto fail = [&](const std::string& msg) -> Tensor& {
    ET_LOG(Error, "llmpipe::causal_conv: %s", msg.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  };
  if (x.dim() != 3 || x.size(0) != 1 || x.scalar_type() != ScalarType::Float) return fail("x must be Float [1,T,C]");
  const int64_t T = x.size(1), C = x.size(2);
  if (weight.dim() != 2 || weight.size(0) != C || weight.size(1) < 1 || weight.scalar_type() != ScalarType::Float)
    return fail("weight must be Float [C,K]");
  const int64_t K = weight.size(1);
  if (state.dim() != 2 || state.size(0) != K - 1 || state.size(1) != C || state.scalar_type() != ScalarType::Float)
    return fail("state must be Float [K-1,C]");
  if (bias.has_value() && (bias->dim() != 1 || bias->size(0) != C || bias->scalar_type() != ScalarType::Float))
    return fail("bias must be Float [C]");
  if (activation != 0 && activation != 1) return fail("activation must be 0 (none) or 1 (silu)");
  if (position.dim() != 1 || position.size(0) != T || position.scalar_type() != ScalarType::Long)
    return fail("position must be Long [T]");
  const int64_t* pos = position.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] != pos[0] + t || pos[0] < 0) return fail("positions must be consecutive from >= 0");
  if (out.scalar_type() != ScalarType::Float || executorch::runtime::resize_tensor(out, x.sizes()) != Error::Ok)
    return fail("out must be Float, resizable to x's shape");
  float* st = state.mutable_data_ptr<float>();
  if (T > 0 && pos[0] == 0) std::fill(st, st + (K - 1) * C, 0.f);  // a new sequence
  // the step's input rows: the state's K-1, then x's T (a row is C channels)
  std::vector<float> in((K - 1 + T) * C);
  std::copy_n(st, (K - 1) * C, in.data());
  std::copy_n(x.const_data_ptr<float>(), T * C, in.data() + (K - 1) * C);
  const float* w = weight.const_data_ptr<float>();
  const float* b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* row = o + t * C;
    for (int64_t c = 0; c < C; ++c) row[c] = b ? b[c] : 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const float* src = in.data() + (t + j) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] += w[c * K + j] * src[c];
    }
    if (activation == 1)
      for (int64_t c = 0; c < C; ++c) row[c] = row[c] / (1.f + std::exp(-row[c]));
  }
  std::copy_n(in.data() + T * C, (K - 1) * C, st);
  return out;
}

}  // namespace
}  // namespace llmrt::causal_conv

LLMPIPE_KERNEL(llmpipe, "causal_conv.out", llmrt::causal_conv::causal_conv_out);
