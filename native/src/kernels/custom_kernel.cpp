// llmpipe::cached_attention.out: the `custom` cache mode's fused attention. The KV cache is a
// mutable buffer of the program (one per layer); the op writes this step's K/V into it in place
// and attends over the history with the attention core shared with the off-graph op.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv]; k_cache [slots,Hkv,D], v_cache [slots,Hkv,Dv] (Float, Half or
//   BFloat16; or Char: int8 rows, D values and a 4-byte scale per group of 32 each; or Byte: rotated int4 rows, two
//   values a byte and a 2-byte scale per group of 32, kv_attention.h);
//   position [T] (consecutive), window (0 = full attention over a flat cache of `slots` positions;
//   w > 0 = a ring of `slots`, slot = position % slots; a wrapping step needs w + T - 1 <= slots);
//   sinks: none, or Float [Hq] (gpt-oss: a per-head logit each row's softmax also counts); out [1,Hq,T,Dv] in q's dtype.
#include <optional>
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
                             double scale, const std::optional<Tensor>& sinks, Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::cached_attention", why);
  };
  StepArgs a;
  std::string why;
  if (!check_step_args(q, k, v, position, q.scalar_type(), out, &a, &why)) return fail(why);
  const int dtype = static_cast<int>(k_cache.scalar_type());
  if (row_bytes(dtype, 1) == 0 || v_cache.scalar_type() != k_cache.scalar_type())
    return fail("caches must both be Float, Half, BFloat16, Char (int8 rows) or Byte (int4 rows)");
  if (k_cache.dim() != 3 || v_cache.dim() != 3 || k_cache.size(1) != a.Hkv ||
      k_cache.size(2) != row_elements(dtype, a.D) || v_cache.size(0) != k_cache.size(0) || v_cache.size(1) != a.Hkv ||
      v_cache.size(2) != row_elements(dtype, a.Dv))
    return fail("caches must be [slots,Hkv,D] and [slots,Hkv,Dv] matching k and v (int8, int4: rows with scales)");
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
  SlotView view{static_cast<uint8_t*>(k_cache.mutable_data_ptr()), static_cast<uint8_t*>(v_cache.mutable_data_ptr()), a.Hkv, a.D,
                a.Dv, dtype, window};
  if (!check_sinks(sinks, a.Hq, &view.sinks, &why)) return fail(why);
  write_step(view, p, k, v);
  attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(q.scalar_type()));
  return out;
}

// llmpipe::cached_attend.out: a KV-shared layer attends over its source layer's buffers (written by the
// source's cached_attention earlier in this forward) without writing; q may hold only the step's last rows.
Tensor& cached_attend_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                          const Tensor& position, int64_t window, double scale, const std::optional<Tensor>& sinks,
                          Tensor& out) {
  auto fail = [&](const std::string& why) -> Tensor& {
    return ::llmrt::kernels::refuse(ctx, out, "llmpipe::cached_attend", why);
  };
  const int dtype = static_cast<int>(k_cache.scalar_type());
  if (row_bytes(dtype, 1) == 0 || v_cache.scalar_type() != k_cache.scalar_type())
    return fail("caches must both be Float, Half, BFloat16, Char (int8 rows) or Byte (int4 rows)");
  if (q.dim() != 4 || q.size(0) != 1 || k_cache.dim() != 3 || v_cache.dim() != 3 ||
      v_cache.size(0) != k_cache.size(0) || v_cache.size(1) != k_cache.size(1) ||
      k_cache.size(2) != row_elements(dtype, q.size(3)) || row_values(dtype, v_cache.size(2)) < 1)
    return fail("q must be [1,Hq,T,D] and the caches [slots,Hkv,D], [slots,Hkv,Dv] (int8, int4: rows with scales)");
  StepArgs a;
  a.Hq = q.size(1), a.T = q.size(2), a.D = q.size(3), a.Hkv = k_cache.size(1);
  a.Dv = row_values(dtype, v_cache.size(2));
  if (a.Hq % a.Hkv != 0) return fail("query heads are not a multiple of the KV heads");
  if (element_size(static_cast<int>(q.scalar_type())) == 0) return fail("q must be Float, Half or BFloat16");
  if (position.numel() != a.T || a.T < 1) return fail("position must have one entry per query row");
  a.pos = position_at(position, 0);
  for (int64_t i = 1; i < a.T; ++i)
    if (position_at(position, i) != a.pos + i) return fail("positions must be consecutive");
  const int64_t slots = k_cache.size(0);
  if (window < 0 || a.pos < 0 || (window == 0 && a.pos + a.T > slots) || (window > 0 && a.T + window - 1 > slots &&
                                                                          a.pos + a.T > slots))
    return fail("positions [" + std::to_string(a.pos) + ", " + std::to_string(a.pos + a.T) +
                ") do not fit a cache of " + std::to_string(slots) + " slots with window " + std::to_string(window));
  if (!resize_out(out, a)) return fail("cannot resize out");
  const Plan p = plan_step(0, a.pos, a.T, window, window > 0 ? slots : 0);
  SlotView view{static_cast<uint8_t*>(const_cast<void*>(k_cache.const_data_ptr())),
                static_cast<uint8_t*>(const_cast<void*>(v_cache.const_data_ptr())), a.Hkv, a.D, a.Dv, dtype, window};
  std::string why;
  if (!check_sinks(sinks, a.Hq, &view.sinks, &why)) return fail(why);
  attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(q.scalar_type()));
  return out;
}

}  // namespace
}  // namespace llmrt::kv

LLMPIPE_KERNEL(llmpipe, "cached_attention.out", llmrt::kv::cached_attention_out);
LLMPIPE_KERNEL(llmpipe, "cached_attend.out", llmrt::kv::cached_attend_out);
