// llmpipe::update_and_attend.out: write this step's K/V into the bound off-graph
// cache (see offgraph_cache.h for the binding rule), then attend in fp32.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (Float/Half/BFloat16, contiguous),
//   position [T] or [T,1] (Long or Int, consecutive), sinks none or Float [Hq] (gpt-oss: a per-head logit
//   each row's softmax also counts), out [1,Hq,T,Dv] of out_dtype.
// Key j (logical position base + j) is visible to query i (position pos + i) iff
// key <= query and, on a layer with window w, key > query - w.
//
// With a BatchStep bound (batched runner) the rows of the step are row groups of different
// sessions: position holds each row's own position (consecutive within a group, checked against
// the bound step), each group writes to and attends over its own session's cache.
#include <optional>
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
                    ScalarType out_dtype, const float* sinks, Tensor& out) {
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
    segs[g].view.sinks = sinks;
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
                              double scale, ScalarType out_dtype, const std::optional<Tensor>& sinks,
                              Tensor& out) {
  auto fail = [&](Error e, const std::string& msg) -> Tensor& {
    std::string m = "llmpipe::update_and_attend (cache_id " + std::to_string(cache_id) + "): " + msg;
    set_last_error(m);
    ET_LOG(Error, "%s", m.c_str());
    ctx.fail(e);
    return out;
  };
  const float* sink_logits = nullptr;
  std::string why;
  if (q.dim() != 4 || !kv::check_sinks(sinks, q.size(1), &sink_logits, &why))
    return fail(Error::InvalidArgument, q.dim() != 4 ? "q must be 4-d [B,H,T,D]" : why);
  if (const BatchStep* batch = bound_batch())
    return batched_out(ctx, *batch, q, k, v, position, cache_id, scale, out_dtype, sink_logits, out);
  OffgraphKvCache* cache = bound_cache();
  if (cache == nullptr)
    return fail(Error::InvalidState,
                "no off-graph KV cache is bound: this program keeps its KV cache outside the graph "
                "(run it with --kv-max-capacity, or bind a cache before execute)");
  kv::StepArgs a;
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
  kv::SlotView view = cache->view(layer);
  view.sinks = sink_logits;
  kv::write_step(view, p, k, v);
  kv::attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(out_dtype));
  return out;
}

// A KV-shared layer's query rows: q [1,Hq,T,D] (float types) at consecutive positions (checked for a single
// cache; a batched step's rows are checked against its groups), against cache geometry `sp`.
bool check_read_args(const Tensor& q, const Tensor& position, ScalarType out_dtype, const LayerSpec& sp,
                     bool consecutive, kv::StepArgs* a, std::string* why) {
  if (q.dim() != 4 || q.size(0) != 1) return *why = "q must be [1,Hq,T,D]", false;
  if (kv::element_size(static_cast<int>(q.scalar_type())) == 0 ||
      kv::element_size(static_cast<int>(out_dtype)) == 0)
    return *why = "q and out_dtype must be Float, Half or BFloat16", false;
  a->Hq = q.size(1), a->T = q.size(2), a->D = q.size(3), a->Hkv = sp.kv_heads, a->Dv = sp.v_dim;
  if (a->D != sp.head_dim || a->Hq % sp.kv_heads != 0)
    return *why = "the query [" + std::to_string(a->Hq) + " heads, dim " + std::to_string(a->D) +
                  "] does not fit the cache's " + std::to_string(sp.kv_heads) + " KV heads of dim " +
                  std::to_string(sp.head_dim), false;
  if (position.numel() != a->T || a->T < 1)
    return *why = "position has " + std::to_string(position.numel()) + " entries for T=" + std::to_string(a->T), false;
  a->pos = kv::position_at(position, 0);
  if (consecutive)
    for (int64_t i = 1; i < a->T; ++i)
      if (kv::position_at(position, i) != a->pos + i) return *why = "positions must be consecutive", false;
  return true;
}

