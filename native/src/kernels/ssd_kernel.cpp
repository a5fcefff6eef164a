// Mamba-2's scan (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1 SSD layers), recurrent_core.h's run_ssd, and
// llmpipe::ssd_scan.out: the custom and static modes' op over a state buffer of the program, updated in place.
// Python twin and the math: pipeline/model/layers/ssd.py.
//
//   x [1,T,H,P], dt [1,T,H], A_log, dt_bias, D [H], B, C [1,T,G,N], all Float; H % G == 0; state [H,N,P] Float
//   (zeroed first when position[0] == 0); position [T] consecutive; out [1,T,H,P] Float.
#include <string>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/cores.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool ssd_step(const Tensor& x, const Tensor& dt, const Tensor& A_log, const Tensor& dt_bias, const Tensor& B,
              const Tensor& C, const Tensor& D, const Tensor& position, double dt_min, double dt_max, Tensor& out,
              SsdStep* s, std::string* why, bool consecutive_rows) {
  auto no = [&](const char* msg) {
    *why = msg;
    return false;
  };
  if (!is_float(x, 4) || x.size(0) != 1) return no("x must be Float [1,T,H,P]");
  const int64_t T = x.size(1), H = x.size(2), P = x.size(3);
  if (!is_float(B, 4) || !is_float(C, 4) || B.size(0) != 1 || B.size(1) != T)
    return no("B, C must be Float [1,T,G,N]");
  for (int d = 0; d < 4; ++d)
    if (C.size(d) != B.size(d)) return no("C must have B's shape");
  const int64_t G = B.size(2), N = B.size(3);
  if (G == 0 || H % G != 0) return no("the heads must be a multiple of the groups");
  if (!is_float(dt, 3) || dt.size(0) != 1 || dt.size(1) != T || dt.size(2) != H) return no("dt must be Float [1,T,H]");
  for (const Tensor* p : {&A_log, &dt_bias, &D})
    if (!is_float(*p, 1) || p->size(0) != H) return no("A_log, dt_bias, D must be Float [H]");
  if (!consecutive(position, T, &s->pos, why, consecutive_rows)) return false;
  if (out.scalar_type() != ScalarType::Float || executorch::runtime::resize_tensor(out, x.sizes()) != Error::Ok)
    return no("out must be Float, resizable to x's shape");
  s->x = x.const_data_ptr<float>(), s->dt = dt.const_data_ptr<float>(), s->A_log = A_log.const_data_ptr<float>();
  s->dt_bias = dt_bias.const_data_ptr<float>(), s->B = B.const_data_ptr<float>(), s->C = C.const_data_ptr<float>();
  s->D = D.const_data_ptr<float>(), s->out = out.mutable_data_ptr<float>();
  s->T = T, s->H = H, s->P = P, s->G = G, s->N = N;
  s->dt_min = static_cast<float>(dt_min), s->dt_max = static_cast<float>(dt_max);
  return true;
}

SsdStep ssd_rows(const SsdStep& s, int64_t row, int64_t T, int64_t pos) {
  SsdStep r = s;
  r.x += row * s.H * s.P, r.dt += row * s.H, r.B += row * s.G * s.N, r.C += row * s.G * s.N;
  r.out += row * s.H * s.P;
  r.T = T, r.pos = pos;
  return r;
}

void run_ssd(const SsdStep& s, float* state) { cores().run_ssd(s, state); }  // the ISA path's copy

namespace {

Tensor& ssd_scan_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                     const Tensor& dt_bias, const Tensor& B, const Tensor& C, const Tensor& D, Tensor& state,
                     const Tensor& position, double dt_min, double dt_max, Tensor& out) {
  SsdStep s;
  std::string why;
  if (!ssd_step(x, dt, A_log, dt_bias, B, C, D, position, dt_min, dt_max, out, &s, &why) ||
      (!is_float(state, 3) || state.size(0) != s.H || state.size(1) != s.N || state.size(2) != s.P)) {
    ET_LOG(Error, "llmpipe::ssd_scan: %s", why.empty() ? "state must be Float [H,N,P]" : why.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  }
  run_ssd(s, state.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmrt::recurrent

LLMPIPE_KERNEL(llmpipe, "ssd_scan.out", llmrt::recurrent::ssd_scan_out);
