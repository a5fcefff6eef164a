// A recurrent layer's short depthwise causal conv over the last K-1 inputs it keeps as its state (Qwen3.5's q|k|v
// conv, LFM2's short conv): recurrent_core.h's run_conv, and llmpipe::causal_conv.out, the custom and static modes' op
// over a state buffer of the program, updated in place. Python twin: pipeline/model/layers/recurrent.py.
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
#include "kernels/cores.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool conv_step(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& position,
               int64_t activation, Tensor& out, ConvStep* s, std::string* why, bool consecutive_rows) {
  auto no = [&](const char* msg) {
    *why = msg;
    return false;
  };
  if (!is_float(x, 3) || x.size(0) != 1) return no("x must be Float [1,T,C]");
  const int64_t T = x.size(1), C = x.size(2);
  if (!is_float(weight, 2) || weight.size(0) != C || weight.size(1) < 1) return no("weight must be Float [C,K]");
  if (bias.has_value() && (!is_float(*bias, 1) || bias->size(0) != C)) return no("bias must be Float [C]");
  if (activation != 0 && activation != 1) return no("activation must be 0 (none) or 1 (silu)");
  if (!consecutive(position, T, &s->pos, why, consecutive_rows)) return false;
  if (out.scalar_type() != ScalarType::Float || executorch::runtime::resize_tensor(out, x.sizes()) != Error::Ok)
    return no("out must be Float, resizable to x's shape");
  s->x = x.const_data_ptr<float>(), s->w = weight.const_data_ptr<float>();
  s->bias = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  s->out = out.mutable_data_ptr<float>();
  s->T = T, s->C = C, s->K = weight.size(1), s->silu = activation == 1;
  return true;
}

ConvStep conv_rows(const ConvStep& s, int64_t row, int64_t T, int64_t pos) {
  ConvStep r = s;
  r.x += row * s.C, r.out += row * s.C;
  r.T = T, r.pos = pos;
  return r;
}

void run_conv(const ConvStep& s, float* state) { cores().run_conv(s, state); }  // the ISA path's copy

namespace {

Tensor& causal_conv_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& weight,
                        const std::optional<Tensor>& bias, Tensor& state, const Tensor& position, int64_t activation,
                        Tensor& out) {
  ConvStep s;
  std::string why;
  if (!conv_step(x, weight, bias, position, activation, out, &s, &why) ||
      (!is_float(state, 2) || state.size(0) != s.K - 1 || state.size(1) != s.C)) {
    ET_LOG(Error, "llmpipe::causal_conv: %s", why.empty() ? "state must be Float [K-1,C]" : why.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  run_conv(s, state.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmrt::recurrent

LLMPIPE_KERNEL(llmpipe, "causal_conv.out", llmrt::recurrent::causal_conv_out);
