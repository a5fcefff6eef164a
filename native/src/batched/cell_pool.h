// --cache-kind batched-cell: one pool of K/V cells shared by every session of the batched runner.
//
// A cell holds one position's K and V in every layer of a group; layers are grouped by ring size
// (0 = flat layers, else one group per distinct ring of window + max_write - 1 slots), so a cell
// index means the same thing in all layers of its group. A group's storage starts small and doubles
// on demand; cell indices never move.
//
// Ownership: cells are reference counted. A session (CellCache) owns its cells through one page
// table per group: flat groups map position -> cell, ring groups map slot (position % ring) -> cell.
// clone() shares every cell (a prefix-cache snapshot costs no copy); a write to a shared cell first
// takes a fresh one (copy on write: a step overwrites the whole cell, in every layer of its group, so
// nothing is copied). Rewinding releases the flat cells past the new length; destroying a session
// releases everything it holds, and a cell whose count drops to 0 is free again.
//
// Recurrent layers (a hybrid program's get_state_shapes) have no cells: each session holds its own fixed-size states
// (offgraph::RecurrentStates) beside its page tables, and a clone copies them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "batched/session_cache.h"

namespace llmrt {

class CellPool {
 public:
  // capacity: positions one session may hold; max_write: the largest step (prefill chunk);
  // initial_cells: first allocation of the flat group (ring groups start with one ring).
  // states: the recurrent layers' shapes, every session's own.
  CellPool(std::vector<offgraph::LayerSpec> specs, int64_t capacity, int64_t max_write,
           int64_t initial_cells, int dtype_code, std::vector<offgraph::StateSpec> states = {});

  int n_layers() const { return static_cast<int>(layers_.size()); }
  const offgraph::LayerSpec& spec(int layer) const { return layers_[layer].spec; }
  int group_of(int layer) const { return layers_[layer].group; }
  int n_groups() const { return static_cast<int>(groups_.size()); }
  int64_t ring(int group) const { return groups_[group].ring; }  // 0 = flat
  int64_t capacity() const { return capacity_; }
  int64_t max_write() const { return max_write_; }
  int dtype() const { return dtype_; }
  const std::vector<offgraph::StateSpec>& state_specs() const { return states_; }

  // A free cell of `group` with one reference (grows the group's storage if none is free).
  int32_t acquire(int group);
  void retain(int group, int32_t cell) { ++groups_[group].refs[cell]; }
  void release(int group, int32_t cell);
  int32_t refs(int group, int32_t cell) const { return groups_[group].refs[cell]; }

  // The layer's storage (valid until the next acquire()).
  kv::SlotView view(int layer);

  int64_t cells_allocated(int group) const { return groups_[group].allocated; }
  int64_t cells_in_use(int group) const;
  int64_t cells_in_use() const;
  int64_t bytes() const;
  // "[cache] off-graph cells | ..." and the layer line, as OffgraphKvCache::describe.
  std::string describe() const;

 private:
  struct Group {
    int64_t ring = 0;
    std::vector<int> layers;
    int64_t allocated = 0;
    std::vector<int32_t> refs;  // per cell
    std::vector<int32_t> free;  // free cells, the lowest on top
  };
  struct Layer {
    offgraph::LayerSpec spec;
    int group = 0;
    std::vector<uint8_t> k, v;
  };
  void grow(int group);

  std::vector<Layer> layers_;
  std::vector<Group> groups_;
  std::vector<offgraph::StateSpec> states_;
  int64_t capacity_, max_write_, initial_;
  int dtype_;
};

class CellCache final : public SessionCache {
 public:
  explicit CellCache(CellPool& pool);
  CellCache(const CellCache& other);
  CellCache& operator=(const CellCache&) = delete;
  ~CellCache() override;

  int n_layers() const override { return pool_.n_layers(); }
  const offgraph::LayerSpec& spec(int layer) const override { return pool_.spec(layer); }
  bool step_slots(int layer, int64_t pos, int64_t T, offgraph::StepSlots* out, std::string* why) override;

  int64_t length() const override { return length_; }
  int64_t capacity() const override { return pool_.capacity(); }
  bool reserve(int64_t pos, int64_t T, std::string* why) override;
  void commit(int64_t pos, int64_t T) override { length_ = std::max(length_, pos + T); }
  bool can_rewind(int64_t target, std::string* why) const override;
  bool rewind(int64_t target, std::string* why) override;
  bool restore(const offgraph::OffgraphKvCache::Snapshot& s, std::string* why) override;
  std::unique_ptr<SessionCache> clone() const override { return std::make_unique<CellCache>(*this); }
  // Its recurrent states (its cells are the pool's to count).
  int64_t bytes() const override { return states_.bytes(); }
  offgraph::RecurrentStates* recurrent() override { return states_.empty() ? nullptr : &states_; }
  // Cells this session references (shared ones included).
  int64_t cells() const;
  // The cell holding `pos` in `group` (-1 if none), for tests.
  int32_t cell_at(int group, int64_t pos) const;

 private:
  CellPool& pool_;
  std::vector<std::vector<int32_t>> tables_;  // per group: flat position -> cell, ring slot -> cell
  // Lowest nonzero length the rings can go back to; the cells at and after `target` released.
  int64_t rings_floor() const;
  void drop_from(int64_t target);
  offgraph::RecurrentStates states_;
  int64_t length_ = 0;
};

}  // namespace llmrt
