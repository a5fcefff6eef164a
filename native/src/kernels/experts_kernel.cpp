// llmpipe::experts.out: a mixture-of-experts layer's experts (pipeline/model/experts.py, whose experts_ref is the
// Python twin). Each token picked k experts (top_k_index [N,k], weights top_k_weights [N,k]); per expert, only the
// rows routed to it run gate, up, the activation and down, and are added to their token's output weighted. An expert
// no row picked reads none of its weights, so a decode step streams k experts, not all of them.
//
//   hidden [N,H] Float; per projection (gate, up, down): w [E,out,in] Float, or Char (int8 values) with
//   s [E,out,in/group] Float group scales; b [E,out] Float or none. act_quant[p]: the projection's input rows
//   are quantized to int8 first, asymmetric per row, as torchao's dynamic 8da linears do (its twin calls torchao's).
//   activation 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (limit, alpha). out [N,H] Float.
// Numerics, which the twin follows: activation quantization in fp32 as torchao's; each projection's sums and the
// activation in float64, rounded to fp32 once; the weighted sum over a token's experts in fp32, in expert order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/checked_kernel.h"

namespace llmrt::experts {
namespace {

using executorch::aten::ArrayRef;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;
using OptTensor = std::optional<Tensor>;

// One projection of every expert: expert e's weight rows start at w + e * out * in.
struct Proj {
  const float* wf = nullptr;   // Float weights
  const int8_t* wq = nullptr;  // or int8 values with group scales
  const float* s = nullptr;
  const float* b = nullptr;
  int64_t out = 0, in = 0, groups = 1;
  bool act_quant = false;
};

bool load_proj(const char* name, const Tensor& w, const OptTensor& s, const OptTensor& b, int64_t E, bool aq,
               Proj* p, std::string* why) {
  auto fail = [&](const std::string& m) {
    *why = std::string(name) + ": " + m;
    return false;
  };
  if (w.dim() != 3 || w.size(0) != E) return fail("weights must be [E,out,in]");
  p->out = w.size(1), p->in = w.size(2), p->act_quant = aq;
  if (w.scalar_type() == ScalarType::Float) {
    if (s.has_value()) return fail("Float weights take no scales");
    p->wf = w.const_data_ptr<float>();
  } else if (w.scalar_type() == ScalarType::Char) {
    if (!s.has_value() || s->dim() != 3 || s->size(0) != E || s->size(1) != p->out || s->size(2) < 1 ||
        p->in % s->size(2) != 0 || s->scalar_type() != ScalarType::Float)
      return fail("int8 weights take Float group scales [E,out,groups], groups dividing in");
    p->wq = w.const_data_ptr<int8_t>();
    p->s = s->const_data_ptr<float>();
    p->groups = s->size(2);
  } else {
    return fail("weights must be Float or Char");
  }
  if (b.has_value()) {
    if (b->dim() != 2 || b->size(0) != E || b->size(1) != p->out || b->scalar_type() != ScalarType::Float)
      return fail("biases must be Float [E,out]");
    p->b = b->const_data_ptr<float>();
  }
  return true;
}

// x [n][in] in place: quantized to int8 and back, per row, as torchao's choose_qparams_affine (asymmetric, the
// range widened to include 0, scale clamped to the smallest normal) and quantize_affine (round half to even of
// x * (1 / scale), plus the zero point, clamped) compute it in fp32.
void quant_dequant_rows(float* x, int64_t n, int64_t in) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = x + r * in;
    float lo = 0.f, hi = 0.f;
    for (int64_t i = 0; i < in; ++i) lo = std::min(lo, row[i]), hi = std::max(hi, row[i]);
    const float scale = std::max((hi - lo) / 255.f, 1.17549435e-38f);
    const float zp = std::clamp(-128.f - std::nearbyint(lo / scale), -128.f, 127.f);
    const float inv = 1.f / scale;
    for (int64_t i = 0; i < in; ++i) {
      const float q = std::clamp(std::nearbyint(row[i] * inv) + zp, -128.f, 127.f);
      row[i] = (q - zp) * scale;
    }
  }
}

