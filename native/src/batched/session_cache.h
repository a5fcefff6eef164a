// One session's K/V in the batched runner (batched_engine.h).
//
// The kernel sees a session as an offgraph::StepKv (its layers, and per step the slots to write and
// read). The engine drives the rest of its life: reserve() before the step that writes [pos, pos+T)
// (checks it and allocates, so that the kernel never allocates while other sessions' storage views
// are held), commit() after the forward succeeded, rewind() (to resume from a prefix-cache
// snapshot), clone() (take a snapshot, or start a session from one).
//
// Two kinds, with the same policy as OffgraphKvCache (one logical length, rings of
// window + max_write - 1 slots, rewinds not below what the rings hold):
//   - SequenceCache (--cache-kind batched-sequence): one OffgraphKvCache per session; a clone
//     copies its storage.
//   - CellCache (--cache-kind batched-cell, cell_pool.h): one pool of cells shared by all
//     sessions; a session owns cells through its page tables and a clone shares them.
// A hybrid program's recurrent layers hold one fixed-size state per session in either kind (copied by a clone): a
// step goes on at the length or starts over at 0, a rewind goes to 0 or nowhere.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/offgraph_cache.h"

namespace llmrt {

class SessionCache : public offgraph::StepKv {
 public:
  virtual int64_t length() const = 0;
  virtual int64_t capacity() const = 0;
  // Checks a step at [pos, pos + T) and makes room for it in every layer. False + why if it cannot.
  virtual bool reserve(int64_t pos, int64_t T, std::string* why) = 0;
  virtual void commit(int64_t pos, int64_t T) = 0;
  virtual bool can_rewind(int64_t target, std::string* why) const = 0;
  virtual bool rewind(int64_t target, std::string* why) = 0;
  // Back to a speculation snapshot (a length and the recurrent states then): the states copied back, the attention
  // caches rewound to that length (not below what the rings hold). False + why otherwise.
  virtual bool restore(const offgraph::OffgraphKvCache::Snapshot& s, std::string* why) = 0;
  // An independent session in the current state.
  virtual std::unique_ptr<SessionCache> clone() const = 0;
  // K/V bytes held by this session alone (cells of a shared pool are counted by the pool: 0).
  virtual int64_t bytes() const = 0;
};

class SequenceCache final : public SessionCache {
 public:
  SequenceCache(std::vector<offgraph::LayerSpec> specs, int64_t capacity, int64_t max_write,
                int64_t initial_capacity, int dtype_code, std::vector<offgraph::StateSpec> states = {})
      : cache_(std::move(specs), capacity, max_write, initial_capacity, dtype_code) {
    cache_.set_states(std::move(states));
  }

  int n_layers() const override { return cache_.n_layers(); }
  const offgraph::LayerSpec& spec(int layer) const override { return cache_.spec(layer); }
  bool step_slots(int layer, int64_t pos, int64_t T, offgraph::StepSlots* out, std::string* why) override;

  int64_t length() const override { return cache_.length(); }
  int64_t capacity() const override { return cache_.capacity(); }
  bool reserve(int64_t pos, int64_t T, std::string* why) override;
  void commit(int64_t pos, int64_t T) override { cache_.commit(pos, T); }
  bool can_rewind(int64_t target, std::string* why) const override { return cache_.can_rewind(target, why); }
  bool rewind(int64_t target, std::string* why) override { return cache_.rewind(target, why); }
  bool restore(const offgraph::OffgraphKvCache::Snapshot& s, std::string* why) override {
    return cache_.restore(s, why);
  }
  std::unique_ptr<SessionCache> clone() const override { return std::make_unique<SequenceCache>(*this); }
  int64_t bytes() const override { return cache_.bytes(); }
  offgraph::RecurrentStates* recurrent() override { return cache_.states().empty() ? nullptr : &cache_.states(); }
  const offgraph::OffgraphKvCache& cache() const { return cache_; }

 private:
  offgraph::OffgraphKvCache cache_;
};

}  // namespace llmrt
