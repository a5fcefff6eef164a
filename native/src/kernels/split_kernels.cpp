// The `custom` cache mode's two halves, each alone (cache.custom_sdpa / cache.custom_kv_cache), as
// ExecuTorch's llama::custom_sdpa / llama::update_cache can be used; the Python twins are
// pipeline/model/cache_modes/custom_split.py. Both caches are HF's static-cache layout, BHSD [1,Hkv,S,D], flat.
//
//   llmpipe::sdpa.out(q, k_cache, v_cache, position, window, scale, *, out)
//       q [1,Hq,T,D]; attends over keys [max(0, pos-w+1) or 0, pos+T) in fp32; out [1,Hq,T,Dv] in q's dtype.
//   llmpipe::update_cache.out(k, v, k_cache!, v_cache!, position, *, out)
//       writes k [1,Hkv,T,D] / v [1,Hkv,T,Dv] at positions [pos, pos+T) in place; out [1] (zero).
#include <cstring>
#include <string>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/kv_attention.h"

namespace llmrt::kv {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

bool float_code(ScalarType t) { return element_size(static_cast<int>(t)) != 0; }

// Consecutive positions [pos, pos+T) within S slots; returns pos or -1 with why.
int64_t check_positions(const Tensor& position, int64_t T, int64_t S, std::string* why) {
  if (position.numel() != T || (position.scalar_type() != ScalarType::Long && position.scalar_type() != ScalarType::Int)) {
    *why = "position must hold T Long/Int entries";
    return -1;
  }
  const int64_t pos = T ? position_at(position, 0) : 0;
  for (int64_t i = 0; i < T; ++i)
    if (position_at(position, i) != pos + i || pos < 0) {
      *why = "positions must be consecutive and >= 0";
      return -1;
    }
  if (pos + T > S) {
    *why = "positions [" + std::to_string(pos) + ", " + std::to_string(pos + T) + ") exceed the cache's " +
           std::to_string(S) + " positions (the max context)";
    return -1;
  }
  return pos;
}

// A BHSD cache [1,heads,S,dim] of a float type.
bool bhsd(const Tensor& c, int64_t heads, int64_t dim) {
  return c.dim() == 4 && c.size(0) == 1 && c.size(1) == heads && c.size(3) == dim && float_code(c.scalar_type());
}

Tensor& sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                 const Tensor& position, int64_t window, double scale, Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::sdpa", why);
  };
  if (q.dim() != 4 || q.size(0) != 1 || !float_code(q.scalar_type()) || out.scalar_type() != q.scalar_type())
    return fail("q must be [1,Hq,T,D] Float/Half/BFloat16, out of q's dtype");
  const int64_t Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.dim() == 4 ? k_cache.size(1) : 0;
  if (Hkv < 1 || Hq % Hkv != 0 || !bhsd(k_cache, Hkv, D) || v_cache.dim() != 4 ||
      !bhsd(v_cache, Hkv, v_cache.size(3)) || v_cache.size(2) != k_cache.size(2) ||
      v_cache.scalar_type() != k_cache.scalar_type())
    return fail("caches must be [1,Hkv,S,D] and [1,Hkv,S,Dv] of one float type, Hq % Hkv == 0");
  if (window < 0) return fail("negative window " + std::to_string(window));
  const int64_t S = k_cache.size(2), Dv = v_cache.size(3);
  std::string why;
  const int64_t pos = check_positions(position, T, S, &why);
  if (pos < 0) return fail(why);
  const StepArgs a{Hq, T, D, Hkv, Dv, pos};
  if (!resize_out(out, a)) return fail("cannot resize out");
  Plan p = plan_step(0, pos, T, window, 0);
  if (window > 0) {  // a flat cache: read only the window's band
    p.base = std::max<int64_t>(0, pos - window + 1);
    p.n_read = make_runs(p.base, p.end - p.base, 0, p.read);
  }
  // the kernel only reads the caches
  const SlotView view{const_cast<uint8_t*>(static_cast<const uint8_t*>(k_cache.const_data_ptr())),
                      const_cast<uint8_t*>(static_cast<const uint8_t*>(v_cache.const_data_ptr())), Hkv, D, Dv,
                      static_cast<int>(k_cache.scalar_type()), window, S};
  attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(q.scalar_type()));
  return out;
}

Tensor& update_cache_out(KernelRuntimeContext& ctx, const Tensor& k, const Tensor& v, Tensor& k_cache,
                         Tensor& v_cache, const Tensor& position, Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::update_cache", why);
  };
  if (k.dim() != 4 || v.dim() != 4 || k.size(0) != 1 || v.size(0) != 1 || v.size(1) != k.size(1) ||
      v.size(2) != k.size(2) || !float_code(k.scalar_type()) || !float_code(v.scalar_type()))
    return fail("k, v must be [1,Hkv,T,D] and [1,Hkv,T,Dv], Float/Half/BFloat16");
  const int64_t Hkv = k.size(1), T = k.size(2), D = k.size(3), Dv = v.size(3);
  if (!bhsd(k_cache, Hkv, D) || !bhsd(v_cache, Hkv, Dv) || v_cache.size(2) != k_cache.size(2) ||
      v_cache.scalar_type() != k_cache.scalar_type())
    return fail("caches must be [1,Hkv,S,D] and [1,Hkv,S,Dv] of one float type, matching k and v");
  const int64_t S = k_cache.size(2);
  std::string why;
  const int64_t pos = check_positions(position, T, S, &why);
  if (pos < 0) return fail(why);
  SizesType one[1] = {1};
  if (executorch::runtime::resize_tensor(out, {one, 1}) != Error::Ok || !float_code(out.scalar_type()))
    return fail("cannot resize out to [1]");
  std::memset(out.mutable_data_ptr(), 0, out.nbytes());
  const Plan p = plan_step(0, pos, T, 0, 0);
  const SlotView view{static_cast<uint8_t*>(k_cache.mutable_data_ptr()),
                      static_cast<uint8_t*>(v_cache.mutable_data_ptr()), Hkv, D, Dv,
                      static_cast<int>(k_cache.scalar_type()), 0, S};
  write_step(view, p, k, v);
  return out;
}

}  // namespace
}  // namespace llmrt::kv

LLMPIPE_KERNEL(llmpipe, "sdpa.out", llmrt::kv::sdpa_out);
LLMPIPE_KERNEL(llmpipe, "update_cache.out", llmrt::kv::update_cache_out);
