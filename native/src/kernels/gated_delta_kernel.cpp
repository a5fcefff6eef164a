// The gated delta rule (Qwen3.5, Qwen3-Next Gated DeltaNet layers), recurrent_core.h's run_delta, and
// llmpipe::gated_delta_rule.out: the custom and static modes' op over a state buffer of the program, updated in place.
// Python twin and the math: pipeline/model/layers/gated_delta.py.
//
//   q, k [1,T,Hk,Dk] (unnormalized), v [1,T,Hv,Dv], a, b [1,T,Hv], A_log, dt_bias [Hv], all Float; Hv % Hk == 0;
//   state [Hv,Dk,Dv] Float (zeroed first when position[0] == 0); position [T] consecutive; out [1,T,Hv,Dv] Float.
//
// A step runs in the chunked form, kChunk tokens at a time, each value head on its own task: per chunk two triangular
// solves over the chunk's keys, one pass over the state that reads what the chunk needs of it, and one that writes it.
// A decode step (T = 1) is the same code: the solves are empty, and the state is read once and written once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/checked_kernel.h"
#include "kernels/cores.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool delta_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a, const Tensor& b,
                const Tensor& A_log, const Tensor& dt_bias, const Tensor& position, double scale, Tensor& out,
                DeltaStep* s, std::string* why, bool consecutive_rows) {
  auto no = [&](const char* msg) {
    *why = msg;
    return false;
  };
  if (!is_float(q, 4) || !is_float(k, 4) || !is_float(v, 4) || q.size(0) != 1 || v.size(0) != 1)
    return no("q, k must be Float [1,T,Hk,Dk] and v Float [1,T,Hv,Dv]");
  const int64_t T = q.size(1), Hk = q.size(2), Dk = q.size(3), Hv = v.size(2), Dv = v.size(3);
  for (int d = 0; d < 4; ++d)
    if (k.size(d) != q.size(d)) return no("k must have q's shape");
  if (v.size(1) != T || Hk == 0 || Hv % Hk != 0) return no("v must be [1,T,Hv,Dv] with Hv a multiple of Hk");
  if (!is_float(a, 3) || !is_float(b, 3) || a.size(0) != 1 || a.size(1) != T || a.size(2) != Hv ||
      b.size(0) != 1 || b.size(1) != T || b.size(2) != Hv)
    return no("a, b must be Float [1,T,Hv]");
  if (!is_float(A_log, 1) || !is_float(dt_bias, 1) || A_log.size(0) != Hv || dt_bias.size(0) != Hv)
    return no("A_log, dt_bias must be Float [Hv]");
  if (!consecutive(position, T, &s->pos, why, consecutive_rows)) return false;
  if (out.scalar_type() != ScalarType::Float || executorch::runtime::resize_tensor(out, v.sizes()) != Error::Ok)
    return no("out must be Float, resizable to v's shape");
  s->q = q.const_data_ptr<float>(), s->k = k.const_data_ptr<float>(), s->v = v.const_data_ptr<float>();
  s->a = a.const_data_ptr<float>(), s->b = b.const_data_ptr<float>();
  s->A_log = A_log.const_data_ptr<float>(), s->dt_bias = dt_bias.const_data_ptr<float>();
  s->out = out.mutable_data_ptr<float>();
  s->T = T, s->Hk = Hk, s->Hv = Hv, s->Dk = Dk, s->Dv = Dv, s->scale = static_cast<float>(scale);
  return true;
}

DeltaStep delta_rows(const DeltaStep& s, int64_t row, int64_t T, int64_t pos) {
  DeltaStep r = s;
  r.q += row * s.Hk * s.Dk, r.k += row * s.Hk * s.Dk, r.v += row * s.Hv * s.Dv;
  r.a += row * s.Hv, r.b += row * s.Hv, r.out += row * s.Hv * s.Dv;
  r.T = T, r.pos = pos;
  return r;
}

void run_delta(const DeltaStep& s, float* state) { cores().run_delta(s, state); }  // the ISA path's copy

namespace {

Tensor& gated_delta_rule_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                             Tensor& state, const Tensor& position, double scale, Tensor& out) {
  DeltaStep s;
  std::string why;
  if (!delta_step(q, k, v, a, b, A_log, dt_bias, position, scale, out, &s, &why) ||
      (!is_float(state, 3) || state.size(0) != s.Hv || state.size(1) != s.Dk || state.size(2) != s.Dv)) {
    ET_LOG(Error, "llmpipe::gated_delta_rule: %s", why.empty() ? "state must be Float [Hv,Dk,Dv]" : why.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  run_delta(s, state.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmrt::recurrent

LLMPIPE_KERNEL(llmpipe, "gated_delta_rule.out", llmrt::recurrent::gated_delta_rule_out);
