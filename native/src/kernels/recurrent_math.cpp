// The recurrent layers' numeric cores (recurrent_core.h's run_delta, run_conv and run_ssd), compiled once per ISA path
// (kernels/isa.h) in namespace LLMPIPE_ISA_NS: their loops are `omp simd` loops the compiler vectorizes for the path
// (AVX2 / AVX-512 fmas on x86-64, NEON fmla on ARM64; none on the scalar path, each kernel's twin).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/cores.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent::LLMPIPE_ISA_NS {
namespace {

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

// One head of Mamba-2's scan over the whole step, chunk by chunk (ssd.py's chunked form).
void ssd_head(const SsdStep& p, float* state, int64_t h) {
  const int64_t N = p.N, P = p.P, g = h / (p.H / p.G);
  float* S = state + h * N * P;
  const double rate = std::exp(static_cast<double>(p.A_log[h]));
  const int64_t rows = std::min(kChunk, p.T);
  std::vector<float> U(rows * P), O(rows * P), gamma(rows), carry(rows);
  for (int64_t c0 = 0; c0 < p.T; c0 += kChunk) {
    const int64_t n = std::min(kChunk, p.T - c0);
    double cum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = c0 + i;
      const double raw = softplus(static_cast<double>(p.dt[t * p.H + h]) + p.dt_bias[h]);
      const float delta = std::min(std::max(static_cast<float>(raw), p.dt_min), p.dt_max);
      cum -= rate * delta;
      gamma[i] = static_cast<float>(cum);
      const float* x = p.x + (t * p.H + h) * P;
      for (int64_t c = 0; c < P; ++c) U[i * P + c] = delta * x[c];
    }
    // one read of the state: O_i = S^T C_i (rows of S stay in cache over i)
    std::fill(O.begin(), O.begin() + n * P, 0.f);
    for (int64_t d = 0; d < N; ++d) {
      const float* Sd = S + d * P;
      for (int64_t i = 0; i < n; ++i) axpy(p.C[((c0 + i) * p.G + g) * N + d], Sd, O.data() + i * P, P);
    }
    // y_i = exp(gamma_i) O_i + sum_{j<=i} exp(gamma_i - gamma_j) (C_i . B_j) u_j + D x_i
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = c0 + i;
      float* o = p.out + (t * p.H + h) * P;
      const float* x = p.x + (t * p.H + h) * P;
      const float* Ci = p.C + (t * p.G + g) * N;
      const float eg = std::exp(gamma[i]), dh = p.D[h];
      for (int64_t c = 0; c < P; ++c) o[c] = eg * O[i * P + c] + dh * x[c];
      for (int64_t j = 0; j <= i; ++j)
        axpy(std::exp(gamma[i] - gamma[j]) * dot(Ci, p.B + ((c0 + j) * p.G + g) * N, N), U.data() + j * P, o, P);
    }
    // one write of the state: S = exp(gamma_n) S + sum_j exp(gamma_n - gamma_j) B_j u_j^T
    const float last = gamma[n - 1], en = std::exp(last);
    for (int64_t j = 0; j < n; ++j) carry[j] = std::exp(last - gamma[j]);
    for (int64_t d = 0; d < N; ++d) {
      float* Sd = S + d * P;
      for (int64_t c = 0; c < P; ++c) Sd[c] *= en;
      for (int64_t j = 0; j < n; ++j) axpy(carry[j] * p.B[((c0 + j) * p.G + g) * N + d], U.data() + j * P, Sd, P);
    }
  }
}

}  // namespace

void run_delta(const DeltaStep& s, float* state) {
  if (s.T > 0 && s.pos == 0) std::fill(state, state + s.Hv * s.Dk * s.Dv, 0.f);  // a new sequence
  executorch::extension::parallel_for(0, s.Hv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) run_head(s, state, h);
  });
}

void run_ssd(const SsdStep& s, float* state) {
  if (s.T > 0 && s.pos == 0) std::fill(state, state + s.H * s.N * s.P, 0.f);  // a new sequence
  executorch::extension::parallel_for(0, s.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) ssd_head(s, state, h);
  });
}

void run_conv(const ConvStep& s, float* state) {
  const int64_t T = s.T, C = s.C, K = s.K;
  if (T > 0 && s.pos == 0) std::fill(state, state + (K - 1) * C, 0.f);  // a new sequence
  // the step's input rows: the state's K-1, then x's T (a row is C channels)
  std::vector<float> in((K - 1 + T) * C);
  std::copy_n(state, (K - 1) * C, in.data());
  std::copy_n(s.x, T * C, in.data() + (K - 1) * C);
  for (int64_t t = 0; t < T; ++t) {
    float* row = s.out + t * C;
    for (int64_t c = 0; c < C; ++c) row[c] = s.bias ? s.bias[c] : 0.f;
    for (int64_t j = 0; j < K; ++j) {
      const float* src = in.data() + (t + j) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) row[c] += s.w[c * K + j] * src[c];
    }
    if (s.silu)
      for (int64_t c = 0; c < C; ++c) row[c] = row[c] / (1.f + std::exp(-row[c]));
  }
  std::copy_n(in.data() + T * C, (K - 1) * C, state);
}

}  // namespace llmrt::recurrent::LLMPIPE_ISA_NS
