#include "batched/cell_pool.h"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace llmrt {

using offgraph::LayerSpec;

CellPool::CellPool(std::vector<LayerSpec> specs, int64_t capacity, int64_t max_write, int64_t initial_cells,
                   int dtype_code, std::vector<offgraph::StateSpec> states)
    : states_(std::move(states)), capacity_(capacity), max_write_(max_write), initial_(initial_cells),
      dtype_(dtype_code) {
  offgraph::RecurrentStates check(states_);  // a bad shape throws here, not at the first session
  if (capacity < 1) throw std::invalid_argument("session capacity must be >= 1, got " + std::to_string(capacity));
  if (max_write < 1) throw std::invalid_argument("max_write must be >= 1, got " + std::to_string(max_write));
  if (initial_cells < 1)
    throw std::invalid_argument("initial KV capacity must be >= 1, got " + std::to_string(initial_cells));
  if (kv::row_bytes(dtype_code, 1) == 0)
    throw std::invalid_argument("KV storage dtype code " + std::to_string(dtype_code) +
                                " is not supported (Float, Half, BFloat16, Char: int8 rows or Byte: int4 rows)");
  if (specs.empty()) throw std::invalid_argument("an off-graph cache needs at least one layer");
  initial_ = std::min(initial_, capacity_);
  std::map<int64_t, int> group_of_ring;
  for (size_t i = 0; i < specs.size(); ++i) {
    const LayerSpec& s = specs[i];
    if (s.kv_heads < 1 || s.head_dim < 1 || s.v_dim < 1 || s.window < 0)
      throw std::invalid_argument("cache " + std::to_string(i) + ": bad geometry");
    const int64_t ring = s.window > 0 ? offgraph::ring_slots_for(s.window, max_write_, capacity_) : 0;
    auto it = group_of_ring.find(ring);
    if (it == group_of_ring.end()) {
      it = group_of_ring.emplace(ring, static_cast<int>(groups_.size())).first;
      groups_.push_back(Group{ring, {}, 0, {}, {}});
    }
    groups_[it->second].layers.push_back(static_cast<int>(i));
    layers_.push_back(Layer{s, it->second, {}, {}});
  }
  for (int g = 0; g < n_groups(); ++g) grow(g);
}

void CellPool::grow(int group) {
  Group& G = groups_[group];
  const int64_t first = G.ring > 0 ? G.ring : initial_;
  const int64_t n = G.allocated == 0 ? first : G.allocated * 2;
  for (int l : G.layers) {
    Layer& L = layers_[l];
    // resize keeps the existing cells where they are (indices never move)
    L.k.resize(offgraph::storage_bytes(n, L.spec.kv_heads, kv::row_bytes(dtype_, L.spec.head_dim), 1), 0);
    L.v.resize(offgraph::storage_bytes(n, L.spec.kv_heads, kv::row_bytes(dtype_, L.spec.v_dim), 1), 0);
  }
  G.refs.resize(static_cast<size_t>(n), 0);
  for (int64_t c = n - 1; c >= G.allocated; --c) G.free.push_back(static_cast<int32_t>(c));
  G.allocated = n;
}

int32_t CellPool::acquire(int group) {
  Group& G = groups_[group];
  if (G.free.empty()) grow(group);
  const int32_t c = G.free.back();
  G.free.pop_back();
  G.refs[c] = 1;
  return c;
}

void CellPool::release(int group, int32_t cell) {
  Group& G = groups_[group];
  if (--G.refs[cell] == 0) G.free.push_back(cell);
}

kv::SlotView CellPool::view(int layer) {
  Layer& L = layers_[layer];
  return {L.k.data(), L.v.data(), L.spec.kv_heads, L.spec.head_dim, L.spec.v_dim, dtype_, L.spec.window};
}

int64_t CellPool::cells_in_use(int group) const {
  const Group& G = groups_[group];
  return G.allocated - static_cast<int64_t>(G.free.size());
}

int64_t CellPool::cells_in_use() const {
  int64_t n = 0;
  for (int g = 0; g < n_groups(); ++g) n += cells_in_use(g);
  return n;
}

int64_t CellPool::bytes() const {
  int64_t b = 0;
  for (const Layer& L : layers_) b += static_cast<int64_t>(L.k.size() + L.v.size());
  return b;
}

std::string CellPool::describe() const {
  int flat = 0;
  std::map<int64_t, int> rings;
  for (const Layer& L : layers_) {
    if (groups_[L.group].ring == 0) ++flat;
    else ++rings[L.spec.window];
  }
  std::string s = "[cache] off-graph cells | capacity=" + std::to_string(capacity_) + " per session initial=" +
                  std::to_string(initial_) + " kv_dtype=" + kv::dtype_name(dtype_) + "\n" +
                  std::to_string(n_layers() + static_cast<int64_t>(states_.size())) + " layers: " +
                  offgraph::state_counts(states_) + std::to_string(flat) + " flat";
  for (auto& [w, n] : rings) s += " + " + std::to_string(n) + " ring(window " + std::to_string(w) + ")";
  return s;
}

// -- CellCache -------------------------------------------------------------------------------

CellCache::CellCache(CellPool& pool)
    : pool_(pool), tables_(static_cast<size_t>(pool.n_groups())), states_(pool.state_specs()) {
  for (int g = 0; g < pool_.n_groups(); ++g)
    if (pool_.ring(g) > 0) tables_[g].assign(static_cast<size_t>(pool_.ring(g)), -1);
}

