// The off-graph mode's recurrent-layer ops: the state lives in the bound OffgraphKvCache (offgraph_cache.h), not in
// the program. The computations are recurrent_core.h's, shared with the custom mode's ops.
//
//   llmpipe::state_delta.out(q, k, v, a, b, A_log, dt_bias, position, state_id, scale, *, out): the gated delta rule
//     over state `state_id`'s matrix (gated_delta_kernel.cpp's shapes).
//   llmpipe::state_conv.out(x, weight, bias, position, state_id, activation, *, out): the causal conv over state
//     `state_id`'s conv inputs (causal_conv_kernel.cpp's shapes).
//   llmpipe::state_ssd.out(x, dt, A_log, dt_bias, B, C, D, position, state_id, dt_min, dt_max, *, out): Mamba-2's
//     scan over state `state_id`'s matrix, [heads, state size, head dim] (ssd_kernel.cpp's shapes).
// A step must go on at the cache's length or start over at 0 (the caller's check_step refuses the rest). With a
// batched step bound (the batched runner), each row group advances its own session's state over its own rows.
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/kernel/kernel_includes.h>

#include "kernels/checked_kernel.h"
#include "kernels/offgraph_cache.h"
#include "kernels/recurrent_core.h"

namespace llmrt::recurrent {
namespace {

using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

// Where a step's rows go: one state set per session, with the rows [row, row + T) at positions [pos, pos + T).
struct Target {
  offgraph::RecurrentStates* states;
  int64_t row, T, pos;
};

// The targets of a step of T rows whose first position is pos: the bound cache's states (every row), or each row
// group's session of a bound batch (their rows' positions checked). False + why if there is none, or a state_id or
// position does not fit.
bool targets(const Tensor& position, int64_t T, int64_t pos, int64_t state_id, std::vector<Target>* out,
             std::string* why) {
  out->clear();
  if (const offgraph::BatchStep* batch = offgraph::bound_batch()) {
    if (batch->rows() != T) {
      *why = "the bound step has " + std::to_string(batch->rows()) + " rows but the forward has " + std::to_string(T);
      return false;
    }
    int64_t row = 0;
    for (const offgraph::RowGroup& g : batch->groups) {
      for (int64_t i = 0; i < g.T; ++i)
        if (kv::position_at(position, row + i) != g.pos + i) {
          *why = "row " + std::to_string(row + i) + " has position " +
                 std::to_string(kv::position_at(position, row + i)) + " but the bound step puts it at " +
                 std::to_string(g.pos + i);
          return false;
        }
      offgraph::RecurrentStates* st = g.kv->recurrent();
      if (st == nullptr) {
        *why = "a session of the bound step holds no recurrent states";
        return false;
      }
      out->push_back({st, row, g.T, g.pos});
      row += g.T;
    }
  } else if (offgraph::OffgraphKvCache* cache = offgraph::bound_cache()) {
    out->push_back({&cache->states(), 0, T, pos});
  } else {
    *why = "no off-graph cache is bound (bind it before execute)";
    return false;
  }
  for (const Target& t : *out)
    if (state_id < 0 || state_id >= t.states->size()) {
      *why = "state_id " + std::to_string(state_id) + " out of range: the bound cache has " +
             std::to_string(t.states->size()) + " states";
      return false;
    }
  return true;
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
  static thread_local std::vector<Target> ts;
  const bool batched = offgraph::bound_batch() != nullptr;
  if (!delta_step(q, k, v, a, b, A_log, dt_bias, position, scale, out, &s, &why, !batched) ||
      !targets(position, s.T, s.pos, state_id, &ts, &why))
    return fail(ctx, op, state_id, why, out);
  for (const Target& t : ts) {
    const offgraph::StateSpec& sp = t.states->spec(static_cast<int>(state_id));
    if (sp.heads != s.Hv || sp.key_dim != s.Dk || sp.value_dim != s.Dv)
      return fail(ctx, op, state_id, "the bound state is " + std::to_string(sp.heads) + "x" +
                                          std::to_string(sp.key_dim) + "x" + std::to_string(sp.value_dim) +
                                          " but the step's heads and dims are " + std::to_string(s.Hv) + "x" +
                                          std::to_string(s.Dk) + "x" + std::to_string(s.Dv), out);
  }
  for (const Target& t : ts) run_delta(delta_rows(s, t.row, t.T, t.pos), t.states->delta(static_cast<int>(state_id)));
  return out;
}

Tensor& state_ssd_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& dt, const Tensor& A_log,
                      const Tensor& dt_bias, const Tensor& B, const Tensor& C, const Tensor& D, const Tensor& position,
                      int64_t state_id, double dt_min, double dt_max, Tensor& out) {
  constexpr const char* op = "llmpipe::state_ssd";
  std::string why;
  SsdStep s;
  static thread_local std::vector<Target> ts;
  const bool batched = offgraph::bound_batch() != nullptr;
  if (!ssd_step(x, dt, A_log, dt_bias, B, C, D, position, dt_min, dt_max, out, &s, &why, !batched) ||
      !targets(position, s.T, s.pos, state_id, &ts, &why))
    return fail(ctx, op, state_id, why, out);
  for (const Target& t : ts) {
    const offgraph::StateSpec& sp = t.states->spec(static_cast<int>(state_id));
    if (sp.heads != s.H || sp.key_dim != s.N || sp.value_dim != s.P)
      return fail(ctx, op, state_id, "the bound state is " + std::to_string(sp.heads) + "x" +
                                          std::to_string(sp.key_dim) + "x" + std::to_string(sp.value_dim) +
                                          " but the step's heads, state size and head dim are " +
                                          std::to_string(s.H) + "x" + std::to_string(s.N) + "x" +
                                          std::to_string(s.P), out);
  }
  for (const Target& t : ts) run_ssd(ssd_rows(s, t.row, t.T, t.pos), t.states->delta(static_cast<int>(state_id)));
  return out;
}

Tensor& state_conv_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& weight,
                       const std::optional<Tensor>& bias, const Tensor& position, int64_t state_id, int64_t activation,
                       Tensor& out) {
  constexpr const char* op = "llmpipe::state_conv";
  std::string why;
  ConvStep s;
  static thread_local std::vector<Target> ts;
  const bool batched = offgraph::bound_batch() != nullptr;
  if (!conv_step(x, weight, bias, position, activation, out, &s, &why, !batched) ||
      !targets(position, s.T, s.pos, state_id, &ts, &why))
    return fail(ctx, op, state_id, why, out);
  for (const Target& t : ts) {
    const offgraph::StateSpec& sp = t.states->spec(static_cast<int>(state_id));
    if (sp.conv_rows != s.K - 1 || sp.conv_channels != s.C)
      return fail(ctx, op, state_id, "the bound conv state is " + std::to_string(sp.conv_rows) + "x" +
                                          std::to_string(sp.conv_channels) + " but the step needs " +
                                          std::to_string(s.K - 1) + "x" + std::to_string(s.C), out);
  }
  for (const Target& t : ts) run_conv(conv_rows(s, t.row, t.T, t.pos), t.states->conv(static_cast<int>(state_id)));
  return out;
}

}  // namespace
}  // namespace llmrt::recurrent

LLMPIPE_KERNEL(llmpipe, "state_delta.out", llmrt::recurrent::state_delta_out);
LLMPIPE_KERNEL(llmpipe, "state_conv.out", llmrt::recurrent::state_conv_out);
LLMPIPE_KERNEL(llmpipe, "state_ssd.out", llmrt::recurrent::state_ssd_out);
