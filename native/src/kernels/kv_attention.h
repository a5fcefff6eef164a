// The attention core shared by both cache modes that own their attention:
//   - llmpipe::update_and_attend (off-graph: the runtime owns the cache, offgraph_kernel.cpp)
//   - llmpipe::cached_attention  (custom: the cache is a mutable buffer of the program, custom_kernel.cpp)
//
// Both store K/V slot-major, [slot][kv_head][row], in Float, Half, BFloat16, int8 or int4 rows, a layer being
// either flat (slot = position) or a ring of `ring` slots (slot = position % ring). A step writes
// logical positions [pos, pos+T) and reads [base, end) oldest to newest, each as at most two runs
// of consecutive slots (a Plan). Attention runs in fp32, in work units over every head (a decode step's
// query rows and key splits, a row group's tiles of rows) on the ExecuTorch threadpool that XNNPACK uses too.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <executorch/runtime/core/exec_aten/exec_aten.h>

namespace llmrt::kv {

// ExecuTorch ScalarType codes. kByte tensors hold int4 K/V rows (ExecuTorch has no 4-bit tensor type).
constexpr int kByte = 0, kChar = 1, kHalf = 5, kFloat = 6, kBFloat16 = 15;
const char* dtype_name(int code);
int element_size(int code);  // a float type's bytes; 0 otherwise

// K/V storage rows. A float type stores dim elements. The quantized types store their values in groups of 32 (the
// last may be shorter), each group symmetric with a scale; the scales come first, in reverse (group 0's right before
// the values), so a reader finds a group's scale from the values' address alone. A row is self-contained wherever it
// moves (cells, snapshots, rings).
//   kChar (int8): an fp32 scale a group, scale = max |x| / 127, value = round(x / scale) in [-127, 127].
//   kByte (int4): the row first rotated (kv_rows.h hadamard_rows), then an fp16 scale a group, scale = the group's
//     value of largest magnitude / -8, value = round(x / scale) in [-8, 7], stored + 8 two a byte (element 2i the
//     low nibble). Attention reads it in the rotated basis: the core rotates each query row on entry and each
//     output row back (the rotation is its own inverse), so q . k and the weighted sum of v are the unrotated ones.
constexpr int64_t kQuantGroup = 32;
inline bool quantized(int code) { return code == kChar || code == kByte; }
inline bool rotated(int code) { return code == kByte; }
inline int64_t scale_bytes(int code, int64_t dim) {
  const int64_t groups = (dim + kQuantGroup - 1) / kQuantGroup;
  return code == kChar ? 4 * groups : code == kByte ? 2 * groups : 0;
}
int64_t row_bytes(int code, int64_t dim);  // 0 if the code is no storage type
// A row's stored width in the code's elements (the last dim of an in-graph cache buffer), and back
inline int64_t row_elements(int code, int64_t dim) {
  return code == kChar ? dim + scale_bytes(code, dim) : code == kByte ? (dim + 1) / 2 + scale_bytes(code, dim) : dim;
}
int64_t row_values(int code, int64_t elements);  // -1 if no row of the code is that wide

struct Run {
  int64_t slot = 0, count = 0;
};

struct Plan {
  int layer = 0;
  int64_t pos = 0, T = 0;
  int64_t base = 0, end = 0;  // keys read are logical [base, end)
  Run write[2], read[2];
  int n_write = 0, n_read = 0;
  int64_t span() const { return end - base; }
};

// Consecutive logical positions [start, start+count) as physical runs (ring 0 = flat). Returns the number of runs.
int make_runs(int64_t start, int64_t count, int64_t ring, Run* runs);

// The plan of one step in a layer of `window` (0 = flat) and `ring` slots (0 = flat). Pure; the
// caller has checked capacity and, on a ring, that T <= ring - window + 1.
Plan plan_step(int layer, int64_t pos, int64_t T, int64_t window, int64_t ring);

// The shapes of one step, checked: q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (float types,
// Hq % Hkv == 0), position [T] (Long/Int, consecutive from pos), out of out_dtype.
struct StepArgs {
  int64_t Hq = 0, T = 0, D = 0, Hkv = 0, Dv = 0, pos = 0;
};
// consecutive = false (a batched step): only the count and type of the positions are checked.
bool check_step_args(const executorch::aten::Tensor& q, const executorch::aten::Tensor& k,
                     const executorch::aten::Tensor& v, const executorch::aten::Tensor& position,
                     executorch::aten::ScalarType out_dtype, const executorch::aten::Tensor& out,
                     StepArgs* args, std::string* why, bool consecutive = true);
// The sinks argument of an attention op: none, or Float [Hq] (its data in *out); false with *why otherwise.
bool check_sinks(const std::optional<executorch::aten::Tensor>& sinks, int64_t Hq, const float** out,
                 std::string* why);
// Entry i of a Long or Int position tensor.
int64_t position_at(const executorch::aten::Tensor& position, int64_t i);
// Resizes out to [1,Hq,T,Dv].
bool resize_out(executorch::aten::Tensor& out, const StepArgs& a);

// Where one layer's slots live.
struct SlotView {
  uint8_t* k = nullptr;  // slot 0 of the keys
  uint8_t* v = nullptr;  // slot 0 of the values
  int64_t kv_heads = 0, head_dim = 0, v_dim = 0;
  int dtype = kFloat;  // storage dtype code
  int64_t window = 0;  // 0 = full attention
  // 0: slot-major [slot][kv_head][row]; > 0: head-major BHSD [kv_head][slot][dim] over this many slots
  // (HF's static cache layout, which llmpipe::sdpa / llmpipe::update_cache read and write; float types only)
  int64_t head_major_slots = 0;
  // per query head, a sink logit every row's softmax also counts, whose value row is zero (gpt-oss), or none
  const float* sinks = nullptr;
  // bytes of one row, and between consecutive slots / kv heads, of the keys (dim = head_dim) or values (dim = v_dim)
  int64_t row(int64_t dim) const { return row_bytes(dtype, dim); }
  int64_t values_offset(int64_t dim) const { return scale_bytes(dtype, dim); }
  int64_t slot_stride(int64_t dim) const { return head_major_slots ? row(dim) : kv_heads * row(dim); }
  int64_t head_stride(int64_t dim) const { return head_major_slots ? head_major_slots * row(dim) : row(dim); }
};

// Writes k [1,Hkv,T,D] and v [1,Hkv,T,Dv] (any float type) at the plan's write runs.
void write_step(const SlotView& s, const Plan& p, const executorch::aten::Tensor& k,
                const executorch::aten::Tensor& v);

// out [1,Hq,T,Dv] (dtype out_code) = softmax(q K^T * scale, causal / banded mask) V over the plan's read runs.
void attend(const SlotView& s, const Plan& p, const executorch::aten::Tensor& q, float scale, void* out,
            int out_code);

// A row group of a step whose rows may belong to different sequences (the batched runner packs
// several sessions into one forward): rows [row0, row0 + T) of the step's T axis are queries at
// logical positions [pos, pos + T) of one layer cache, whose keys are logical [base, pos + T).
// Slots are explicit lists, so a cache need not be runs (a pool of cells is not).
struct Segment {
  SlotView view;
  int64_t pos = 0, T = 0, row0 = 0, base = 0;
  const int64_t* write = nullptr;  // T physical slots the step's entries go to
  const int64_t* read = nullptr;   // pos + T - base physical slots, oldest first
  int64_t span() const { return pos + T - base; }
};

// The plan's runs as slot lists (write: T entries, read: span entries).
void plan_slots(const Plan& p, std::vector<int64_t>* write, std::vector<int64_t>* read);

// Writes rows [row0, row0 + T) of k [1,Hkv,Ttot,D] / v [1,Hkv,Ttot,Dv] at the segment's write slots.
void write_segment(const Segment& s, const executorch::aten::Tensor& k, const executorch::aten::Tensor& v);

// For every segment, out rows [row0, row0 + T) (out [1,Hq,Ttot,Dv], dtype out_code) = the attention of
// those query rows over the segment's keys; one threadpool pass over all (segment, head, query) rows.
void attend_segments(const Segment* segs, int n, const executorch::aten::Tensor& q, float scale, void* out,
                     int out_code);

}  // namespace llmrt::kv
