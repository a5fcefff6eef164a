// The off-graph KV cache (runtime-owned) and the process-global binding the
// llmpipe::update_and_attend.out kernel reads it through.
//
// Program side: an `offgraph` .pte has no cache. Each attention layer calls
//   llmpipe::update_and_attend.out(q, k, v, position, cache_id, scale, out_dtype, out)
// which writes this step's K/V at logical positions [pos, pos+T) of layer cache
// `cache_id` and attends over the cached history.
//
// Binding (how the kernel finds its cache): ONE cache set is bound per process
// at a time (bind_cache / bound_cache, an atomic pointer). `cache_id` is the
// index of a layer cache in the bound set. Whoever executes the program (the
// runner, or Python verify through the C API in offgraph_capi.cpp) binds its
// cache before `execute` and commits the step after it succeeded:
//   cache.check_step(pos, T)   // every layer can take the step (pure)
//   bind_cache(&cache); method.execute(...); cache.commit(pos, T);
// With nothing bound the kernel fails the execute with a clear error (also kept
// in last_error()), never a crash. Executes are not concurrent within a process
// (the binding is global, not per thread), which is how the runners work.
//
// Batched steps (the batched runner, batched_engine.h): one forward may carry rows of several
// sessions. The caller binds a BatchStep instead (bind_batch): row group g is the next T_g rows of
// the step, positions [pos_g, pos_g + T_g) of session cache g (a StepKv). Binding one kind of
// target clears the other; the kernel serves whichever is bound.
//
// Cache policy (one logical length shared by all layers):
//   - plan(layer, pos, T) is pure; commit sets length = max(length, pos + T).
//   - refused: pos > length (a gap), pos + T > capacity, on a ring T > max_write.
//   - flat layer: writes [pos, pos+T), reads [0, end); its pool starts at the
//     initial capacity and doubles on demand up to capacity (cells never move).
//   - ring layer (window w): w + max_write - 1 slots (capped at capacity),
//     allocated up front, slot = pos % ring; reads [max(0, pos-w+1), end)
//     oldest to newest; writes and reads are at most two runs each.
//   - rewind(target): target <= length and not below what the rings still hold.
//   - snapshot / restore: the length and the recurrent states (a copy), taken before a speculative verify
//     step; restore goes back to them (the rings' floor as for a rewind), and the caller replays what it keeps.
// Storage: [slot][kv_head][row], dtype Float, Half or BFloat16 (writes cast), or int8 / rotated int4 rows with
// their scales (kv_attention.h).
//
// Recurrent layers (set_states: the program's get_layer_kinds / get_state_shapes) keep a fixed-size state here
// beside the attention caches, fp32 whatever the K/V dtype: a Gated DeltaNet's [heads][key dim][value dim] matrix and
// a conv's last [rows][channels] inputs. llmpipe::state_delta.out / state_conv.out (state_kernels.cpp) advance it.
// A state holds the current length only: a step goes on at the length or starts over at 0, and a rewind goes to 0.
// A batched session (StepKv::recurrent) holds its own RecurrentStates; the ops serve each row group from its own.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kv_attention.h"

namespace llmrt::offgraph {

using kv::dtype_name;
using kv::element_size;
using kv::kBFloat16;
using kv::kFloat;
using kv::kHalf;
using kv::Plan;
using kv::Run;

struct LayerSpec {
  int64_t kv_heads = 0, head_dim = 0, v_dim = 0;
  int64_t window = 0;  // 0 = flat (full attention)
};

// A recurrent layer's state: a Gated DeltaNet's matrix (heads 0: none, a short conv) and its conv's last inputs.
struct StateSpec {
  int64_t heads = 0, key_dim = 0, value_dim = 0;
  int64_t conv_rows = 0, conv_channels = 0;
};

// The states a program lists in get_state_shapes, five values each (heads, key dim, value dim, conv rows, conv
// channels); throws std::invalid_argument when the count is not a multiple of five.
std::vector<StateSpec> state_specs(const int64_t* dims, size_t n_values);
// The report's name of a state: "matrix(HxDkxDv)" (a Gated DeltaNet's or a Mamba-2 layer's), or "conv(RxC)" for a
// short conv's.
std::string state_name(const StateSpec& s);
// The layer line's part for these states, e.g. "3 matrix(4x16x16) + " ("" for none).
std::string state_counts(const std::vector<StateSpec>& specs);
// The report's line for them: "[cache] recurrent state fp32 | 3.0 KiB per sequence, whatever the depth (...)" ("" for
// none), held by the runtime (what the --kv-* flags do not size) or in the program's buffers.
std::string state_line(const std::vector<StateSpec>& specs, bool runtime_owned);

// One sequence's recurrent states, fp32, zeroed at first. A copy is a snapshot: a few KB to a few MB, whatever the
// depth. Both rules below hold for every owner (the single runner's cache, a batched session).
class RecurrentStates {
 public:
  RecurrentStates() = default;
  explicit RecurrentStates(std::vector<StateSpec> specs);  // throws std::invalid_argument on a bad shape

