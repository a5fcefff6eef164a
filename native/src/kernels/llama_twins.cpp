// Twins of ExecuTorch's LLM custom ops (extension/llm/custom_ops), for runners that cannot link ExecuTorch's own
// kernels (the wheel's libcustom_ops_aot_lib.so needs libtorch). Same schemas, same semantics: a cache.mode=stock
// program runs on these in our runners and on ExecuTorch's in any app that carries its LLM ops.
//
//   llama::update_cache.out(value [B,T,H,D], cache! [B,S,H,D], start_pos, *, out) -> out
//       cache[:, start_pos : start_pos+T] = value (same dtype); out is a placeholder, left as it is.
//   llama::custom_sdpa.out(q [B,T,Hq,D], k_cache [B,S,Hkv,D], v_cache, start_pos, attn_mask?, dropout_p,
//                          is_causal, scale?, *, out [B,T,Hq,D])
//       No mask: keys [0, start_pos+T); is_causal: row i sees keys [0, start_pos+i]. attn_mask: Float [T,S], added
//       after scaling, every one of the S keys read, start_pos ignored, is_causal must be false. GQA: query head h
//       reads KV head h / (Hq/Hkv). Scale default 1/sqrt(D). fp32 math; q, caches and out of one float dtype.
//       The causal case runs on our attention core (kv_attention.h: [1,S,Hkv,D] is its flat slot-major layout), the
//       others on the plain loop below.
//
// Registered in their own library (llmpipe_llama_ops), linked into our runners only: the Python runtime loads
// ExecuTorch's real ones, and two kernels under one name collide.
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/core/exec_aten/util/dim_order_util.h>
#include <executorch/runtime/core/portable_type/tensor_impl.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/checked_kernel.h"
#include "kernels/kv_attention.h"

namespace llmrt::llama {
namespace {

using executorch::aten::BFloat16;
using executorch::aten::Half;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool contiguous(const Tensor& t) {
  return executorch::runtime::is_contiguous_dim_order(t.dim_order().data(), t.dim());
}

bool float_type(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

Tensor& update_cache_out(KernelRuntimeContext& ctx, const Tensor& value, Tensor& cache, int64_t start_pos,
                         Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llama::update_cache", why);
  };
  if (value.dim() != 4 || cache.dim() != 4) return fail("value and cache must be 4-d [B,T,H,D] / [B,S,H,D]");
  if (value.size(0) != cache.size(0) || value.size(2) != cache.size(2) || value.size(3) != cache.size(3))
    return fail("value and cache differ in batch, heads or head dim");
  if (value.scalar_type() != cache.scalar_type()) return fail("value and cache must have one dtype");
  if (!contiguous(value) || !contiguous(cache)) return fail("value and cache must be contiguous");
  const int64_t T = value.size(1), S = cache.size(1);
  if (start_pos < 0 || start_pos >= S || start_pos + T > S)
    return fail("positions [" + std::to_string(start_pos) + ", " + std::to_string(start_pos + T) +
                ") do not fit the cache's " + std::to_string(S));
  const size_t row = static_cast<size_t>(value.size(2) * value.size(3)) * value.element_size();
  const auto* src = static_cast<const uint8_t*>(value.const_data_ptr());
  auto* dst = static_cast<uint8_t*>(cache.mutable_data_ptr());
  for (int64_t b = 0; b < value.size(0); ++b)
    std::memcpy(dst + (b * S + start_pos) * row, src + b * T * row, T * row);
  return out;
}

template <typename E>
inline float as_float(E x) {
  return static_cast<float>(x);
}

// A dot product in 8 independent sums: the compiler vectorizes it (a single running sum is a dependency chain).
template <typename E>
inline float dot(const float* q, const E* k, int64_t D) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * as_float(k[d + l]);
  float s = 0;
  for (; d < D; ++d) s += q[d] * as_float(k[d]);
  for (int l = 0; l < 8; ++l) s += acc[l];
  return s;
}

template <typename E>
inline void axpy(float a, const E* v, float* y, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] += a * as_float(v[d]);
}

