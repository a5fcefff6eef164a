// Who owns the KV cache.
//
// In-graph programs keep their cache inside the .pte as mutable buffers
// (InGraphCache): the runner only tracks the logical length so that turns can be
// admitted, rewound (/undo) and reset. Off-graph programs (`cache.mode=offgraph`,
// selected with --kv-max-capacity) get an OffgraphCacheOwner: it holds the
// storage (offgraph_cache.h) and bind() makes it the process's bound cache,
// which the llmpipe::update_and_attend.out kernel reads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/offgraph_cache.h"

namespace llmrt {

class KvCacheOwner {
 public:
  virtual ~KvCacheOwner() = default;
  virtual const char* kind() const = 0;
  // Positions the cache can hold.
  virtual int64_t capacity() const = 0;
  // Positions currently holding valid entries.
  virtual int64_t length() const = 0;
  // Called before a forward that writes positions [pos, pos + n). Returns false
  // (with a reason) if the write cannot be done.
  virtual bool bind(int64_t pos, int64_t n, std::string* why) = 0;
  // Called after that forward succeeded.
  virtual void commit(int64_t pos, int64_t n) = 0;
  // Drop everything at or after `pos`. Returns false (with a reason) if not possible.
  virtual bool rewind(int64_t pos, std::string* why) = 0;
  virtual void reset() = 0;
  // One line for the report.
  virtual std::string describe() const = 0;
  // Bytes of K/V storage the runner holds (-1: inside the program, not the runner's to count).
  virtual int64_t bytes() const { return -1; }
  // Recurrent layers: a state a rewind cannot give back. Speculation snapshots it before a verify forward and
  // restores it (the length too) to replay what it keeps; can_snapshot() is false where the runner cannot reach it.
  virtual bool recurrent() const { return false; }
  virtual bool can_snapshot() const { return !recurrent(); }
  virtual void snapshot() {}
  virtual bool restore(std::string* why) {
    if (why) *why = "this cache takes no snapshot";
    return false;
  }
};

// The program owns the cache (mutable buffers); entries past the current
// position are masked by the program, so a rewind is bookkeeping, except that a
// custom-mode program's ring layers (constant methods get_ring_windows /
// get_ring_slots) only hold their last `slots` positions: a rewind must not go
// below what they still hold (the same floor as the off-graph rings). A program
// with recurrent layers (get_layer_kinds, get_state_shapes) holds their state at
// its current position only: it can go on or start over, not step back.
class InGraphCache final : public KvCacheOwner {
 public:
  struct Ring {
    int64_t window = 0, slots = 0;
  };
  // Per layer: 0 flat attention, 1 ring, 2 Gated DeltaNet, 3 short conv, 4 Mamba-2, 5 attention beside Mamba-2
  // (Falcon-H1), 6 an MLP block alone (Nemotron-H); per layer of kinds 2 to 5 its state.
  struct Layers {
    std::vector<int64_t> kinds;
    std::vector<offgraph::StateSpec> states;
    static bool has_state(int64_t k) { return k >= 2 && k <= 5; }
    bool recurrent() const { return std::any_of(kinds.begin(), kinds.end(), has_state); }
  };
  explicit InGraphCache(int64_t capacity, std::vector<Ring> rings = {}, Layers layers = {})
      : capacity_(capacity), rings_(std::move(rings)), layers_(std::move(layers)) {}
  const char* kind() const override { return "in-graph"; }
  int64_t capacity() const override { return capacity_; }
  int64_t length() const override { return length_; }
  bool bind(int64_t pos, int64_t n, std::string* why) override {
    if (pos < 0 || pos > length_ || pos + n > capacity_) {
      if (why)
        *why = "write of positions [" + std::to_string(pos) + ", " + std::to_string(pos + n) +
               ") does not fit the cache (length " + std::to_string(length_) + ", capacity " +
               std::to_string(capacity_) + ")";
      return false;
    }
    return true;
  }
  void commit(int64_t pos, int64_t n) override { length_ = pos + n; }
  int64_t rewind_floor() const {
    int64_t floor = 0;
    for (const Ring& r : rings_) {
      const int64_t oldest = std::max<int64_t>(0, length_ - r.slots);
      if (oldest > 0) floor = std::max(floor, oldest + r.window - 1);
    }
    return floor;
  }
  bool rewind(int64_t pos, std::string* why) override {
    if (pos < 0 || pos > length_) {
      if (why)
        *why = "cannot rewind to " + std::to_string(pos) + " (length " + std::to_string(length_) +
               ")";
      return false;
    }
    if (layers_.recurrent() && pos > 0 && pos != length_) {
      if (why)
        *why = "cannot rewind to " + std::to_string(pos) + ": the program's recurrent state holds position " +
               std::to_string(length_) + " only (0 to reset)";
      return false;
    }
    if (pos > 0 && pos < rewind_floor()) {
      if (why)
        *why = "cannot rewind to " + std::to_string(pos) +
               ": the program's ring caches no longer hold its window (lowest safe target " +
               std::to_string(rewind_floor()) + ", or 0 to reset)";
      return false;
    }
    length_ = pos;
    return true;
  }
  void reset() override { length_ = 0; }
  bool recurrent() const override { return layers_.recurrent(); }  // the program's buffers: out of the runner's reach
  std::string describe() const override {
    std::string s = "[cache] in-graph (program-owned) | capacity=" + std::to_string(capacity_);
    if (!rings_.empty())
      s += " | " + std::to_string(rings_.size()) + " ring layers (window " +
           std::to_string(rings_[0].window) + ", " + std::to_string(rings_[0].slots) + " slots)";
    if (layers_.recurrent()) s += " | " + describe_layers() + "\n" + offgraph::state_line(layers_.states, false);
    return s;
  }