  bool empty() const { return states_.empty(); }
  int size() const { return static_cast<int>(states_.size()); }
  const StateSpec& spec(int i) const { return states_[i].spec; }
  float* delta(int i) { return states_[i].delta.data(); }
  float* conv(int i) { return states_[i].conv.data(); }
  void clear();
  int64_t bytes() const;
  std::vector<StateSpec> specs() const;
  // A state holds the position it reached (length) only: a step goes on there or starts over at 0, a rewind goes
  // to 0 or nowhere. False + why otherwise (true without states).
  bool step_ok(int64_t length, int64_t pos, std::string* why) const;
  bool rewind_ok(int64_t length, int64_t target, std::string* why) const;

 private:
  struct State {
    StateSpec spec;
    std::vector<float> delta, conv;
  };
  std::vector<State> states_;
};

class OffgraphKvCache {
 public:
  // Throws std::invalid_argument on a bad geometry or non-positive sizes.
  OffgraphKvCache(std::vector<LayerSpec> specs, int64_t capacity, int64_t max_write,
                  int64_t initial_capacity, int dtype_code);

  int n_layers() const { return static_cast<int>(layers_.size()); }
  const LayerSpec& spec(int l) const { return layers_[l].spec; }
  int64_t ring_slots(int l) const { return layers_[l].ring; }  // 0 = flat
  int64_t allocated(int l) const { return layers_[l].allocated; }
  int64_t capacity() const { return capacity_; }
  int64_t max_write() const { return max_write_; }
  int64_t initial_capacity() const { return initial_; }
  int dtype() const { return dtype_; }
  int64_t length() const { return length_; }

  // Pure. False (with a reason) if the step cannot be done in this layer.
  bool plan(int layer, int64_t pos, int64_t T, Plan* out, std::string* why) const;
  // plan() for every layer.
  bool check_step(int64_t pos, int64_t T, std::string* why) const;
  void commit(int64_t pos, int64_t T);

  // Grows a flat pool to hold [0, end) (doubling, up to capacity).
  void ensure(int layer, int64_t end);
  // Storage of physical slot `slot`: kv_heads rows of dtype() (kv::row_bytes).
  uint8_t* k_slot(int layer, int64_t slot);
  uint8_t* v_slot(int layer, int64_t slot);
  // The layer's storage for the attention core (valid until the next ensure()).
  kv::SlotView view(int layer);

  int64_t rewind_floor() const;
  bool can_rewind(int64_t target, std::string* why) const;
  bool rewind(int64_t target, std::string* why);
  void reset();

  // What a rewind cannot give back on a recurrent program: the states at a length. A snapshot into an existing one
  // reuses its storage (one per speculative step).
  struct Snapshot {
    int64_t length = 0;
    RecurrentStates states;
  };
  void snapshot(Snapshot* out) const {
    out->length = length_;
    out->states = states_;
  }
  // Back to a snapshot taken at a length <= this one whose window the rings still hold; false + why otherwise.
  bool restore(const Snapshot& s, std::string* why);

  // The recurrent layers' state, allocated (zeroed) here; throws std::invalid_argument on a bad shape.
  void set_states(std::vector<StateSpec> specs) { states_ = RecurrentStates(std::move(specs)); }
  RecurrentStates& states() { return states_; }
  const RecurrentStates& states() const { return states_; }

