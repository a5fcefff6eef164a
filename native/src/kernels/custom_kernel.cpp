// llmpipe::cached_attention.out: the `custom` cache mode's fused attention. The KV cache is a
// mutable buffer of the program (one per layer); the op writes this step's K/V into it in place
// and attends over the history with the attention core shared with the off-graph op.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv]; k_cache [slots,Hkv,D], v_cache [slots,Hkv,Dv];
//   position [T] (consecutive), window (0 = full attention over a flat cache of `slots` positions;
//   w > 0 = a ring of `slots`, slot = position % slots; a wrapping step needs w + T - 1 <= slots);
//   out [1,Hq,T,Dv] in q's dtype.
#include <string>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/kv_attention.h"

namespace llmrt::kv {
namespace {

using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

Tensor& cached_attention_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                             Tensor& k_cache, Tensor& v_cache, const Tensor& position, int64_t window,
                             double scale, Tensor& out) {
  auto fail = [&](const std::string& msg) -> Tensor& {
    ET_LOG(Error, "llmpipe::cached_attention: %s", msg.c_str());
    ctx.fail(Error::InvalidArgument);
    return out;
  };
  StepArgs a;
  std::string why;
  if (!check_step_args(q, k, v, position, q.scalar_type(), out, &a, &why)) return fail(why);
  if (k_cache.dim() != 3 || v_cache.dim() != 3 || k_cache.size(1) != a.Hkv || k_cache.size(2) != a.D ||
      v_cache.size(0) != k_cache.size(0) || v_cache.size(1) != a.Hkv || v_cache.size(2) != a.Dv)
    return fail("caches must be [slots,Hkv,D] and [slots,Hkv,Dv] matching k and v");
  const int dtype = static_cast<int>(k_cache.scalar_type());
  if (element_size(dtype) == 0 || v_cache.scalar_type() != k_cache.scalar_type())
    return fail("caches must both be Float, Half or BFloat16");
  const int64_t slots = k_cache.size(0);
  if (window < 0) return fail("negative window " + std::to_string(window));
  if (window == 0 && a.pos + a.T > slots)
    return fail("positions [" + std::to_string(a.pos) + ", " + std::to_string(a.pos + a.T) +
                ") exceed the cache's " + std::to_string(slots) + " positions (the max context)");
  if (window > 0 && a.pos + a.T > slots && a.T + window - 1 > slots)  // a wrapping step keeps its window
    return fail("a step of " + std::to_string(a.T) + " tokens does not fit a ring of " +
                std::to_string(slots) + " slots with window " + std::to_string(window));
  if (!resize_out(out, a)) return fail("cannot resize out");
  const Plan p = plan_step(0, a.pos, a.T, window, window > 0 ? slots : 0);
  const SlotView view{static_cast<uint8_t*>(k_cache.mutable_data_ptr()), static_cast<uint8_t*>(v_cache.mutable_data_ptr()), a.Hkv, a.D,
                      a.Dv, dtype, window};
  write_step(view, p, k, v);
  attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(q.scalar_type()));
  return out;
}

}  // namespace
}  // namespace llmrt::kv

LLMPIPE_KERNEL(llmpipe, "cached_attention.out", llmrt::kv::cached_attention_out);
