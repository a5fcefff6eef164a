// llmpipe::experts.out: a mixture-of-experts layer's experts (pipeline/model/layers/experts.py, whose experts_ref is
// the Python twin). Each token picked k experts (top_k_index [N,k], weights top_k_weights [N,k]); per expert, only the
// rows routed to it run gate, up, the activation and down, and are added to their token's output weighted. An expert
// no row picked reads none of its weights, so a decode step streams k experts, not all of them.
//
//   hidden [N,H] Float; per projection (gate, up, down): w [E,out,in] Float, or Char (int8 values) or Byte
//   [E,out,in/2] (4-bit values two a byte, w + 8, element 2i in the low nibble) with s [E,out,in/group] Float group
//   scales; b [E,out] Float or none. act_quant[p]: the projection's input rows
//   are quantized to int8 first, asymmetric per row, as torchao's dynamic 8da linears do (int8 weights only).
//   activation 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (limit, alpha); 2: relu(up)^2, ungated (Nemotron-H:
//   the gate arguments repeat up's and are not read). out [N,H] Float.
// Numerics, which the twin follows: activations quantized in fp32 as torchao does, each group's dot with the int8
// weights exact in int32, scaled in float64; other projections' sums and the gated activation in float64; each
// rounded to fp32 once; the weighted sum over a token's experts in fp32, in expert order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/cores.h"
#include "kernels/experts_core.h"

