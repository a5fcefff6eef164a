#include "kernels/offgraph_cache.h"

#include <cstdio>

#include <algorithm>
#include <cctype>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "platform/sysmem.h"

namespace llmrt::offgraph {

namespace {

std::string range(int64_t a, int64_t b) {
  return "[" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

}  // namespace

int64_t ring_slots_for(int64_t window, int64_t max_write, int64_t capacity) {
  return window >= capacity ? capacity : std::min(window + max_write - 1, capacity);
}

size_t storage_bytes(int64_t positions, int64_t heads, int64_t dim, int esize) {
  const unsigned __int128 n = (unsigned __int128)std::max<int64_t>(positions, 0) * std::max<int64_t>(heads, 0) *
                              std::max<int64_t>(dim, 0) * std::max(esize, 0);
  if (n > physical_memory_bytes())
    throw std::length_error("the KV cache would need " +
                            (n >> 64 ? std::string("more than 2^64") : std::to_string((uint64_t)n)) +
                            " bytes for " + std::to_string(positions) + " positions of " + std::to_string(heads) +
                            " x " + std::to_string(dim) + " elements, more than this machine's memory");
  return static_cast<size_t>(n);
}

OffgraphKvCache::OffgraphKvCache(std::vector<LayerSpec> specs, int64_t capacity,
                                 int64_t max_write, int64_t initial_capacity, int dtype_code)
    : capacity_(capacity), max_write_(max_write), initial_(initial_capacity), dtype_(dtype_code) {
  if (capacity < 1) throw std::invalid_argument("KV capacity must be >= 1, got " + std::to_string(capacity));
  if (max_write < 1)
    throw std::invalid_argument("max_write (prefill chunk) must be >= 1, got " + std::to_string(max_write));
  if (initial_capacity < 1)
    throw std::invalid_argument("initial KV capacity must be >= 1, got " +
                                std::to_string(initial_capacity));
  if (kv::row_bytes(dtype_code, 1) == 0)
    throw std::invalid_argument("KV storage dtype code " + std::to_string(dtype_code) +
                                " is not supported (Float, Half, BFloat16, Char: int8 rows or Byte: int4 rows)");
  if (specs.empty()) throw std::invalid_argument("an off-graph cache needs at least one layer");
  initial_ = std::min(initial_, capacity_);
  for (size_t i = 0; i < specs.size(); ++i) {
    const LayerSpec& s = specs[i];
    if (s.kv_heads < 1 || s.head_dim < 1 || s.v_dim < 1 || s.window < 0)
      throw std::invalid_argument("cache " + std::to_string(i) + ": bad geometry (kv_heads " +
                                  std::to_string(s.kv_heads) + ", head_dim " +
                                  std::to_string(s.head_dim) + ", v_dim " + std::to_string(s.v_dim) +
                                  ", window " + std::to_string(s.window) + ")");
    Layer L;
    L.spec = s;
    if (s.window > 0) {
      L.ring = ring_slots_for(s.window, max_write_, capacity_);
      L.allocated = L.ring;
    } else {
      L.allocated = initial_;
    }
    L.k.assign(storage_bytes(L.allocated, s.kv_heads, kv::row_bytes(dtype_, s.head_dim), 1), 0);
    L.v.assign(storage_bytes(L.allocated, s.kv_heads, kv::row_bytes(dtype_, s.v_dim), 1), 0);
    layers_.push_back(std::move(L));
  }
}

bool OffgraphKvCache::plan(int layer, int64_t pos, int64_t T, Plan* out, std::string* why) const {
  auto fail = [&](const std::string& m) {
    if (why) *why = m;
    return false;
  };
  if (layer < 0 || layer >= n_layers())
    return fail("cache_id " + std::to_string(layer) + " out of range: the cache has " +
                std::to_string(n_layers()) + " layers");
  if (T < 1) return fail("a step needs >= 1 token, got " + std::to_string(T));
  if (pos < 0 || pos > length_)
    return fail("write at position " + std::to_string(pos) + " leaves a gap (cache length " +
                std::to_string(length_) + "); rewind first");
  int64_t end = pos + T;
  if (end > capacity_)
    return fail("positions " + range(pos, end) + " exceed the KV capacity " + std::to_string(capacity_));
  const Layer& L = layers_[layer];
  if (L.ring != 0 && T > max_write_)
    return fail("a step of " + std::to_string(T) + " tokens exceeds max_write " +
                std::to_string(max_write_) + " of ring cache " + std::to_string(layer) + " (window " +
                std::to_string(L.spec.window) + ", " + std::to_string(L.ring) + " slots)");
  if (out) *out = kv::plan_step(layer, pos, T, L.spec.window, L.ring);
  return true;
}

bool OffgraphKvCache::check_step(int64_t pos, int64_t T, std::string* why) const {
  if (!states_.step_ok(length_, pos, why)) return false;
  for (int l = 0; l < n_layers(); ++l)
    if (!plan(l, pos, T, nullptr, why)) return false;
  return true;
}

void OffgraphKvCache::commit(int64_t pos, int64_t T) { length_ = std::max(length_, pos + T); }

void OffgraphKvCache::ensure(int layer, int64_t end) {
  Layer& L = layers_[layer];
  if (L.ring != 0 || end <= L.allocated) return;
  int64_t n = std::max<int64_t>(L.allocated, 1);
  while (n < end) n *= 2;
  n = std::min(n, capacity_);
  // resize keeps the existing cells where they are (slot index = position)
  L.k.resize(storage_bytes(n, L.spec.kv_heads, kv::row_bytes(dtype_, L.spec.head_dim), 1), 0);
  L.v.resize(storage_bytes(n, L.spec.kv_heads, kv::row_bytes(dtype_, L.spec.v_dim), 1), 0);
  L.allocated = n;
}

uint8_t* OffgraphKvCache::k_slot(int layer, int64_t slot) {
  Layer& L = layers_[layer];
  return L.k.data() + static_cast<size_t>(slot * L.spec.kv_heads * kv::row_bytes(dtype_, L.spec.head_dim));
}

uint8_t* OffgraphKvCache::v_slot(int layer, int64_t slot) {
  Layer& L = layers_[layer];
  return L.v.data() + static_cast<size_t>(slot * L.spec.kv_heads * kv::row_bytes(dtype_, L.spec.v_dim));
}

kv::SlotView OffgraphKvCache::view(int layer) {
  Layer& L = layers_[layer];
  return {L.k.data(), L.v.data(), L.spec.kv_heads, L.spec.head_dim, L.spec.v_dim, dtype_, L.spec.window};
}

int64_t OffgraphKvCache::rewind_floor() const {
  int64_t floor = 0;
  for (const Layer& L : layers_)
    if (L.ring != 0) floor = std::max(floor, ring_rewind_floor(length_, L.ring, L.spec.window));
  return floor;
}

bool OffgraphKvCache::can_rewind(int64_t target, std::string* why) const {
  if (target < 0 || target > length_) {
    if (why) *why = "cannot rewind to " + std::to_string(target) + " (length " + std::to_string(length_) + ")";
    return false;
  }
  if (target == 0 || target == length_) return true;
  if (!states_.rewind_ok(length_, target, why)) return false;
  int64_t floor = rewind_floor();
  if (target < floor) {
    if (why)
      *why = "cannot rewind to " + std::to_string(target) +
             ": the ring caches no longer hold its window (lowest safe target " +
             std::to_string(floor) + ", or 0 to reset)";
    return false;
  }
  return true;
}

bool OffgraphKvCache::rewind(int64_t target, std::string* why) {
  if (!can_rewind(target, why)) return false;
  length_ = target;
  return true;
}

bool snapshot_restorable(int64_t target, int64_t length, int64_t floor, std::string* why) {
  if (target <= length && (target == 0 || target >= floor)) return true;
  if (why)
    *why = "cannot restore a snapshot at " + std::to_string(target) + " (length " + std::to_string(length) +
           ", lowest safe target " + std::to_string(floor) + ")";
  return false;
}

bool OffgraphKvCache::restore(const Snapshot& s, std::string* why) {
  if (!snapshot_restorable(s.length, length_, rewind_floor(), why)) return false;
  states_ = s.states;
  length_ = s.length;
  return true;
}

void OffgraphKvCache::reset() {
  length_ = 0;
  states_.clear();
}

std::vector<StateSpec> state_specs(const int64_t* dims, size_t n_values) {
  if (n_values % 5 != 0)
    throw std::invalid_argument("get_state_shapes holds " + std::to_string(n_values) +
                                " values: five per recurrent layer expected");
  std::vector<StateSpec> specs;
  for (size_t i = 0; i < n_values; i += 5)
    specs.push_back({dims[i], dims[i + 1], dims[i + 2], dims[i + 3], dims[i + 4]});
  return specs;
}

std::string state_name(const StateSpec& s) {
  if (s.heads == 0) return "conv(" + std::to_string(s.conv_rows) + "x" + std::to_string(s.conv_channels) + ")";
  return "matrix(" + std::to_string(s.heads) + "x" + std::to_string(s.key_dim) + "x" + std::to_string(s.value_dim) +
         ")";
}

RecurrentStates::RecurrentStates(std::vector<StateSpec> specs) {
  states_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const StateSpec& s = specs[i];
    const bool delta = s.heads != 0 || s.key_dim != 0 || s.value_dim != 0;
    const bool bad_delta = delta && (s.heads < 1 || s.key_dim < 1 || s.value_dim < 1);
    if (s.conv_rows < 1 || s.conv_channels < 1 || s.heads < 0 || bad_delta)
      throw std::invalid_argument("state " + std::to_string(i) + ": bad shape (heads " + std::to_string(s.heads) +
                                  ", key dim " + std::to_string(s.key_dim) + ", value dim " +
                                  std::to_string(s.value_dim) + ", conv " + std::to_string(s.conv_rows) + "x" +
                                  std::to_string(s.conv_channels) + ")");
    states_[i].spec = s;
    states_[i].delta.assign(storage_bytes(s.heads, s.key_dim, s.value_dim, sizeof(float)) / sizeof(float), 0.f);
    states_[i].conv.assign(storage_bytes(s.conv_rows, s.conv_channels, 1, sizeof(float)) / sizeof(float), 0.f);
  }
}

void RecurrentStates::clear() {
  for (State& s : states_) {
    std::fill(s.delta.begin(), s.delta.end(), 0.f);
    std::fill(s.conv.begin(), s.conv.end(), 0.f);
  }
}

int64_t RecurrentStates::bytes() const {
  int64_t b = 0;
  for (const State& s : states_) b += static_cast<int64_t>((s.delta.size() + s.conv.size()) * sizeof(float));
  return b;
}

std::vector<StateSpec> RecurrentStates::specs() const {
  std::vector<StateSpec> out;
  for (const State& st : states_) out.push_back(st.spec);
  return out;
}

std::string state_line(const std::vector<StateSpec>& specs, bool runtime_owned) {
  if (specs.empty()) return "";
  double bytes = 0;
  for (const StateSpec& sp : specs)
    bytes += 4.0 * static_cast<double>(sp.heads * sp.key_dim * sp.value_dim + sp.conv_rows * sp.conv_channels);
  char size[32];
  if (bytes >= 1 << 20) std::snprintf(size, sizeof size, "%.1f MiB", bytes / (1 << 20));
  else std::snprintf(size, sizeof size, "%.1f KiB", bytes / 1024);
  return std::string("[cache] recurrent state fp32 | ") + size + " per sequence, whatever the depth " +
         (runtime_owned ? "(the program's get_state_shapes; --kv-max-capacity, --kv-storage-dtype and --kv-windows "
                          "size the attention layers only)"
                        : "(the program's buffers)");
}

std::string state_counts(const std::vector<StateSpec>& specs) {
  std::map<std::string, int> n;  // e.g. matrix(16x128x128), conv(3x1024)
  for (const StateSpec& sp : specs) ++n[state_name(sp)];
  std::string s;
  for (auto& [name, count] : n) s += std::to_string(count) + " " + name + " + ";
  return s;
}

bool RecurrentStates::step_ok(int64_t length, int64_t pos, std::string* why) const {
  if (empty() || pos == 0 || pos == length) return true;
  if (why)
    *why = "a step at position " + std::to_string(pos) + ": the recurrent state holds position " +
           std::to_string(length) + " only (go on there, or start over at 0)";
  return false;
}

bool RecurrentStates::rewind_ok(int64_t length, int64_t target, std::string* why) const {
  if (empty() || target == 0 || target == length) return true;
  if (why)
    *why = "cannot rewind to " + std::to_string(target) + ": the recurrent state holds position " +
           std::to_string(length) + " only (0 to reset)";
  return false;
}

int64_t OffgraphKvCache::bytes() const {
  int64_t b = 0;
  for (const Layer& L : layers_) b += static_cast<int64_t>(L.k.size() + L.v.size());
  return b + states_.bytes();
}

std::string OffgraphKvCache::describe() const {
  int flat = 0;
  std::map<int64_t, int> rings;
  for (const Layer& L : layers_) {
    if (L.ring == 0) ++flat;
    else ++rings[L.spec.window];
  }
  std::string s = "[cache] off-graph seq | capacity=" + std::to_string(capacity_) +
                  " initial=" + std::to_string(initial_) + " kv_dtype=" + dtype_name(dtype_) + "\n" +
                  std::to_string(n_layers() + states_.size()) + " layers: " + state_counts(states_.specs()) +
                  std::to_string(flat) + " flat";
  for (auto& [w, n] : rings) s += " + " + std::to_string(n) + " ring(window " + std::to_string(w) + ")";
  if (shared_ > 0) s += ", " + std::to_string(shared_) + " shared";
  return s;
}

// -- binding -------------------------------------------------------------------------------
namespace {
std::atomic<OffgraphKvCache*> g_bound{nullptr};
std::atomic<const BatchStep*> g_batch{nullptr};
std::mutex g_err_mu;
std::string g_last_error;
}  // namespace

void bind_cache(OffgraphKvCache* cache) {
  g_batch.store(nullptr, std::memory_order_release);
  g_bound.store(cache, std::memory_order_release);
}
OffgraphKvCache* bound_cache() { return g_bound.load(std::memory_order_acquire); }

void bind_batch(const BatchStep* step) {
  g_bound.store(nullptr, std::memory_order_release);
  g_batch.store(step, std::memory_order_release);
}
const BatchStep* bound_batch() { return g_batch.load(std::memory_order_acquire); }

void set_last_error(const std::string& msg) {
  std::lock_guard<std::mutex> g(g_err_mu);
  g_last_error = msg;
}

std::string last_error() {
  std::lock_guard<std::mutex> g(g_err_mu);
  return g_last_error;
}

std::vector<int64_t> parse_windows(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) throw std::invalid_argument("--kv-windows has an empty entry: '" + text + "'");
    item = item.substr(a, b - a + 1);
    size_t used = 0;
    long long w = 0;
    try {
      w = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || w < 0)
      throw std::invalid_argument("--kv-windows expects non-negative integers, got '" + item + "'");
    out.push_back(w);
  }
  if (out.empty()) throw std::invalid_argument("--kv-windows is empty");
  return out;
}

int parse_dtype(const std::string& text) {
  std::string t;
  for (char c : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t == "fp32" || t == "float32" || t == "float") return kFloat;
  if (t == "fp16" || t == "float16" || t == "half") return kHalf;
  if (t == "bf16" || t == "bfloat16") return kBFloat16;
  if (t == "int8") return kv::kChar;
  if (t == "int4") return kv::kByte;
  return -1;
}

}  // namespace llmrt::offgraph
