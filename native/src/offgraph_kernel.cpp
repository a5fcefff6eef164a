// llmpipe::update_and_attend.out: write this step's K/V into the bound off-graph
// cache (see offgraph_cache.h for the binding rule), then attend in fp32.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (Float/Half/BFloat16, contiguous),
//   position [T] or [T,1] (Long or Int, consecutive), out [1,Hq,T,Dv] of out_dtype.
// Key j (logical position base + j) is visible to query i (position pos + i) iff
// key <= query and, on a layer with window w, key > query - w.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include "offgraph_cache.h"

namespace llmrt::offgraph {
namespace {

using executorch::aten::BFloat16;
using executorch::aten::Half;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

inline float load(const void* p, ScalarType t, int64_t i) {
  switch (t) {
    case ScalarType::Float: return static_cast<const float*>(p)[i];
    case ScalarType::Half: return static_cast<float>(static_cast<const Half*>(p)[i]);
    case ScalarType::BFloat16: return static_cast<float>(static_cast<const BFloat16*>(p)[i]);
    default: return 0.f;
  }
}

inline void store(void* p, int code, int64_t i, float x) {
  switch (code) {
    case kFloat: static_cast<float*>(p)[i] = x; break;
    case kHalf: static_cast<Half*>(p)[i] = Half(x); break;
    case kBFloat16: static_cast<BFloat16*>(p)[i] = BFloat16(x); break;
    default: break;
  }
}

template <typename S>
inline float as_float(S x) {
  return static_cast<float>(x);
}

// The attention over the gathered history, templated on the storage type.
template <typename S>
void attend(OffgraphKvCache& cache, const Plan& p, const std::vector<float>& qf, int64_t Hq,
            int64_t Hkv, int64_t D, int64_t Dv, float scale, void* out, int out_code) {
  const int64_t S_len = p.span(), T = p.T, group = Hq / Hkv;
  const int64_t w = cache.spec(p.layer).window;
  std::vector<const S*> kp(S_len), vp(S_len);
  {
    int64_t j = 0;
    for (int r = 0; r < p.n_read; ++r)
      for (int64_t s = 0; s < p.read[r].count; ++s, ++j) {
        kp[j] = reinterpret_cast<const S*>(cache.k_slot(p.layer, p.read[r].slot + s));
        vp[j] = reinterpret_cast<const S*>(cache.v_slot(p.layer, p.read[r].slot + s));
      }
  }
  std::vector<float> scores(S_len), acc(Dv);
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t kh = h / group;
    for (int64_t i = 0; i < T; ++i) {
      const int64_t qpos = p.pos + i;
      int64_t lo = p.base, hi = qpos;  // visible logical keys [lo, hi]
      if (w > 0) lo = std::max(lo, qpos - w + 1);
      const float* qrow = qf.data() + (h * T + i) * D;
      float mx = -INFINITY;
      for (int64_t key = lo; key <= hi; ++key) {
        const S* kr = kp[key - p.base] + kh * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qrow[d] * as_float(kr[d]);
        dot *= scale;
        scores[key - lo] = dot;
        mx = std::max(mx, dot);
      }
      float sum = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t key = lo; key <= hi; ++key) {
        float e = std::exp(scores[key - lo] - mx);
        sum += e;
        const S* vr = vp[key - p.base] + kh * Dv;
        float* a = acc.data();
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) a[d] += e * as_float(vr[d]);
      }
      const float inv = 1.f / sum;
      const int64_t o = (h * T + i) * Dv;
      for (int64_t d = 0; d < Dv; ++d) store(out, out_code, o + d, acc[d] * inv);
    }
  }
}

bool float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

