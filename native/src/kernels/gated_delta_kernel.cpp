// The gated delta rule (Qwen3.5, Qwen3-Next Gated DeltaNet layers), recurrent_core.h's run_delta, and
// llmpipe::gated_delta_rule.out: the custom and static modes' op over a state buffer of the program, updated in place.
// Python twin and the math: pipeline/model/gated_delta.py.
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
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kChunk = 64;   // the twin's CHUNK
constexpr float kL2Eps = 1e-6f;  // HF's l2norm: x * rsqrt(sum(x^2) + eps)

inline float dot(const float* x, const float* y, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// x / sqrt(|x|^2 + eps) * mul, into dst
inline void l2_normalized(const float* x, int64_t n, float mul, float* dst) {
  const float r = mul / std::sqrt(dot(x, x, n) + kL2Eps);
  for (int64_t i = 0; i < n; ++i) dst[i] = x[i] * r;
}

// torch's softplus (threshold 20: x itself above it)
inline double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// One value head over the whole step, chunk by chunk.
void run_head(const DeltaStep& p, float* state, int64_t h) {
  const int64_t Dk = p.Dk, Dv = p.Dv, kh = h / (p.Hv / p.Hk);
  float* S = state + h * Dk * Dv;
  const double decay_rate = std::exp(static_cast<double>(p.A_log[h]));
  // scratch for the step's largest chunk: a decode step's is one row, not kChunk
  const int64_t rows = std::min(kChunk, p.T);
  std::vector<float> Q(rows * Dk), K(rows * Dk), W(rows * Dk), U(rows * Dv), O(rows * Dv);
  std::vector<float> gamma(rows), beta(rows), carry(rows);
  for (int64_t c0 = 0; c0 < p.T; c0 += kChunk) {
    const int64_t n = std::min(kChunk, p.T - c0);
    double cum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = c0 + i;
      l2_normalized(p.q + (t * p.Hk + kh) * Dk, Dk, p.scale, Q.data() + i * Dk);
      l2_normalized(p.k + (t * p.Hk + kh) * Dk, Dk, 1.f, K.data() + i * Dk);
      cum -= decay_rate * softplus(static_cast<double>(p.a[t * p.Hv + h]) + p.dt_bias[h]);
      gamma[i] = static_cast<float>(cum);
      beta[i] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(p.b[t * p.Hv + h]))));
    }
    // (I + L) U = beta V and (I + L) W = beta exp(gamma) K, L strictly lower: forward substitution, row by row
    for (int64_t i = 0; i < n; ++i) {
      const float* v = p.v + ((c0 + i) * p.Hv + h) * Dv;
      float* Ui = U.data() + i * Dv;
      float* Wi = W.data() + i * Dk;
      const float* Ki = K.data() + i * Dk;
      const float wk = beta[i] * std::exp(gamma[i]);
      for (int64_t c = 0; c < Dv; ++c) Ui[c] = beta[i] * v[c];
      for (int64_t d = 0; d < Dk; ++d) Wi[d] = wk * Ki[d];
      for (int64_t j = 0; j < i; ++j) {
        const float lij = beta[i] * std::exp(gamma[i] - gamma[j]) * dot(Ki, K.data() + j * Dk, Dk);
        axpy(-lij, U.data() + j * Dv, Ui, Dv);
        axpy(-lij, W.data() + j * Dk, Wi, Dk);
      }
    }
    // one read of the state: u_i = U_i - W_i S and O_i = exp(gamma_i) q_i S (rows of S stay in cache over i)
    std::fill(O.begin(), O.begin() + n * Dv, 0.f);
    for (int64_t d = 0; d < Dk; ++d) {
      const float* Sd = S + d * Dv;
      for (int64_t i = 0; i < n; ++i) {
        axpy(-W[i * Dk + d], Sd, U.data() + i * Dv, Dv);
        axpy(Q[i * Dk + d], Sd, O.data() + i * Dv, Dv);
      }
    }
    // within the chunk: o_i = exp(gamma_i) O_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i . k_j) u_j
    for (int64_t i = 0; i < n; ++i) {
      float* o = p.out + ((c0 + i) * p.Hv + h) * Dv;
      const float eg = std::exp(gamma[i]);
      for (int64_t c = 0; c < Dv; ++c) o[c] = eg * O[i * Dv + c];
      for (int64_t j = 0; j <= i; ++j)
        axpy(std::exp(gamma[i] - gamma[j]) * dot(Q.data() + i * Dk, K.data() + j * Dk, Dk), U.data() + j * Dv, o, Dv);
    }
    // one write of the state: S = exp(gamma_n) S + sum_j exp(gamma_n - gamma_j) k_j u_j^T
    const float last = gamma[n - 1], en = std::exp(last);
    for (int64_t j = 0; j < n; ++j) carry[j] = std::exp(last - gamma[j]);
    for (int64_t d = 0; d < Dk; ++d) {
      float* Sd = S + d * Dv;
      for (int64_t c = 0; c < Dv; ++c) Sd[c] *= en;
      for (int64_t j = 0; j < n; ++j) axpy(carry[j] * K[j * Dk + d], U.data() + j * Dv, Sd, Dv);
    }
  }
}

}  // namespace

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

void run_delta(const DeltaStep& s, float* state) {
  if (s.T > 0 && s.pos == 0) std::fill(state, state + s.Hv * s.Dk * s.Dv, 0.f);  // a new sequence
  executorch::extension::parallel_for(0, s.Hv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) run_head(s, state, h);
  });
}

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
