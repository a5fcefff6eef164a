// llmpipe::update_and_attend.out: write this step's K/V into the bound off-graph
// cache (see offgraph_cache.h for the binding rule), then attend in fp32.
//
//   q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (Float/Half/BFloat16, contiguous),
//   position [T] or [T,1] (Long or Int, consecutive), out [1,Hq,T,Dv] of out_dtype.
// Key j (logical position base + j) is visible to query i (position pos + i) iff
// key <= query and, on a layer with window w, key > query - w.
#include <string>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include "offgraph_cache.h"

namespace llmrt::offgraph {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

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
  kv::StepArgs a;
  std::string why;
  if (!kv::check_step_args(q, k, v, position, out_dtype, out, &a, &why))
    return fail(Error::InvalidArgument, why);
  if (cache_id < 0 || cache_id >= cache->n_layers())
    return fail(Error::InvalidArgument,
                "out of range: the bound cache has " + std::to_string(cache->n_layers()) + " layers");
  const int layer = static_cast<int>(cache_id);
  const LayerSpec& sp = cache->spec(layer);
  if (sp.kv_heads != a.Hkv || sp.head_dim != a.D || sp.v_dim != a.Dv)
    return fail(Error::InvalidArgument,
                "the bound cache holds kv_heads " + std::to_string(sp.kv_heads) + ", head_dim " +
                    std::to_string(sp.head_dim) + ", v_dim " + std::to_string(sp.v_dim) +
                    " but the step has " + std::to_string(a.Hkv) + ", " + std::to_string(a.D) + ", " +
                    std::to_string(a.Dv));
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

EXECUTORCH_LIBRARY(llmpipe, "update_and_attend.out", llmrt::offgraph::update_and_attend_out);

// Referenced by the runner so that a non-whole-archive link would fail loudly
// rather than silently drop the registration.
extern "C" int llmpipe_offgraph_kernel_linked() { return 1; }