struct Sdpa {
  int64_t B, T, Hq, Hkv, D, S;
  int64_t start_pos, keys;  // keys read: start_pos + T, or S under a mask
  bool causal;
  float scale;
  const float* mask;  // [T][S], or null
};

// One (batch, query head, row) per unit, over the threadpool: scores in fp32, a max-subtracted softmax, the
// weighted sum of the values; a key the mask sets to -inf (or the causal rule hides) is skipped, exactly an exp 0.
template <typename E>
void sdpa_kernel(const Sdpa& a, const E* q, const E* k, const E* v, E* out) {
  const int64_t group = a.Hq / a.Hkv, units = a.B * a.Hq * a.T;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  executorch::extension::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> qf(a.D), acc(a.D), scores(a.keys);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u % a.T, h = (u / a.T) % a.Hq, b = u / (a.T * a.Hq), kh = h / group;
      const E* qrow = q + ((b * a.T + t) * a.Hq + h) * a.D;
      for (int64_t d = 0; d < a.D; ++d) qf[d] = as_float(qrow[d]);
      const int64_t last = a.causal ? a.start_pos + t + 1 : a.keys;  // keys [0, last) visible before the mask
      const float* mrow = a.mask ? a.mask + t * a.S : nullptr;
      float mx = neg_inf;
      for (int64_t j = 0; j < last; ++j) {
        const float m = mrow ? mrow[j] : 0.f;
        if (m == neg_inf) {
          scores[j] = neg_inf;
          continue;
        }
        scores[j] = dot(qf.data(), k + ((b * a.S + j) * a.Hkv + kh) * a.D, a.D) * a.scale + m;
        mx = std::max(mx, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float sum = 0.f;
      if (mx != neg_inf) {  // a row that sees no key stays 0
        for (int64_t j = 0; j < last; ++j) {
          if (scores[j] == neg_inf) continue;
          const float p = std::exp(scores[j] - mx);
          sum += p;
          axpy(p, v + ((b * a.S + j) * a.Hkv + kh) * a.D, acc.data(), a.D);
        }
      }
      E* orow = out + ((b * a.T + t) * a.Hq + h) * a.D;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t d = 0; d < a.D; ++d) orow[d] = static_cast<E>(acc[d] * inv);
    }
  });
}

// is_causal without a mask: per batch, the attention core's step at start_pos over the flat cache (keys [0, start_pos+i]
// for row i), which takes q and gives out head-major [1,Hq,T,D]: both go through that layout in a scratch buffer.
void causal_on_core(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t start_pos, float scale,
                    Tensor& out) {
  using executorch::aten::DimOrderType;
  using executorch::aten::SizesType;
  using executorch::aten::StridesType;
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2);
  const size_t row = static_cast<size_t>(D) * q.element_size();
  std::vector<uint8_t> qh(static_cast<size_t>(T * Hq) * row), oh(qh.size());
  SizesType sizes[4] = {1, static_cast<SizesType>(Hq), static_cast<SizesType>(T), static_cast<SizesType>(D)};
  DimOrderType order[4] = {0, 1, 2, 3};
  StridesType strides[4] = {static_cast<StridesType>(Hq * T * D), static_cast<StridesType>(T * D),
                            static_cast<StridesType>(D), 1};
  executorch::runtime::etensor::TensorImpl impl(q.scalar_type(), 4, sizes, qh.data(), order, strides);
  const Tensor qt(&impl);
  const int code = static_cast<int>(q.scalar_type());
  const auto* qd = static_cast<const uint8_t*>(q.const_data_ptr());
  auto* od = static_cast<uint8_t*>(out.mutable_data_ptr());
  const size_t batch = static_cast<size_t>(T * Hq) * row, cache = static_cast<size_t>(S * Hkv) * row;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hq; ++h) std::memcpy(&qh[(h * T + t) * row], qd + b * batch + (t * Hq + h) * row, row);
    // the core only reads the caches here
    const kv::SlotView view{const_cast<uint8_t*>(static_cast<const uint8_t*>(k_cache.const_data_ptr())) + b * cache,
                            const_cast<uint8_t*>(static_cast<const uint8_t*>(v_cache.const_data_ptr())) + b * cache,
                            Hkv, D, D, code, 0};
    kv::attend(view, kv::plan_step(0, start_pos, T, 0, 0), qt, scale, oh.data(), code);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hq; ++h) std::memcpy(od + b * batch + (t * Hq + h) * row, &oh[(h * T + t) * row], row);
  }
}