// llmpipe::attend_cached.out: a KV-shared layer attends over cache `cache_id` (its source layer's, written
// earlier in this forward) without writing. The queries may be only the last rows of the step.
Tensor& attend_cached_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& position, int64_t cache_id,
                          double scale, ScalarType out_dtype, const std::optional<Tensor>& sinks, Tensor& out) {
  auto fail = [&](Error e, const std::string& msg) -> Tensor& {
    std::string m = "llmpipe::attend_cached (cache_id " + std::to_string(cache_id) + "): " + msg;
    set_last_error(m);
    ET_LOG(Error, "%s", m.c_str());
    ctx.fail(e);
    return out;
  };
  kv::StepArgs a;
  std::string why;
  const float* sink_logits = nullptr;
  if (q.dim() != 4 || !kv::check_sinks(sinks, q.size(1), &sink_logits, &why))
    return fail(Error::InvalidArgument, q.dim() != 4 ? "q must be 4-d [B,H,T,D]" : why);
  if (const BatchStep* batch = bound_batch()) {
    static thread_local std::vector<StepSlots> slots;
    static thread_local std::vector<kv::Segment> segs;
    slots.resize(batch->groups.size());
    segs.resize(batch->groups.size());
    if (batch->groups.empty()) return fail(Error::InvalidArgument, "the bound step has no rows");
    StepKv* first = batch->groups[0].kv;
    if (cache_id < 0 || cache_id >= first->n_layers())
      return fail(Error::InvalidArgument, "out of range: the bound cache has " + std::to_string(first->n_layers()) +
                                              " layers");
    const int layer = static_cast<int>(cache_id);
    if (!check_read_args(q, position, out_dtype, first->spec(layer), false, &a, &why))
      return fail(Error::InvalidArgument, why);
    if (batch->rows() != a.T)
      return fail(Error::InvalidArgument, "the bound step has " + std::to_string(batch->rows()) +
                                              " rows but the query has " + std::to_string(a.T));
    int64_t row = 0;
    for (size_t g = 0; g < batch->groups.size(); ++g) {
      const RowGroup& rg = batch->groups[g];
      for (int64_t i = 0; i < rg.T; ++i)
        if (kv::position_at(position, row + i) != rg.pos + i)
          return fail(Error::InvalidArgument, "row " + std::to_string(row + i) + " is not at the bound step's position");
      if (!rg.kv->step_slots(layer, rg.pos, rg.T, &slots[g], &why))
        return fail(Error::InvalidArgument, "row group " + std::to_string(g) + ": " + why);
      const StepSlots& sl = slots[g];
      segs[g] = kv::Segment{sl.view, rg.pos, rg.T, row, sl.base, sl.write.data(), sl.read.data()};
      segs[g].view.sinks = sink_logits;
      row += rg.T;
    }
    if (!kv::resize_out(out, a)) return fail(Error::InvalidArgument, "cannot resize out");
    kv::attend_segments(segs.data(), static_cast<int>(segs.size()), q, static_cast<float>(scale),
                        out.mutable_data_ptr(), static_cast<int>(out_dtype));
    return out;
  }
  OffgraphKvCache* cache = bound_cache();
  if (cache == nullptr)
    return fail(Error::InvalidState, "no off-graph KV cache is bound (run it with --kv-max-capacity, or bind a "
                                     "cache before execute)");
  if (cache_id < 0 || cache_id >= cache->n_layers())
    return fail(Error::InvalidArgument,
                "out of range: the bound cache has " + std::to_string(cache->n_layers()) + " layers");
  const int layer = static_cast<int>(cache_id);
  const LayerSpec& sp = cache->spec(layer);
  if (!check_read_args(q, position, out_dtype, sp, true, &a, &why)) return fail(Error::InvalidArgument, why);
  const int64_t end = a.pos + a.T, ring = cache->ring_slots(layer);
  if (a.pos < 0 || end > cache->capacity() || (ring == 0 && end > cache->allocated(layer)))
    return fail(Error::InvalidArgument, "positions [" + std::to_string(a.pos) + ", " + std::to_string(end) +
                                            ") were not written to this cache");
  if (ring != 0 && a.T > cache->max_write())
    return fail(Error::InvalidArgument, "a read of " + std::to_string(a.T) + " queries exceeds max_write " +
                                            std::to_string(cache->max_write()));
  const Plan p = kv::plan_step(layer, a.pos, a.T, sp.window, ring);
  if (!kv::resize_out(out, a)) return fail(Error::InvalidArgument, "cannot resize out");
  kv::SlotView view = cache->view(layer);
  view.sinks = sink_logits;
  kv::attend(view, p, q, static_cast<float>(scale), out.mutable_data_ptr(), static_cast<int>(out_dtype));
  return out;
}

}  // namespace
}  // namespace llmrt::offgraph

LLMPIPE_KERNEL(llmpipe, "update_and_attend.out", llmrt::offgraph::update_and_attend_out);
LLMPIPE_KERNEL(llmpipe, "attend_cached.out", llmrt::offgraph::attend_cached_out);

// Referenced by the runner so that a non-whole-archive link would fail loudly
// rather than silently drop the registration.
extern "C" int llmpipe_offgraph_kernel_linked() { return 1; }