CellCache::CellCache(const CellCache& other)
    : pool_(other.pool_), tables_(other.tables_), states_(other.states_), length_(other.length_) {
  for (int g = 0; g < pool_.n_groups(); ++g)
    for (int32_t c : tables_[g])
      if (c >= 0) pool_.retain(g, c);
}

CellCache::~CellCache() {
  for (int g = 0; g < pool_.n_groups(); ++g)
    for (int32_t c : tables_[g])
      if (c >= 0) pool_.release(g, c);
}

int64_t CellCache::cells() const {
  int64_t n = 0;
  for (const auto& t : tables_)
    for (int32_t c : t) n += c >= 0;
  return n;
}

int32_t CellCache::cell_at(int group, int64_t pos) const {
  const auto& t = tables_[group];
  const int64_t ring = pool_.ring(group);
  const int64_t i = ring > 0 ? pos % ring : pos;
  return i < static_cast<int64_t>(t.size()) ? t[i] : -1;
}

bool CellCache::reserve(int64_t pos, int64_t T, std::string* why) {
  auto fail = [&](const std::string& m) {
    if (why) *why = m;
    return false;
  };
  const int64_t end = pos + T;
  if (T < 1) return fail("a step needs >= 1 token, got " + std::to_string(T));
  if (pos < 0 || pos > length_)
    return fail("write at position " + std::to_string(pos) + " leaves a gap (cache length " +
                std::to_string(length_) + "); rewind first");
  std::string refused;
  if (!states_.step_ok(length_, pos, &refused)) return fail(refused);
  if (end > pool_.capacity())
    return fail("positions [" + std::to_string(pos) + ", " + std::to_string(end) + ") exceed the KV capacity " +
                std::to_string(pool_.capacity()));
  for (int g = 0; g < pool_.n_groups(); ++g) {
    const int64_t ring = pool_.ring(g);
    if (ring > 0 && T > pool_.max_write())
      return fail("a step of " + std::to_string(T) + " tokens exceeds max_write " +
                  std::to_string(pool_.max_write()) + " of a ring of " + std::to_string(ring) + " slots");
    auto& t = tables_[g];
    if (ring == 0 && static_cast<int64_t>(t.size()) < end) t.resize(static_cast<size_t>(end), -1);
    for (int64_t p = pos; p < end; ++p) {
      int32_t& c = t[static_cast<size_t>(ring > 0 ? p % ring : p)];
      if (c >= 0 && pool_.refs(g, c) == 1) continue;  // ours alone: overwrite in place
      if (c >= 0) pool_.release(g, c);                // shared: copy on write (a fresh cell)
      c = pool_.acquire(g);
    }
  }
  return true;
}

bool CellCache::step_slots(int layer, int64_t pos, int64_t T, offgraph::StepSlots* out, std::string* why) {
  const int g = pool_.group_of(layer);
  const int64_t ring = pool_.ring(g);
  const kv::Plan p = kv::plan_step(layer, pos, T, pool_.spec(layer).window, ring);
  kv::plan_slots(p, &out->write, &out->read);
  const auto& t = tables_[g];
  for (auto* list : {&out->write, &out->read})
    for (int64_t& s : *list) {
      const int32_t c = s < static_cast<int64_t>(t.size()) ? t[static_cast<size_t>(s)] : -1;
      if (c < 0) {
        if (why) *why = "no cell reserved for slot " + std::to_string(s) + " of layer " + std::to_string(layer);
        return false;
      }
      s = c;
    }
  out->view = pool_.view(layer);
  out->base = p.base;
  return true;
}

int64_t CellCache::rings_floor() const {
  int64_t floor = 0;
  for (int l = 0; l < pool_.n_layers(); ++l) {
    const int64_t ring = pool_.ring(pool_.group_of(l));
    if (ring > 0) floor = std::max(floor, offgraph::ring_rewind_floor(length_, ring, pool_.spec(l).window));
  }
  return floor;
}

bool CellCache::can_rewind(int64_t target, std::string* why) const {
  if (target < 0 || target > length_) {
    if (why) *why = "cannot rewind to " + std::to_string(target) + " (length " + std::to_string(length_) + ")";
    return false;
  }
  if (target == 0) return true;
  if (!states_.rewind_ok(length_, target, why)) return false;
  const int64_t floor = rings_floor();
  if (target < floor) {
    if (why)
      *why = "cannot rewind to " + std::to_string(target) +
             ": the ring caches no longer hold its window (lowest safe target " + std::to_string(floor) +
             ", or 0 to reset)";
    return false;
  }
  return true;
}

void CellCache::drop_from(int64_t target) {
  for (int g = 0; g < pool_.n_groups(); ++g) {
    if (pool_.ring(g) > 0) continue;
    auto& t = tables_[g];
    for (size_t p = static_cast<size_t>(target); p < t.size(); ++p)
      if (t[p] >= 0) pool_.release(g, t[p]);
    if (static_cast<int64_t>(t.size()) > target) t.resize(static_cast<size_t>(target));
  }
  length_ = target;
}

bool CellCache::rewind(int64_t target, std::string* why) {
  if (!can_rewind(target, why)) return false;
  drop_from(target);
  return true;
}

bool CellCache::restore(const offgraph::OffgraphKvCache::Snapshot& s, std::string* why) {
  if (!offgraph::snapshot_restorable(s.length, length_, rings_floor(), why)) return false;
  states_ = s.states;
  drop_from(s.length);
  return true;
}

}  // namespace llmrt