Tensor& custom_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        int64_t start_pos, const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                        std::optional<double> scale, Tensor& out) {
  (void)dropout_p;  // ExecuTorch's kernel ignores it too
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llama::custom_sdpa", why);
  };
  if (attn_mask.has_value() && is_causal) return fail("attn_mask and is_causal cannot be set at the same time");
  if (q.dim() != 4 || k_cache.dim() != 4 || v_cache.dim() != 4) return fail("q and the caches must be 4-d");
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), S = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2);
  if (k_cache.size(0) != B || v_cache.size(0) != B || v_cache.size(1) != S || v_cache.size(2) != Hkv ||
      k_cache.size(3) != D || v_cache.size(3) != D || Hkv < 1 || Hq % Hkv != 0)
    return fail("q [B,T,Hq,D] and caches [B,S,Hkv,D] disagree (or Hq % Hkv != 0)");
  if (!float_type(q.scalar_type()) || k_cache.scalar_type() != q.scalar_type() ||
      v_cache.scalar_type() != q.scalar_type() || out.scalar_type() != q.scalar_type())
    return fail("q, the caches and out must be of one dtype: Float, Half or BFloat16");
  if (!contiguous(q) || !contiguous(k_cache) || !contiguous(v_cache)) return fail("q and the caches must be contiguous");
  const float* mask = nullptr;
  if (attn_mask.has_value()) {
    const Tensor& m = *attn_mask;
    if (m.dim() != 2 || m.scalar_type() != ScalarType::Float || m.size(0) != T || m.size(1) != S || !contiguous(m))
      return fail("attn_mask must be Float [T, S] (S: the cache's length), contiguous");
    mask = m.const_data_ptr<float>();
  } else if (start_pos < 0 || start_pos + T > S) {
    return fail("keys [0, " + std::to_string(start_pos + T) + ") exceed the cache's " + std::to_string(S));
  }
  if (executorch::runtime::resize_tensor(out, q.sizes()) != Error::Ok) return fail("cannot resize out to q's shape");
  const float sc = scale.has_value() ? static_cast<float>(*scale) : 1.f / std::sqrt(static_cast<float>(D));
  if (is_causal && !mask) {
    causal_on_core(q, k_cache, v_cache, start_pos, sc, out);
    return out;
  }
  const Sdpa a{B, T, Hq, Hkv, D, S, start_pos, mask ? S : start_pos + T, is_causal && !mask, sc, mask};
  switch (q.scalar_type()) {
    case ScalarType::Float:
      sdpa_kernel(a, q.const_data_ptr<float>(), k_cache.const_data_ptr<float>(), v_cache.const_data_ptr<float>(),
                  out.mutable_data_ptr<float>());
      break;
    case ScalarType::Half:
      sdpa_kernel(a, q.const_data_ptr<Half>(), k_cache.const_data_ptr<Half>(), v_cache.const_data_ptr<Half>(),
                  out.mutable_data_ptr<Half>());
      break;
    default:
      sdpa_kernel(a, q.const_data_ptr<BFloat16>(), k_cache.const_data_ptr<BFloat16>(),
                  v_cache.const_data_ptr<BFloat16>(), out.mutable_data_ptr<BFloat16>());
      break;
  }
  return out;
}

}  // namespace
}  // namespace llmrt::llama

LLMPIPE_KERNEL(llama, "update_cache.out", llmrt::llama::update_cache_out);
LLMPIPE_KERNEL(llama, "custom_sdpa.out", llmrt::llama::custom_sdpa_out);
