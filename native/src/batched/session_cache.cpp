#include "batched/session_cache.h"

namespace llmrt {

bool SequenceCache::step_slots(int layer, int64_t pos, int64_t T, offgraph::StepSlots* out,
                               std::string* why) {
  kv::Plan p;
  if (!cache_.plan(layer, pos, T, &p, why)) return false;
  if (cache_.ring_slots(layer) == 0 && cache_.allocated(layer) < p.end) {
    if (why) *why = "layer " + std::to_string(layer) + " was not reserved for positions up to " + std::to_string(p.end);
    return false;
  }
  out->view = cache_.view(layer);
  out->base = p.base;
  kv::plan_slots(p, &out->write, &out->read);
  return true;
}

bool SequenceCache::reserve(int64_t pos, int64_t T, std::string* why) {
  if (!cache_.check_step(pos, T, why)) return false;
  for (int l = 0; l < cache_.n_layers(); ++l) cache_.ensure(l, pos + T);
  return true;
}

}  // namespace llmrt
