// llmpipe::experts.out: a mixture-of-experts layer's experts (pipeline/model/experts.py, whose experts_ref is the
// Python twin). Each token picked k experts (top_k_index [N,k], weights top_k_weights [N,k]); per expert, only the
// rows routed to it run gate, up, the activation and down, and are added to their token's output weighted. An expert
// no row picked reads none of its weights, so a decode step streams k experts, not all of them.
//
//   hidden [N,H] Float; per projection (gate, up, down): w [E,out,in] Float, or Char (int8 values) or Byte
//   [E,out,in/2] (4-bit values two a byte, w + 8, element 2i in the low nibble) with s [E,out,in/group] Float group
//   scales; b [E,out] Float or none. act_quant[p]: the projection's input rows
//   are quantized to int8 first, asymmetric per row, as torchao's dynamic 8da linears do (int8 weights only).
//   activation 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU (limit, alpha). out [N,H] Float.
// Numerics, which the twin follows: activations quantized in fp32 as torchao does, each group's dot with the int8
// weights exact in int32, scaled in float64; other projections' sums and the gated activation in float64; each
// rounded to fp32 once; the weighted sum over a token's experts in fp32, in expert order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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
  const int8_t* wq = nullptr;   // or int8 values with group scales
  const uint8_t* w4 = nullptr;  // or 4-bit values two a byte (w + 8: element 2i low nibble, 2i + 1 high)
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

// Rows x [n][in] quantized to int8 as torchao's choose_qparams_affine (asymmetric, the range widened to include 0,
// scale clamped to the smallest normal) and quantize_affine (round half to even of x * (1 / scale), plus the zero
// point, clamped) compute it in fp32: q - zero point into qz [n][in] (|q - zp| <= 255), each row's scale into rs.
void quantize_rows(const float* x, int64_t n, int64_t in, int16_t* qz, float* rs) {
  for (int64_t r = 0; r < n; ++r) {
    const float* row = x + r * in;
    float lo = 0.f, hi = 0.f;
    for (int64_t i = 0; i < in; ++i) lo = std::min(lo, row[i]), hi = std::max(hi, row[i]);
    const float scale = std::max((hi - lo) / 255.f, 1.17549435e-38f);
    const float zp = std::clamp(-128.f - std::nearbyint(lo / scale), -128.f, 127.f);
    const float inv = 1.f / scale;
    for (int64_t i = 0; i < in; ++i)
      qz[r * in + i] = static_cast<int16_t>(std::clamp(std::nearbyint(row[i] * inv) + zp, -128.f, 127.f) - zp);
    rs[r] = scale;
  }
}

// sum a[i] * w[i], exact in int32 (|a| <= 255, |w| <= 127): in any order the same integer
inline int32_t idot(const int16_t* a, const int8_t* w, int64_t n) {
  int32_t acc = 0;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256i sum = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {  // 16 products, summed in pairs into 8 int32 lanes (vpmaddwd)
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(av, wv));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  acc = _mm_cvtsi128_si32(h);
#endif
  for (; i < n; ++i) acc += static_cast<int32_t>(a[i]) * static_cast<int32_t>(w[i]);
  return acc;
}

#if defined(__AVX2__)
// The exact int32 dots of 8 consecutive weight rows (w, rows `in` apart) with a (n elements, a multiple of 16), as
// one vector [row 0 .. row 7]: 8 rows share each activation load, and one horizontal-add tree replaces 8 reductions.
inline __m256i dots8(const int16_t* a, const int8_t* w, int64_t in, int64_t n) {
  __m256i v[8];
  for (auto& x : v) x = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    for (int k = 0; k < 8; ++k) {
      const __m128i wk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * in + i));
      v[k] = _mm256_add_epi32(v[k], _mm256_madd_epi16(av, _mm256_cvtepi8_epi16(wk)));
    }
  }
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  // u0 holds rows 0-3 twice (one partial per 128-bit half), u1 rows 4-7: the halves added
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// y rows ob..ob+7 of one input row (its int16 activations a, row scale rs): per group the 8 exact dots, times the
// groups' scales, summed in float64 (a product, then a sum: the twin's order per group); true if it ran
bool rows8_int(const int16_t* a, const int8_t* w, const float* sc, int64_t in, int64_t groups, double rs,
               double* acc) {
  const int64_t group = in / groups;
  if (group % 16) return false;
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i d = dots8(a + g * group, w + g * group, in, group);
    alignas(32) float s8[8];
    for (int k = 0; k < 8; ++k) s8[k] = sc[k * groups + g];
    const __m256 s = _mm256_load_ps(s8);
    lo = _mm256_add_pd(lo, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(s)),
                                         _mm256_cvtepi32_pd(_mm256_castsi256_si128(d))));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)),
                                         _mm256_cvtepi32_pd(_mm256_extracti128_si256(d, 1))));
  }
  const __m256d r = _mm256_set1_pd(rs);
  _mm256_storeu_pd(acc, _mm256_mul_pd(lo, r));
  _mm256_storeu_pd(acc + 4, _mm256_mul_pd(hi, r));
  return true;
}
#endif

