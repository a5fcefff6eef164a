// Open-addressing maps of the BPE model: token string -> id (VocabMap) and (left id, right id) ->
// (merge rank, merged id) (MergeMap). Header-only: the lookups are the inner loop of encoding.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace llmrt::tokenizer_detail {

class VocabMap {
 public:
  void build(const std::vector<std::string>* keys, const std::vector<uint8_t>* present) {
    keys_ = keys;
    size_t n = 0;
    for (auto p : *present) n += p;
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
    for (size_t id = 0; id < keys->size(); ++id) {
      if (!(*present)[id]) continue;
      size_t h = hash((*keys)[id]);
      uint32_t fp = static_cast<uint32_t>(h >> 32);
      size_t i = h & mask_;
      for (;;) {
        Slot& s = slots_[i];
        if (s.id < 0) {
          s = Slot{fp, static_cast<int32_t>(id)};
          break;
        }
        if (s.fp == fp && (*keys)[s.id] == (*keys)[id]) break;  // duplicate: first id wins
        i = (i + 1) & mask_;
      }
    }
  }
  // Looks up n keys whose hashes are given, overlapping the memory latency of
  // the lookups (used to resolve ~1.5M merge strings at load time).
  void find_batch(const std::string_view* keys, const size_t* hashes, size_t n, int32_t* out) const {
    constexpr size_t kMax = 64;
    int32_t cand[kMax];
    for (size_t base = 0; base < n; base += kMax) {
      size_t m = std::min(kMax, n - base);
      for (size_t k = 0; k < m; ++k) __builtin_prefetch(&slots_[hashes[base + k] & mask_]);
      for (size_t k = 0; k < m; ++k) {
        size_t h = hashes[base + k];
        uint32_t fp = static_cast<uint32_t>(h >> 32);
        cand[k] = -1;
        for (size_t i = h & mask_;; i = (i + 1) & mask_) {
          const Slot& s = slots_[i];
          if (s.id < 0) break;
          if (s.fp == fp) {
            cand[k] = s.id;
            __builtin_prefetch(&(*keys_)[s.id]);
            break;
          }
        }
      }
      for (size_t k = 0; k < m; ++k) {
        int32_t c = cand[k];
        // No fingerprint match: absent. A match on a different key: full probe.
        out[base + k] = c < 0 ? -1 : ((*keys_)[c] == keys[base + k] ? c : find(keys[base + k]));
      }
    }
  }
  static size_t fnv_extend(uint64_t h, std::string_view s) {
    for (unsigned char ch : s) {
      h ^= ch;
      h *= 1099511628211ULL;
    }
    return static_cast<size_t>(h);
  }
  static size_t finalize(uint64_t h) {
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return static_cast<size_t>(h);
  }
  static constexpr uint64_t kFnvBasis = 1469598103934665603ULL;

  int32_t find(std::string_view k) const {
    if (slots_.empty()) return -1;
    size_t h = hash(k);
    uint32_t fp = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.fp == fp && (*keys_)[s.id] == k) return s.id;
    }
  }

 private:
  struct Slot {
    uint32_t fp;
    int32_t id;
  };
  // FNV-1a, then a 64-bit finalizer (short keys: cheaper than murmur here).
  static size_t hash(std::string_view s) { return finalize(fnv_extend(kFnvBasis, s)); }
  const std::vector<std::string>* keys_ = nullptr;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct MergeVal {
  int32_t rank;
  int32_t id;
};

class MergeMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, MergeVal{0, 0});
    mask_ = cap - 1;
  }
  void insert_or_assign(uint64_t key, MergeVal v) {
    size_t h = mix(key) & mask_;
    while (keys_[h] != kEmpty && keys_[h] != key) h = (h + 1) & mask_;
    if (keys_[h] == kEmpty) ++size_;
    keys_[h] = key;
    vals_[h] = v;
  }
  const MergeVal* find(uint64_t key) const {
    if (keys_.empty()) return nullptr;
    size_t h = mix(key) & mask_;
    for (;;) {
      uint64_t k = keys_[h];
      if (k == key) return &vals_[h];
      if (k == kEmpty) return nullptr;
      h = (h + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
  }
  std::vector<uint64_t> keys_;
  std::vector<MergeVal> vals_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace llmrt::tokenizer_detail
