// prefix_cache_test: the prefix-cache rules (prefix_cache.h) and the batched runner's session
// caches (session_cache.h, cell_pool.h), without a program. Prints "ok <name>" or
// "FAIL <name>: <what>" per case; exit 1 if any case failed. Run by tests/native/test_batched_runner.py.
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "batched/cell_pool.h"
#include "batched/prefix_cache.h"
#include "batched/session_cache.h"

namespace {

using namespace llmrt;
using Ids = std::vector<int64_t>;

std::string g_failure;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      if (g_failure.empty()) g_failure = std::string(#cond) + " (line " + std::to_string(__LINE__) + ")"; \
      return;                                                                         \
    }                                                                                 \
  } while (0)

Ids range(int64_t a, int64_t b) {  // [a, b)
  Ids v(static_cast<size_t>(b - a));
  std::iota(v.begin(), v.end(), a);
  return v;
}

Ids cat(Ids a, const Ids& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A snapshot that cannot resume below `floor` tokens (a ring that no longer holds the history).
struct FakeSnapshot final : PrefixSnapshot {
  explicit FakeSnapshot(int64_t floor = 0, std::string name = "") : floor(floor), name(std::move(name)) {}
  bool can_restore(int64_t n, std::string* why) const override {
    if (n >= floor) return true;
    if (why) *why = "floor " + std::to_string(floor);
    return false;
  }
  int64_t floor;
  std::string name;
};

std::shared_ptr<FakeSnapshot> snap(const std::string& name, int64_t floor = 0) {
  return std::make_shared<FakeSnapshot>(floor, name);
}

std::string name_of(const PrefixHit& h) {
  return h ? static_cast<const FakeSnapshot&>(*h.snapshot).name : "miss";
}

// -- prefix-cache rules ----------------------------------------------------------------------

void equal_prompt_replays_the_last_token() {
  PrefixCache pc(4);
  pc.insert(range(1, 11), snap("A"));
  PrefixHit h = pc.lookup(range(1, 11));
  CHECK(name_of(h) == "A" && h.reused == 9);
}

void shorter_prompt_replays_its_last_token() {
  PrefixCache pc(4);
  pc.insert(range(1, 11), snap("A"));
  PrefixHit h = pc.lookup(range(1, 7));
  CHECK(name_of(h) == "A" && h.reused == 5);
}

void extended_prompt_reuses_the_whole_entry() {
  PrefixCache pc(4);
  pc.insert(range(1, 11), snap("A"));
  PrefixHit h = pc.lookup(range(1, 13));
  CHECK(name_of(h) == "A" && h.reused == 10);
}

void short_or_unrelated_prompts_miss() {
  PrefixCache pc(4);
  pc.insert(range(1, 11), snap("A"));
  CHECK(!pc.lookup({1}));          // a lookup needs >= 2 tokens
  CHECK(!pc.lookup({50, 51, 52}));  // no common prefix
  CHECK(!pc.lookup({}));
  CHECK(pc.stats().misses == 3 && pc.stats().hits == 0);
}

void longest_match_wins_then_most_recent() {
  PrefixCache pc(4);
  pc.insert({1, 2, 3, 9, 9}, snap("B"));
  pc.insert(range(1, 8), snap("C"));
  pc.insert({1, 2, 3, 4, 5, 6, 7, 8, 9}, snap("L"));  // the longest entry, but inserted last
  CHECK(name_of(pc.lookup(cat(range(1, 8), {20}))) == "L");  // L: reuse 7 == C's 7, L more recent
  PrefixHit h = pc.lookup({1, 2, 3, 9, 9, 9});
  CHECK(name_of(h) == "B" && h.reused == 5);  // longest: B shares 5, the others 3
  // reuse ties at 3: the most recently used wins (B, just hit), then an insert makes D the newest
  CHECK(name_of(pc.lookup({1, 2, 3, 42})) == "B");
  pc.insert({1, 2, 3, 7}, snap("D"));
  CHECK(name_of(pc.lookup({1, 2, 3, 42})) == "D");
  CHECK(name_of(pc.lookup(cat(range(1, 8), {20}))) == "L");  // ...and longest still beats recency
}

void lru_evicts_the_least_recently_used() {
  PrefixCache pc(2);
  pc.insert({1, 2, 3}, snap("A"));
  pc.insert({4, 5, 6}, snap("B"));
  CHECK(name_of(pc.lookup({1, 2, 3})) == "A");  // A used after B
  pc.insert({7, 8, 9}, snap("C"));              // evicts B
  CHECK(pc.size() == 2 && pc.stats().evictions == 1);
  CHECK(!pc.lookup({4, 5, 6}));
  CHECK(pc.keys_by_recency() == (std::vector<Ids>{{7, 8, 9}, {1, 2, 3}}));
}

void same_tokens_replace_the_entry() {
  PrefixCache pc(2);
  pc.insert({1, 2, 3}, snap("old"));
  pc.insert({1, 2, 3}, snap("new"));
  CHECK(pc.size() == 1 && pc.stats().evictions == 0);
  CHECK(name_of(pc.lookup({1, 2, 3})) == "new");
}

void retention_refusal_falls_back() {
  PrefixCache pc(4);
  // X: a 30-token prompt whose rings only resume from 22 on; Y: an older 20-token prompt
  pc.insert(range(1, 21), snap("Y"));
  pc.insert(range(1, 31), snap("X", 22));
  PrefixHit h = pc.lookup(cat(range(1, 21), {99}));  // X and Y both share 20: X (newer) is refused
  CHECK(name_of(h) == "Y" && h.reused == 20 && h.refusals.size() == 1);
  CHECK(pc.stats().refusals == 1);
  h = pc.lookup(cat(range(1, 26), {99}));  // X shares 25 >= 22: no refusal
  CHECK(name_of(h) == "X" && h.reused == 25 && h.refusals.empty());
  // every candidate refused: a miss (a fresh session)
  PrefixCache only(1);
  only.insert(range(1, 31), snap("X", 22));
  h = only.lookup(cat(range(1, 11), {99}));
  CHECK(!h && h.refusals.size() == 1 && only.stats().misses == 1);
}

void zero_entries_is_off() {
  PrefixCache pc(0);
  pc.insert({1, 2, 3}, snap("A"));
  CHECK(!pc.enabled() && pc.size() == 0);
  CHECK(!pc.lookup({1, 2, 3}) && pc.stats().lookups == 0);
}

// -- session caches --------------------------------------------------------------------------

std::vector<offgraph::LayerSpec> ring_and_flat() { return {{1, 4, 4, 4}, {1, 4, 4, 0}}; }  // w=4 ring, flat

template <typename Cache>
bool step(Cache& c, int64_t pos, int64_t T, std::string* why = nullptr) {
  if (!c.reserve(pos, T, why)) return false;
  c.commit(pos, T);
  return true;
}

// The spec's example: w=4, chunk 4 -> ring 7; decode at position 7 writes slot 0 and reads
// physical [4..6] + [0] from base position 4.
void ring_example_in_both_kinds() {
  SequenceCache seq(ring_and_flat(), 50, 4, 8, kv::kFloat);
  CellPool pool(ring_and_flat(), 50, 4, 8, kv::kFloat);
  CellCache cell(pool);
  CHECK(step(seq, 0, 4) && step(seq, 4, 3) && step(cell, 0, 4) && step(cell, 4, 3));
  CHECK(seq.reserve(7, 1, nullptr) && cell.reserve(7, 1, nullptr));
  offgraph::StepSlots s, c;
  std::string why;
  CHECK(seq.step_slots(0, 7, 1, &s, &why) && cell.step_slots(0, 7, 1, &c, &why));
  CHECK(s.base == 4 && s.write == Ids{0} && s.read == (Ids{4, 5, 6, 0}));
  const int g = pool.group_of(0);
  CHECK(pool.ring(g) == 7 && c.base == 4 && c.write == Ids{cell.cell_at(g, 7)});
  CHECK(c.read == (Ids{cell.cell_at(g, 4), cell.cell_at(g, 5), cell.cell_at(g, 6), cell.cell_at(g, 7)}));
  CHECK(!seq.reserve(7, 5, &why) && why.find("max_write 4") != std::string::npos);
  CHECK(!cell.reserve(7, 5, &why) && why.find("max_write 4") != std::string::npos);
}

void rewind_floors_match() {
  SequenceCache seq(ring_and_flat(), 50, 4, 3, kv::kFloat);
  CellPool pool(ring_and_flat(), 50, 4, 3, kv::kFloat);
  CellCache cell(pool);
  for (int64_t p = 0; p < 12; p += 4) CHECK(step(seq, p, 4) && step(cell, p, 4));
  std::string a, b;
  CHECK(!seq.can_rewind(7, &a) && !cell.can_rewind(7, &b));
  CHECK(a.find("lowest safe target 8") != std::string::npos && b.find("lowest safe target 8") != std::string::npos);
  CHECK(seq.can_rewind(8, nullptr) && cell.can_rewind(8, nullptr) && cell.can_rewind(0, nullptr));
  CHECK(!seq.reserve(13, 1, &a) && a.find("gap") != std::string::npos);
  CHECK(!cell.reserve(13, 1, &b) && b.find("gap") != std::string::npos);
}

void capacity_is_refused() {
  CellPool pool({{1, 4, 4, 0}}, 10, 16, 4, kv::kFloat);
  CellCache cell(pool);
  std::string why;
  CHECK(!cell.reserve(0, 11, &why) && why.find("[0, 11) exceed the KV capacity 10") != std::string::npos);
  CHECK(step(cell, 0, 10));
}

void clone_shares_cells_and_copies_on_write() {
  CellPool pool(ring_and_flat(), 50, 4, 2, kv::kFloat);
  const int ring = pool.group_of(0), flat = pool.group_of(1);
  int64_t in_use = 0;
  {
    CellCache a(pool);
    for (int64_t p = 0; p < 10; p += 2) CHECK(step(a, p, 2));
    CHECK(pool.cells_allocated(flat) == 16);  // 2 -> 4 -> 8 -> 16: grown, indices kept
    in_use = pool.cells_in_use();
    CHECK(in_use == 10 + 7);  // 10 flat positions + a full ring
    std::unique_ptr<SessionCache> b = a.clone();
    CHECK(pool.cells_in_use() == in_use);  // a snapshot costs no cell
    auto& bc = static_cast<CellCache&>(*b);
    CHECK(b->rewind(6, nullptr) && pool.cells_in_use() == in_use);  // a still holds 6..9
    CHECK(b->reserve(6, 1, nullptr));
    CHECK(pool.cells_in_use() == in_use + 2);  // a fresh flat cell + the ring slot copied on write
    CHECK(bc.cell_at(ring, 6) != a.cell_at(ring, 6) && bc.cell_at(flat, 6) != a.cell_at(flat, 6));
    for (int64_t p = 0; p < 6; ++p) CHECK(bc.cell_at(flat, p) == a.cell_at(flat, p));
    CHECK(bc.cell_at(ring, 5) == a.cell_at(ring, 5));
    // b's own ring cell is overwritten in place; the rewound flat cell was freed and is taken again
    const int32_t own = bc.cell_at(ring, 6);
    CHECK(b->rewind(6, nullptr) && b->reserve(6, 1, nullptr));
    CHECK(pool.cells_in_use() == in_use + 2 && bc.cell_at(ring, 6) == own);
  }
  CHECK(pool.cells_in_use() == 0);  // every session gone: every cell free
}

void sequence_clone_is_independent() {
  SequenceCache a(ring_and_flat(), 50, 4, 4, kv::kFloat);
  CHECK(step(a, 0, 4) && step(a, 4, 4) && step(a, 8, 2));
  std::unique_ptr<SessionCache> b = a.clone();
  CHECK(b->length() == 10 && b->bytes() == a.bytes());
  CHECK(b->rewind(9, nullptr) && step(*b, 9, 1) && step(*b, 10, 3));
  CHECK(a.length() == 10 && b->length() == 13);
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> cases = {
      {"equal_prompt_replays_the_last_token", equal_prompt_replays_the_last_token},
      {"shorter_prompt_replays_its_last_token", shorter_prompt_replays_its_last_token},
      {"extended_prompt_reuses_the_whole_entry", extended_prompt_reuses_the_whole_entry},
      {"short_or_unrelated_prompts_miss", short_or_unrelated_prompts_miss},
      {"longest_match_wins_then_most_recent", longest_match_wins_then_most_recent},
      {"lru_evicts_the_least_recently_used", lru_evicts_the_least_recently_used},
      {"same_tokens_replace_the_entry", same_tokens_replace_the_entry},
      {"retention_refusal_falls_back", retention_refusal_falls_back},
      {"zero_entries_is_off", zero_entries_is_off},
      {"ring_example_in_both_kinds", ring_example_in_both_kinds},
      {"rewind_floors_match", rewind_floors_match},
      {"capacity_is_refused", capacity_is_refused},
      {"clone_shares_cells_and_copies_on_write", clone_shares_cells_and_copies_on_write},
      {"sequence_clone_is_independent", sequence_clone_is_independent},
  };
  int failed = 0;
  for (const auto& [name, fn] : cases) {
    g_failure.clear();
    fn();
    if (g_failure.empty()) {
      std::printf("ok %s\n", name);
    } else {
      std::printf("FAIL %s: %s\n", name, g_failure.c_str());
      ++failed;
    }
  }
  std::printf("%d passed, %d failed\n", static_cast<int>(cases.size()) - failed, failed);
  return failed ? 1 : 0;
}
