// The batched runner's prefix cache (offgraph-cache.md §4): an LRU of snapshots of a session's KV
// cache, each captured right after its prompt's prefill (before decode writes into any ring) and
// keyed by that prompt's tokens.
//
// Rules:
//   - a lookup needs a prompt of >= 2 tokens;
//   - an entry can give reuse = min(common prefix with the prompt, prompt length - 1) tokens: the last
//     prompt token is always replayed, so the session gets fresh logits; an entry with reuse 0 is no
//     candidate;
//   - the longest reuse wins, then the most recently used entry;
//   - a snapshot with a recurrent state (a hybrid model's) resumes at the one position it was taken at
//     (resume_point): its reuse is that position when the prompt shares it, else it is refused;
//   - a snapshot that cannot resume after `reuse` tokens (its rings no longer hold the history that
//     position needs) is refused and the next candidate is tried; no candidate left = a miss;
//   - a hit and an insert count as a use; inserting the tokens of an existing entry replaces it;
//     when full, an insert evicts the least recently used entry; capacity 0 = off.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace llmrt {

class PrefixSnapshot {
 public:
  virtual ~PrefixSnapshot() = default;
  // Whether a session can resume from this snapshot after its first n tokens (false + why if not).
  virtual bool can_restore(int64_t n, std::string* why) const = 0;
  // The one position it resumes at, or -1 if any n that can_restore takes.
  virtual int64_t resume_point() const { return -1; }
};

struct PrefixHit {
  std::shared_ptr<const PrefixSnapshot> snapshot;  // null: a miss
  std::vector<int64_t> key;                        // the entry's tokens
  int64_t reused = 0;                              // positions [0, reused) come from the snapshot
  std::vector<std::string> refusals;               // candidates refused before the answer, and why
  explicit operator bool() const { return snapshot != nullptr; }
};

struct PrefixStats {
  int64_t lookups = 0, hits = 0, misses = 0, refusals = 0, inserts = 0, evictions = 0;
};

class PrefixCache {
 public:
  explicit PrefixCache(size_t capacity) : capacity_(capacity) {}

  bool enabled() const { return capacity_ > 0; }
  size_t capacity() const { return capacity_; }
  size_t size() const { return entries_.size(); }
  const PrefixStats& stats() const { return stats_; }

  void insert(std::vector<int64_t> tokens, std::shared_ptr<const PrefixSnapshot> snapshot);
  PrefixHit lookup(const std::vector<int64_t>& prompt);
  void clear() { entries_.clear(); }
  // Entry keys, most recently used first.
  std::vector<std::vector<int64_t>> keys_by_recency() const;

 private:
  struct Entry {
    std::vector<int64_t> tokens;
    std::shared_ptr<const PrefixSnapshot> snapshot;
    uint64_t used = 0;  // clock of the last use
  };
  size_t capacity_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  PrefixStats stats_;
};

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b);

}  // namespace llmrt