Tensor& update_and_attend_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& position, int64_t cache_id,
                              double scale, ScalarType out_dtype, Tensor& out) {
  auto fail = [&](Error e, const std::string& msg) -> Tensor& {
    std::string m = "llmpipe::update_and_attend (cache_id " + std::to_string(cache_id) + "): " + msg;
    set_last_error(m);
    ET_LOG(Error, "%s", m.c_str());
    ctx.fail(e);
    return out;
  };
  OffgraphKvCache* cache = bound_cache();
  if (cache == nullptr)
    return fail(Error::InvalidState,
                "no off-graph KV cache is bound: this program keeps its KV cache outside the graph "
                "(run it with --kv-max-capacity, or bind a cache before execute)");
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    return fail(Error::InvalidArgument, "q, k, v must be 4-d [B,H,T,D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3);
  if (B != 1) return fail(Error::InvalidArgument, "batch must be 1, got " + std::to_string(B));
  if (k.size(0) != 1 || v.size(0) != 1 || k.size(2) != T || v.size(2) != T || k.size(3) != D ||
      v.size(1) != Hkv || Hkv < 1 || Hq % Hkv != 0)
    return fail(Error::InvalidArgument, "inconsistent q/k/v shapes (or Hq % Hkv != 0)");
  if (!float_like(q.scalar_type()) || !float_like(k.scalar_type()) || !float_like(v.scalar_type()))
    return fail(Error::InvalidArgument, "q, k, v must be Float, Half or BFloat16");
  const int out_code = static_cast<int>(out_dtype);
  if (element_size(out_code) == 0)
    return fail(Error::InvalidArgument, "out_dtype must be Float, Half or BFloat16");
  if (out.scalar_type() != out_dtype)
    return fail(Error::InvalidArgument, "out tensor dtype differs from out_dtype");
  if (position.numel() != T || (position.scalar_type() != ScalarType::Long &&
                                position.scalar_type() != ScalarType::Int))
    return fail(Error::InvalidArgument, "position must hold T Long/Int entries");
  auto pos_at = [&](int64_t i) -> int64_t {
    return position.scalar_type() == ScalarType::Long ? position.const_data_ptr<int64_t>()[i]
                                                      : position.const_data_ptr<int32_t>()[i];
  };
  const int64_t pos = pos_at(0);
  for (int64_t i = 1; i < T; ++i)
    if (pos_at(i) != pos + i) return fail(Error::InvalidArgument, "positions must be consecutive");
  if (cache_id < 0 || cache_id >= cache->n_layers())
    return fail(Error::InvalidArgument,
                "out of range: the bound cache has " + std::to_string(cache->n_layers()) + " layers");
  const int layer = static_cast<int>(cache_id);
  const LayerSpec& sp = cache->spec(layer);
  if (sp.kv_heads != Hkv || sp.head_dim != D || sp.v_dim != Dv)
    return fail(Error::InvalidArgument,
                "the bound cache holds kv_heads " + std::to_string(sp.kv_heads) + ", head_dim " +
                    std::to_string(sp.head_dim) + ", v_dim " + std::to_string(sp.v_dim) +
                    " but the step has " + std::to_string(Hkv) + ", " + std::to_string(D) + ", " +
                    std::to_string(Dv));
  Plan p;
  std::string why;
  if (!cache->plan(layer, pos, T, &p, &why)) return fail(Error::InvalidArgument, why);
  {
    executorch::aten::SizesType sizes[4] = {1, static_cast<executorch::aten::SizesType>(Hq),
                                            static_cast<executorch::aten::SizesType>(T),
                                            static_cast<executorch::aten::SizesType>(Dv)};
    if (executorch::runtime::resize_tensor(out, {sizes, 4}) != Error::Ok)
      return fail(Error::InvalidArgument, "cannot resize out");
  }
  cache->ensure(layer, p.end);

  // write: input [1,Hkv,T,D] -> storage [slot][Hkv][D]
  const int code = cache->dtype();
  {
    int64_t t = 0;
    for (int r = 0; r < p.n_write; ++r)
      for (int64_t s = 0; s < p.write[r].count; ++s, ++t) {
        uint8_t* ks = cache->k_slot(layer, p.write[r].slot + s);
        uint8_t* vs = cache->v_slot(layer, p.write[r].slot + s);
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t d = 0; d < D; ++d)
            store(ks, code, h * D + d, load(k.const_data_ptr(), k.scalar_type(), (h * T + t) * D + d));
          for (int64_t d = 0; d < Dv; ++d)
            store(vs, code, h * Dv + d, load(v.const_data_ptr(), v.scalar_type(), (h * T + t) * Dv + d));
        }
      }
  }
  std::vector<float> qf(static_cast<size_t>(Hq * T * D));
  for (int64_t i = 0; i < Hq * T * D; ++i) qf[i] = load(q.const_data_ptr(), q.scalar_type(), i);
  const float sc = static_cast<float>(scale);
  switch (code) {
    case kFloat: attend<float>(*cache, p, qf, Hq, Hkv, D, Dv, sc, out.mutable_data_ptr(), out_code); break;
    case kHalf: attend<Half>(*cache, p, qf, Hq, Hkv, D, Dv, sc, out.mutable_data_ptr(), out_code); break;
    case kBFloat16:
      attend<BFloat16>(*cache, p, qf, Hq, Hkv, D, Dv, sc, out.mutable_data_ptr(), out_code);
      break;
    default: return fail(Error::InvalidState, "bad storage dtype");
  }
  return out;
}

}  // namespace
}  // namespace llmrt::offgraph

EXECUTORCH_LIBRARY(llmpipe, "update_and_attend.out", llmrt::offgraph::update_and_attend_out);

// Referenced by the runner so that a non-whole-archive link would fail loudly
// rather than silently drop the registration.
extern "C" int llmpipe_offgraph_kernel_linked() { return 1; }
