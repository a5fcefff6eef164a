// The off-graph mode's recurrent-layer ops: the state lives in the bound OffgraphKvCache (offgraph_cache.h), not in
// the program. The computations are recurrent_core.h's, shared with the custom mode's ops.
//
//   llmpipe::state_delta.out(q, k, v, a, b, A_log, dt_bias, position, state_id, scale, *, out): the gated delta rule
//     over state `state_id`'s matrix (gated_delta_kernel.cpp's shapes).
//   llmpipe::state_conv.out(x, weight, bias, position, state_id, activation, *, out): the causal conv over state
//     `state_id`'s conv inputs (causal_conv_kernel.cpp's shapes).
// A step must go on at the cache's length or start over at 0 (the caller's check_step refuses the rest); a batched
// step (several sessions in one forward) is refused: the batched runner takes no program with recurrent layers.
#include <optional>
#include <string>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/offgraph_cache.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {
namespace {

using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;
using offgraph::OffgraphKvCache;

// The bound cache's state `state_id`, or null with the reason.
OffgraphKvCache* bound_state(int64_t state_id, std::string* why) {
  if (offgraph::bound_batch() != nullptr) {
    *why = "a batched step is bound: recurrent layers run one session at a time";
    return nullptr;
  }
  OffgraphKvCache* cache = offgraph::bound_cache();
  if (cache == nullptr) {
    *why = "no off-graph cache is bound (bind it before execute)";
    return nullptr;
  }
  if (state_id < 0 || state_id >= cache->n_states()) {
    *why = "state_id " + std::to_string(state_id) + " out of range: the bound cache has " +
           std::to_string(cache->n_states()) + " states";
    return nullptr;
  }
  return cache;
}

Tensor& fail(KernelRuntimeContext& ctx, const char* op, int64_t state_id, const std::string& why, Tensor& out) {
  const std::string m = std::string(op) + " (state_id " + std::to_string(state_id) + "): " + why;
  offgraph::set_last_error(m);
  ET_LOG(Error, "%s", m.c_str());
  ctx.fail(Error::InvalidArgument);
  return out;
}

Tensor& state_delta_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& a,
                        const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& position,
                        int64_t state_id, double scale, Tensor& out) {
  constexpr const char* op = "llmpipe::state_delta";
  std::string why;
  DeltaStep s;
  if (!delta_step(q, k, v, a, b, A_log, dt_bias, position, scale, out, &s, &why))
    return fail(ctx, op, state_id, why, out);
  OffgraphKvCache* cache = bound_state(state_id, &why);
  if (cache == nullptr) return fail(ctx, op, state_id, why, out);
  const offgraph::StateSpec& sp = cache->state_spec(static_cast<int>(state_id));
  if (sp.heads != s.Hv || sp.key_dim != s.Dk || sp.value_dim != s.Dv)
    return fail(ctx, op, state_id, "the bound state is " + std::to_string(sp.heads) + "x" + std::to_string(sp.key_dim) +
                                        "x" + std::to_string(sp.value_dim) + " but the step's heads and dims are " +
                                        std::to_string(s.Hv) + "x" + std::to_string(s.Dk) + "x" + std::to_string(s.Dv),
                out);
  run_delta(s, cache->delta_state(static_cast<int>(state_id)));
  return out;
}

Tensor& state_conv_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& weight,
                       const std::optional<Tensor>& bias, const Tensor& position, int64_t state_id, int64_t activation,
                       Tensor& out) {
  constexpr const char* op = "llmpipe::state_conv";
  std::string why;
  ConvStep s;
  if (!conv_step(x, weight, bias, position, activation, out, &s, &why)) return fail(ctx, op, state_id, why, out);
  OffgraphKvCache* cache = bound_state(state_id, &why);
  if (cache == nullptr) return fail(ctx, op, state_id, why, out);
  const offgraph::StateSpec& sp = cache->state_spec(static_cast<int>(state_id));
  if (sp.conv_rows != s.K - 1 || sp.conv_channels != s.C)
    return fail(ctx, op, state_id, "the bound conv state is " + std::to_string(sp.conv_rows) + "x" +
                                        std::to_string(sp.conv_channels) + " but the step needs " +
                                        std::to_string(s.K - 1) + "x" + std::to_string(s.C), out);
  run_conv(s, cache->conv_state(static_cast<int>(state_id)));
  return out;
}

}  // namespace
}  // namespace llmrt::recurrent

LLMPIPE_KERNEL(llmpipe, "state_delta.out", llmrt::recurrent::state_delta_out);
LLMPIPE_KERNEL(llmpipe, "state_conv.out", llmrt::recurrent::state_conv_out);