// rows [n][in] of 4-bit pairs (in / 2 bytes a row) unpacked to int8 values
void unpack4(const uint8_t* w4, int64_t rows, int64_t in, int8_t* out) {
  for (int64_t i = 0; i < rows * in / 2; ++i) {
    out[2 * i] = static_cast<int8_t>((w4[i] & 0x0F) - 8);
    out[2 * i + 1] = static_cast<int8_t>((w4[i] >> 4) - 8);
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

// y [n][out] = fp32(x [n][in] W_e^T + b_e), output rows over the thread pool. With dynamic activations (act_quant)
// each group's dot is exact in int32 (int8 activations minus their zero point, times int8 weights) and scaled by the
// weight group's and the row's scales in float64; otherwise the sums are float64 (dot). Both rounded to fp32 once.
void project(const Proj& p, int64_t e, const float* x, int64_t n, float* y, std::vector<int16_t>& qz,
             std::vector<float>& rs) {
  const int64_t in = p.in, group = in / p.groups;
  const bool ints = p.act_quant;  // load_proj: dynamic activations come with int8 weights
  if (ints) {
    qz.resize(n * in), rs.resize(n);
    quantize_rows(x, n, in, qz.data(), rs.data());
  }
  // kRows output rows at a time: their dots are independent chains, which the core overlaps (one row at a time,
  // each group's dot waits on the last: bound by latency, not by the weights' bandwidth)
  constexpr int64_t kRows = 8;
  constexpr int64_t kAhead = 1;  // 4 and 8 blocks ahead measured no faster (bench/moe.py --hidden 1024)
  auto rows = [&](int64_t o0, int64_t o1) {
    std::vector<int8_t> unpacked(p.w4 ? static_cast<size_t>(kRows * in) : 0);  // a block's 4-bit rows as int8
    for (int64_t ob = o0; ob < o1; ob += kRows) {
      const int64_t nr = std::min(kRows, o1 - ob);
      const int64_t ahead = ob + kAhead * kRows;  // a block this many ahead, asked for while this one computes
      if (ahead < o1 && !p.wf) {
        const int64_t bytes = std::min(kRows, o1 - ahead) * (p.w4 ? in / 2 : in);
        const void* next = p.w4 ? static_cast<const void*>(p.w4 + (e * p.out + ahead) * in / 2)
                                : static_cast<const void*>(p.wq + (e * p.out + ahead) * in);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(next) + b, 0, 0);
      }
      const int8_t* wblock = p.wq ? p.wq + (e * p.out + ob) * in : nullptr;
      if (p.w4) {
        unpack4(p.w4 + (e * p.out + ob) * in / 2, nr, in, unpacked.data());
        wblock = unpacked.data();
      }
      for (int64_t r = 0; r < n; ++r) {
        double acc[kRows] = {};
        bool scaled = false;  // acc already times the row's scale
#if defined(__AVX2__)
        if (ints && nr == kRows)
          scaled = rows8_int(qz.data() + r * in, wblock, p.s + (e * p.out + ob) * p.groups, in, p.groups,
                             static_cast<double>(rs[r]), acc);
#endif
        for (int64_t k = 0; k < nr; ++k)
          if (p.wf) acc[k] = dot(x + r * in, p.wf + (e * p.out + ob + k) * in, in);
        if (!p.wf && !scaled) {
          const int8_t* w = wblock;
          const float* sc = p.s + (e * p.out + ob) * p.groups;
          for (int64_t g = 0; g < p.groups; ++g)
            for (int64_t k = 0; k < nr; ++k) {
              const int8_t* wk = w + k * in + g * group;
              const double d = ints ? static_cast<double>(idot(qz.data() + r * in + g * group, wk, group))
                                    : dot(x + r * in + g * group, wk, group);
              acc[k] += static_cast<double>(sc[k * p.groups + g]) * d;
            }
        }
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t row = e * p.out + ob + k;
          const double v = ints && !scaled ? acc[k] * static_cast<double>(rs[r]) : acc[k];
          y[r * p.out + ob + k] = static_cast<float>(v + (p.b ? static_cast<double>(p.b[row]) : 0.0));
        }
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
    project(gate, e, x.data(), n, g.data(), qz, rs);
    project(up, e, x.data(), n, u.data(), qz, rs);
    for (int64_t i = 0; i < n * I; ++i) {  // in float64, rounded once (the twin: the same)
      if (activation == 1) {
        const double gi = std::min(g[i], lim), ui = std::clamp(u[i], -lim, lim);
        g[i] = static_cast<float>((ui + 1.0) * (gi / (1.0 + std::exp(-gi * al))));
      } else {
        const double gi = g[i];
        g[i] = static_cast<float>(gi / (1.0 + std::exp(-gi)) * u[i]);
      }
    }
    project(down, e, g.data(), n, y.data(), qz, rs);
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