namespace llmrt::experts {
namespace {

using executorch::aten::ArrayRef;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;
using OptTensor = std::optional<Tensor>;

bool load_proj(const char* name, const Tensor& w, const OptTensor& s, const OptTensor& b, int64_t E, bool aq,
               Proj* p, std::string* why) {
  auto fail = [&](const std::string& m) {
    *why = std::string(name) + ": " + m;
    return false;
  };
  if (w.dim() != 3 || w.size(0) != E) return fail("weights must be [E,out,in]");
  p->out = w.size(1), p->in = w.size(2), p->act_quant = aq;
  if (w.scalar_type() == ScalarType::Float) {
    if (s.has_value() || aq) return fail("Float weights take no scales and no dynamic activations");
    p->wf = w.const_data_ptr<float>();
  } else if (w.scalar_type() == ScalarType::Char || w.scalar_type() == ScalarType::Byte) {
    if (w.scalar_type() == ScalarType::Byte) p->in *= 2;  // two 4-bit values a byte
    if (!s.has_value() || s->dim() != 3 || s->size(0) != E || s->size(1) != p->out || s->size(2) < 1 ||
        p->in % s->size(2) != 0 || s->scalar_type() != ScalarType::Float)
      return fail("int8 / packed 4-bit weights take Float group scales [E,out,groups], groups dividing in");
    if (w.scalar_type() == ScalarType::Byte)
      p->w4 = w.const_data_ptr<uint8_t>();
    else
      p->wq = w.const_data_ptr<int8_t>();
    p->s = s->const_data_ptr<float>();
    p->groups = s->size(2);
  } else {
    return fail("weights must be Float, Char (int8) or Byte (4-bit pairs)");
  }
  if (b.has_value()) {
    if (b->dim() != 2 || b->size(0) != E || b->size(1) != p->out || b->scalar_type() != ScalarType::Float)
      return fail("biases must be Float [E,out]");
    p->b = b->const_data_ptr<float>();
  }
  return true;
}

Tensor& experts_out(KernelRuntimeContext& ctx, const Tensor& hidden, const Tensor& top_k_index,
                    const Tensor& top_k_weights, const Tensor& gate_w, const OptTensor& gate_s, const OptTensor& gate_b,
                    const Tensor& up_w, const OptTensor& up_s, const OptTensor& up_b, const Tensor& down_w,
                    const OptTensor& down_s, const OptTensor& down_b, ArrayRef<int64_t> act_quant, int64_t activation,
                    double limit, double alpha, Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::experts", why);
  };
  if (hidden.dim() != 2 || hidden.scalar_type() != ScalarType::Float) return fail("hidden must be Float [N,H]");
  const int64_t N = hidden.size(0), H = hidden.size(1);
  if (top_k_index.dim() != 2 || top_k_index.size(0) != N || top_k_index.scalar_type() != ScalarType::Long ||
      top_k_weights.dim() != 2 || top_k_weights.size(0) != N || top_k_weights.size(1) != top_k_index.size(1) ||
      top_k_weights.scalar_type() != ScalarType::Float)
    return fail("top_k_index must be Long [N,k] and top_k_weights Float [N,k]");
  if (act_quant.size() != 3 || activation < 0 || activation > 2) return fail("act_quant[3], activation 0, 1 or 2");
  const int64_t E = gate_w.dim() == 3 ? gate_w.size(0) : 0;
  Proj gate, up, down;
  std::string why;
  if (!load_proj("gate", gate_w, gate_s, gate_b, E, act_quant[0], &gate, &why) ||
      !load_proj("up", up_w, up_s, up_b, E, act_quant[1], &up, &why) ||
      !load_proj("down", down_w, down_s, down_b, E, act_quant[2], &down, &why))
    return fail(why);
  const int64_t I = gate.out;
  if (gate.in != H || up.in != H || up.out != I || down.in != I || down.out != H)
    return fail("gate/up must be [E,I,H] and down [E,H,I] for hidden [N,H]");
  if (out.scalar_type() != ScalarType::Float ||
      executorch::runtime::resize_tensor(out, hidden.sizes()) != Error::Ok)
    return fail("out must be Float, resizable to [N,H]");
  const int64_t k = top_k_index.size(1);
  const int64_t* idx = top_k_index.const_data_ptr<int64_t>();
  const float* wts = top_k_weights.const_data_ptr<float>();
  for (int64_t i = 0; i < N * k; ++i)
    if (idx[i] < 0 || idx[i] >= E) return fail("expert index " + std::to_string(idx[i]) + " out of [0, E)");
  const float* x_all = hidden.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  std::fill(o, o + N * H, 0.f);
  std::vector<int64_t> picks;  // (token, slot) entries that picked expert e, as token * k + slot
  std::vector<float> x, g, u, y, rs;
  std::vector<int16_t> qz;
  const float lim = static_cast<float>(limit);
  const double al = static_cast<double>(static_cast<float>(alpha));
  for (int64_t e = 0; e < E; ++e) {
    picks.clear();
    for (int64_t i = 0; i < N * k; ++i)
      if (idx[i] == e) picks.push_back(i);
    const int64_t n = static_cast<int64_t>(picks.size());
    if (n == 0) continue;
    x.resize(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(x_all + (picks[r] / k) * H, H, x.data() + r * H);
    g.resize(n * I), u.resize(n * I), y.resize(n * H);
    const Cores& c = cores();  // the ISA path's copy of the projection
    if (activation != 2) c.experts_project(gate, e, x.data(), n, g.data(), qz, rs);
    c.experts_project(up, e, x.data(), n, u.data(), qz, rs);
    for (int64_t i = 0; i < n * I; ++i) {  // in float64, rounded once (the twin: the same)
      if (activation == 2) {
        const double ui = std::max(u[i], 0.f);
        g[i] = static_cast<float>(ui * ui);
      } else if (activation == 1) {
        const double gi = std::min(g[i], lim), ui = std::clamp(u[i], -lim, lim);
        g[i] = static_cast<float>((ui + 1.0) * (gi / (1.0 + std::exp(-gi * al))));
      } else {
        const double gi = g[i];
        g[i] = static_cast<float>(gi / (1.0 + std::exp(-gi)) * u[i]);
      }
    }
    c.experts_project(down, e, g.data(), n, y.data(), qz, rs);
    for (int64_t r = 0; r < n; ++r) {  // fp32, a product then a sum (no fma: built with -ffp-contract=off)
      const float w = wts[picks[r]];
      float* dst = o + (picks[r] / k) * H;
      for (int64_t c = 0; c < H; ++c) dst[c] += w * y[r * H + c];
    }
  }
  return out;
}

}  // namespace
}  // namespace llmrt::experts

LLMPIPE_KERNEL(llmpipe, "experts.out", llmrt::experts::experts_out);