  int64_t bytes() const;
  // Attention layers that read another layer's cache (KV-shared layers, the program's
  // get_n_shared_layers): they have no cache here; the report says how many.
  void set_shared_layers(int64_t n) { shared_ = n; }
  int64_t shared_layers() const { return shared_; }
  // "[cache] off-graph seq | capacity=C initial=I kv_dtype=D\nN layers: F flat + R ring(window W)[, S shared]"
  std::string describe() const;

 private:
  struct Layer {
    LayerSpec spec;
    int64_t ring = 0;       // slots of a ring layer, 0 = flat
    int64_t allocated = 0;  // slots allocated
    std::vector<uint8_t> k, v;
  };
  std::vector<Layer> layers_;
  RecurrentStates states_;
  int64_t capacity_, max_write_, initial_;
  int dtype_;
  int64_t length_ = 0;
  int64_t shared_ = 0;
};

// What the kernel needs from one session of a batched step: its layers and, per layer, where a
// step's entries go and where its keys are (explicit slot lists over one storage view).
struct StepSlots {
  kv::SlotView view;
  int64_t base = 0;                   // logical position of read[0]
  std::vector<int64_t> write, read;   // T slots; pos + T - base slots, oldest first
};

class StepKv {
 public:
  virtual ~StepKv() = default;
  virtual int n_layers() const = 0;
  virtual const LayerSpec& spec(int layer) const = 0;
  // The slots of a step at [pos, pos + T) in `layer`. The owner reserved the storage before the
  // execute, so this never allocates (other sessions' views stay valid). False + why if it cannot.
  virtual bool step_slots(int layer, int64_t pos, int64_t T, StepSlots* out, std::string* why) = 0;
  // The session's recurrent states (null: none), for llmpipe::state_delta / state_conv.
  virtual RecurrentStates* recurrent() { return nullptr; }
};

struct RowGroup {
  StepKv* kv = nullptr;
  int64_t pos = 0, T = 0;
};

struct BatchStep {
  std::vector<RowGroup> groups;  // in row order; a session appears in one group at most
  int64_t rows() const {
    int64_t n = 0;
    for (const RowGroup& g : groups) n += g.T;
    return n;
  }
};

// The process-global binding: one cache (single-session runner, Python verify) or one batched step.
void bind_cache(OffgraphKvCache* cache);
OffgraphKvCache* bound_cache();
void bind_batch(const BatchStep* step);
const BatchStep* bound_batch();
void set_last_error(const std::string& msg);
std::string last_error();

// Lowest nonzero length a ring of `ring` slots and window `window`, filled up to `length`, can be
// rewound to: a step at target t reads [max(0, t - w + 1), t), which the ring must still hold.
inline int64_t ring_rewind_floor(int64_t length, int64_t ring, int64_t window) {
  const int64_t oldest = length > ring ? length - ring : 0;  // oldest position still held
  return oldest > 0 ? oldest + window - 1 : 0;
}

// Whether a cache filled up to `length`, whose rings can go back to `floor`, can restore a snapshot taken at
// `target` (a speculation snapshot: at most the length, and not below what the rings hold). False + why otherwise.
bool snapshot_restorable(int64_t target, int64_t length, int64_t floor, std::string* why);

// Slots of a ring layer: its window plus the chunk being written (window + max_write - 1), at most the
// capacity. Saturating: a window near INT64_MAX (damaged, or a flag) must not overflow.
int64_t ring_slots_for(int64_t window, int64_t max_write, int64_t capacity);

// Bytes of `positions` positions of one layer's K or V storage (heads x dim elements of `esize` bytes).
// Throws std::length_error (exit 1 in the runners) when that overflows or exceeds the machine's memory, so a
// damaged geometry or a huge flag never reaches the allocator's size arithmetic.
size_t storage_bytes(int64_t positions, int64_t heads, int64_t dim, int esize);

// Parses "512,0" into a pattern (layer l gets pattern[l % size], 0 = flat).
std::vector<int64_t> parse_windows(const std::string& text);  // throws std::invalid_argument
// "fp32"/"float32"/"float", "fp16"/"half"/"float16", "bf16"/"bfloat16" -> code; -1 if unknown.
int parse_dtype(const std::string& text);

}  // namespace llmrt::offgraph
