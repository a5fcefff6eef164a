// llmpipe::update_and_attend.out: write this step's K/V into the bound off-graph
// cache (see offgraph_cache.h for the binding rule), then attend in fp32.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (Float/Half/BFloat16, contiguous),
//   position [T] or [T,1] (Long or Int, consecutive), out [1,Hq,T,Dv] of out_dtype.
// Key j (logical position base + j) is visible to query i (position pos + i) iff
// key <= query and, on a layer with window w, key > query - w.
//
// With a BatchStep bound (batched runner) the rows of the step are row groups of different
// sessions: position holds each row's own position (consecutive within a group, checked against
// the bound step), each group writes to and attends over its own session's cache.
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/offgraph_cache.h"

namespace llmrt::offgraph {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

std::string geometry_mismatch(const LayerSpec& sp, const kv::StepArgs& a) {
  if (sp.kv_heads == a.Hkv && sp.head_dim == a.D && sp.v_dim == a.Dv) return "";
  return "the bound cache holds kv_heads " + std::to_string(sp.kv_heads) + ", head_dim " +
         std::to_string(sp.head_dim) + ", v_dim " + std::to_string(sp.v_dim) + " but the step has " +
         std::to_string(a.Hkv) + ", " + std::to_string(a.D) + ", " + std::to_string(a.Dv);
}

// One forward, several sessions: every row group is written to and attended over its own cache.
Tensor& batched_out(KernelRuntimeContext& ctx, const BatchStep& batch, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& position, int64_t cache_id, double scale,
                    ScalarType out_dtype, Tensor& out) {
  auto fail = [&](Error e, const std::string& msg) -> Tensor& {
    std::string m = "llmpipe::update_and_attend (batched, cache_id " + std::to_string(cache_id) + "): " + msg;
    set_last_error(m);
    ET_LOG(Error, "%s", m.c_str());
    ctx.fail(e);
    return out;
  };
  kv::StepArgs a;
  std::string why;
  if (!kv::check_step_args(q, k, v, position, out_dtype, out, &a, &why, /*consecutive=*/false))
    return fail(Error::InvalidArgument, why);
  if (batch.groups.empty() || batch.rows() != a.T)
    return fail(Error::InvalidArgument, "the bound step has " + std::to_string(batch.rows()) +
                                            " rows but the forward has " + std::to_string(a.T));
  const int layer = static_cast<int>(cache_id);
  // the slot lists live across calls: one layer after another, same step shapes
  static thread_local std::vector<StepSlots> slots;
  static thread_local std::vector<kv::Segment> segs;
  slots.resize(batch.groups.size());
  segs.resize(batch.groups.size());
  int64_t row = 0;
  for (size_t g = 0; g < batch.groups.size(); ++g) {
    const RowGroup& rg = batch.groups[g];
    for (int64_t i = 0; i < rg.T; ++i)
      if (kv::position_at(position, row + i) != rg.pos + i)
        return fail(Error::InvalidArgument, "row " + std::to_string(row + i) + " has position " +
                                                std::to_string(kv::position_at(position, row + i)) +
                                                " but the bound step puts it at " + std::to_string(rg.pos + i));
    if (cache_id < 0 || cache_id >= rg.kv->n_layers())
      return fail(Error::InvalidArgument,
                  "out of range: the bound cache has " + std::to_string(rg.kv->n_layers()) + " layers");
    std::string bad = geometry_mismatch(rg.kv->spec(layer), a);
    if (!bad.empty()) return fail(Error::InvalidArgument, bad);
    if (!rg.kv->step_slots(layer, rg.pos, rg.T, &slots[g], &why))
      return fail(Error::InvalidArgument, "row group " + std::to_string(g) + ": " + why);
    const StepSlots& sl = slots[g];
    segs[g] = kv::Segment{sl.view, rg.pos, rg.T, row, sl.base, sl.write.data(), sl.read.data()};
    row += rg.T;
  }
  if (!kv::resize_out(out, a)) return fail(Error::InvalidArgument, "cannot resize out");
  for (const kv::Segment& sg : segs) kv::write_segment(sg, k, v);
  kv::attend_segments(segs.data(), static_cast<int>(segs.size()), q, static_cast<float>(scale),
                      out.mutable_data_ptr(), static_cast<int>(out_dtype));
  return out;
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
  if (const BatchStep* batch = bound_batch())
    return batched_out(ctx, *batch, q, k, v, position, cache_id, scale, out_dtype, out);
  OffgraphKvCache* cache = bound_cache();
  if (cache == nullptr)
    return fail(Error::InvalidState,
                "no off-graph KV cache is bound: this program keeps its KV cache outside the graph "
                "(run it with --kv-max-capacity, or bind a cache before execute)");
  kv::StepArgs a;
  std::string why;
  if (!kv::check_step_args(q, k, v, position, out_dtype, out, &a, &why))
    return fail(Error::InvalidArgument, why);
  if (cache_id < 0 || cache_id >= cache->n_layers())
    return fail(Error::InvalidArgument,
                "out of range: the bound cache has " + std::to_string(cache->n_layers()) + " layers");
  const int layer = static_cast<int>(cache_id);
  const LayerSpec& sp = cache->spec(layer);
  std::string bad = geometry_mismatch(sp, a);
  if (!bad.empty()) return fail(Error::InvalidArgument, bad);
  Plan p;
  if (!cache->plan(layer, a.pos, a.T, &p, &why)) return fail(Error::InvalidArgument, why);
  if (!kv::resize_out(out, a)) return fail(Error::InvalidArgument, "cannot resize out");
  cache->ensure(layer, p.end);
  const kv::SlotView view = cache->view(layer);
  kv::write_step(view, p, k, v);
  kv::attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(out_dtype));
  return out;
}

}  // namespace
}  // namespace llmrt::offgraph

LLMPIPE_KERNEL(llmpipe, "update_and_attend.out", llmrt::offgraph::update_and_attend_out);

// Referenced by the runner so that a non-whole-archive link would fail loudly
// rather than silently drop the registration.
extern "C" int llmpipe_offgraph_kernel_linked() { return 1; }
