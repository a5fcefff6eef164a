#include "batched/prefix_cache.h"

#include <algorithm>

namespace llmrt {

int64_t common_prefix(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return static_cast<int64_t>(i);
}

void PrefixCache::insert(std::vector<int64_t> tokens, std::shared_ptr<const PrefixSnapshot> snapshot) {
  if (!enabled() || !snapshot) return;
  ++stats_.inserts;
  for (Entry& e : entries_)
    if (e.tokens == tokens) {
      e.snapshot = std::move(snapshot);
      e.used = ++clock_;
      return;
    }
  if (entries_.size() >= capacity_) {
    auto lru = std::min_element(entries_.begin(), entries_.end(),
                                [](const Entry& a, const Entry& b) { return a.used < b.used; });
    entries_.erase(lru);
    ++stats_.evictions;
  }
  entries_.push_back(Entry{std::move(tokens), std::move(snapshot), ++clock_});
}

PrefixHit PrefixCache::lookup(const std::vector<int64_t>& prompt) {
  PrefixHit hit;
  if (!enabled()) return hit;
  ++stats_.lookups;
  const int64_t n = static_cast<int64_t>(prompt.size());
  struct Candidate {
    Entry* entry;
    int64_t reuse;
  };
  std::vector<Candidate> cands;
  if (n >= 2)
    for (Entry& e : entries_) {
      int64_t reuse = std::min(common_prefix(e.tokens, prompt), n - 1);
      const int64_t point = e.snapshot->resume_point();
      if (point >= 1 && point <= reuse) reuse = point;  // beyond it can_restore refuses, and says why
      if (reuse >= 1) cands.push_back({&e, reuse});
    }
  // longest reuse first, then the most recently used
  std::sort(cands.begin(), cands.end(), [](const Candidate& a, const Candidate& b) {
    return a.reuse != b.reuse ? a.reuse > b.reuse : a.entry->used > b.entry->used;
  });
  for (const Candidate& c : cands) {
    std::string why;
    if (!c.entry->snapshot->can_restore(c.reuse, &why)) {
      ++stats_.refusals;
      hit.refusals.push_back("entry of " + std::to_string(c.entry->tokens.size()) + " tokens, reuse " +
                             std::to_string(c.reuse) + ": " + why);
      continue;
    }
    c.entry->used = ++clock_;
    hit.snapshot = c.entry->snapshot;
    hit.key = c.entry->tokens;
    hit.reused = c.reuse;
    ++stats_.hits;
    return hit;
  }
  ++stats_.misses;
  return hit;
}

std::vector<std::vector<int64_t>> PrefixCache::keys_by_recency() const {
  std::vector<const Entry*> order;
  for (const Entry& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) { return a->used > b->used; });
  std::vector<std::vector<int64_t>> keys;
  for (const Entry* e : order) keys.push_back(e->tokens);
  return keys;
}

}  // namespace llmrt