// Sums in float64, rounded to fp32 once: every product of an fp32 and a weight is exact in float64, and a sum of
// them differs from the twin's (torch's float64 matmul, in its own order) by far less than an fp32 step, so the two
// give the same fp32 bits but at the rarest ties, wherever the order.
template <class W>
double dot(const float* x, const W* w, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(w[i]);
  return acc;
}

// y [n][out] = fp32(x [n][in] W_e^T + b_e), the group sums scaled in float64; output rows over the thread pool
void project(const Proj& p, int64_t e, const float* x, int64_t n, float* y) {
  const int64_t in = p.in, group = in / p.groups;
  auto rows = [&](int64_t o0, int64_t o1) {
    for (int64_t o = o0; o < o1; ++o) {
      const int64_t row = e * p.out + o;
      const double bias = p.b ? p.b[row] : 0.0;
      for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * in;
        double acc = 0.0;
        if (p.wf) {
          acc = dot(xr, p.wf + row * in, in);
        } else {
          const int8_t* w = p.wq + row * in;
          const float* s = p.s + row * p.groups;
          for (int64_t g = 0; g < p.groups; ++g) acc += static_cast<double>(s[g]) * dot(xr + g * group, w + g * group, group);
        }
        y[r * p.out + o] = static_cast<float>(acc + bias);
      }
    }
  };
  // about 16K multiply-adds per task at the least
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, n * in));
  executorch::extension::parallel_for(0, p.out, grain, rows);
}

Tensor& experts_out(KernelRuntimeContext& ctx, const Tensor& hidden, const Tensor& top_k_index,
                    const Tensor& top_k_weights, const Tensor& gate_w, const OptTensor& gate_s, const OptTensor& gate_b,
                    const Tensor& up_w, const OptTensor& up_s, const OptTensor& up_b, const Tensor& down_w,
                    const OptTensor& down_s, const OptTensor& down_b, ArrayRef<int64_t> act_quant, int64_t activation,
                    double limit, double alpha, Tensor& out) {
  auto fail = [&](const std::string& msg) -> Tensor& {
    ET_LOG(Error, "llmpipe::experts: %s", msg.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  };
  if (hidden.dim() != 2 || hidden.scalar_type() != ScalarType::Float) return fail("hidden must be Float [N,H]");
  const int64_t N = hidden.size(0), H = hidden.size(1);
  if (top_k_index.dim() != 2 || top_k_index.size(0) != N || top_k_index.scalar_type() != ScalarType::Long ||
      top_k_weights.dim() != 2 || top_k_weights.size(0) != N || top_k_weights.size(1) != top_k_index.size(1) ||
      top_k_weights.scalar_type() != ScalarType::Float)
    return fail("top_k_index must be Long [N,k] and top_k_weights Float [N,k]");
  if (act_quant.size() != 3 || (activation != 0 && activation != 1)) return fail("act_quant[3], activation 0 or 1");
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
  std::vector<float> x, x2, g, u, y;
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
    const float* xg = x.data();
    if (gate.act_quant || up.act_quant) {  // a projection with float inputs reads the rows as they are
      x2 = x;
      quant_dequant_rows(x2.data(), n, H);
    }
    g.resize(n * I), u.resize(n * I), y.resize(n * H);
    project(gate, e, gate.act_quant ? x2.data() : xg, n, g.data());
    project(up, e, up.act_quant ? x2.data() : xg, n, u.data());
    for (int64_t i = 0; i < n * I; ++i) {  // in float64, rounded once (the twin: the same)
      if (activation == 1) {
        const double gi = std::min(g[i], lim), ui = std::clamp(u[i], -lim, lim);
        g[i] = static_cast<float>((ui + 1.0) * (gi / (1.0 + std::exp(-gi * al))));
      } else {
        const double gi = g[i];
        g[i] = static_cast<float>(gi / (1.0 + std::exp(-gi)) * u[i]);
      }
    }
    if (down.act_quant) quant_dequant_rows(g.data(), n, I);
    project(down, e, g.data(), n, y.data());
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