 private:
  // e.g. "4 layers: 3 matrix(4x16x16) + 1 flat", kinds counted in order of first appearance
  std::string describe_layers() const {
    std::vector<std::pair<std::string, int>> counts;
    size_t state = 0;
    for (int64_t k : layers_.kinds) {
      std::string name = k == 0 ? "flat" : k == 1 ? "ring" : k == 6 ? "mlp" : "conv";
      if (Layers::has_state(k) && state < layers_.states.size()) name = offgraph::state_name(layers_.states[state++]);
      auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == name; });
      if (it == counts.end()) counts.push_back({name, 1});
      else ++it->second;
    }
    std::string s = std::to_string(layers_.kinds.size()) + " layers: ";
    for (size_t i = 0; i < counts.size(); ++i)
      s += (i ? " + " : "") + std::to_string(counts[i].second) + " " + counts[i].first;
    return s;
  }

  int64_t capacity_;
  std::vector<Ring> rings_;
  Layers layers_;
  int64_t length_ = 0;
};

// The runtime owns the cache; the program's attention layers reach it through
// the global binding (see offgraph_cache.h).
class OffgraphCacheOwner final : public KvCacheOwner {
 public:
  OffgraphCacheOwner(std::vector<offgraph::LayerSpec> specs, int64_t capacity, int64_t max_write,
                     int64_t initial, int dtype_code, int64_t shared_layers = 0)
      : cache_(std::move(specs), capacity, max_write, initial, dtype_code) {
    cache_.set_shared_layers(shared_layers);
  }
  ~OffgraphCacheOwner() override {
    if (offgraph::bound_cache() == &cache_) offgraph::bind_cache(nullptr);
  }
  const char* kind() const override { return "off-graph"; }
  int64_t capacity() const override { return cache_.capacity(); }
  int64_t length() const override { return cache_.length(); }
  bool bind(int64_t pos, int64_t n, std::string* why) override {
    if (!cache_.check_step(pos, n, why)) return false;
    offgraph::set_last_error("");
    offgraph::bind_cache(&cache_);
    return true;
  }
  void commit(int64_t pos, int64_t n) override { cache_.commit(pos, n); }
  bool rewind(int64_t pos, std::string* why) override { return cache_.rewind(pos, why); }
  void reset() override { cache_.reset(); }
  std::string describe() const override {
    const std::string states = offgraph::state_line(cache_.states().specs(), true);
    return cache_.describe() + (states.empty() ? "" : "\n" + states);
  }
  int64_t bytes() const override { return cache_.bytes(); }
  bool recurrent() const override { return !cache_.states().empty(); }
  bool can_snapshot() const override { return true; }
  void snapshot() override { cache_.snapshot(&saved_); }
  bool restore(std::string* why) override { return cache_.restore(saved_, why); }
  const offgraph::OffgraphKvCache& cache() const { return cache_; }
  // The program's recurrent layers (get_state_shapes): their state, held here.
  void set_states(const std::vector<int64_t>& dims) {
    cache_.set_states(offgraph::state_specs(dims.data(), dims.size()));
  }

 private:
  offgraph::OffgraphKvCache cache_;
  offgraph::OffgraphKvCache::Snapshot saved_;
};

}  // namespace llmrt
