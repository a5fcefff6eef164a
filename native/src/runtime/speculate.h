// Prompt-lookup speculative decoding, the runners' side (pipeline/generation/speculate.py is the Python twin):
//   - NgramDrafter: the continuation of the latest earlier occurrence of the context's last n tokens (n from
//     n_max down to n_min); a match near the end is a period and repeats;
//   - DraftBudget: how many tokens to draft, the k with the most expected tokens per second from the acceptance
//     rate and the forward times measured in this run (0: a plain step);
//   - accept_drafts: greedy keeps d_i while it is the argmax; sampling keeps d_i with probability p(d_i) and on a
//     rejection draws from p without d_i, which keeps the sampler's distribution.
// The verify forward, the rollback and the report are the runner's (turn_runner.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/sampler.h"

namespace llmrt::speculate {

// A verify step of up to kExactRows rows computes each row bit for bit as a decode step would (the attention splits a
// row's keys by its own keys; XNNPACK's GEMMs of up to 4 rows match its 1-row path on the machines measured), so
// greedy output is token-identical to plain decoding. Wider steps take other kernels whose rows differ by rounding.
constexpr int64_t kExactRows = 4;

struct Options {
  bool on = false;
  int64_t draft_max = kExactRows - 1, ngram_min = 2, ngram_max = 4;
};

// Why a program cannot speculate ("" when it can), the same in both runners: a verify step reads every row's logits
// (`all_rows`: logits mode full or selected; `mode` names the program's) and fits `rows` rows per forward.
inline std::string why_not(bool all_rows, const std::string& mode, int64_t draft_max, int64_t rows) {
  if (!all_rows)
    return "--speculate: this program returns the last row's logits only (logits mode " + mode + "); speculation "
           "verifies a draft in one forward and needs every row's: rebuild with export.logits_mode=tail (or selected, full)";
  if (draft_max > rows - 1)
    return "--draft-max " + std::to_string(draft_max) + ": a verify step feeds the drafts after the last token in one "
           "forward of at most " + std::to_string(rows) + " rows: at most " + std::to_string(rows - 1) + " drafts";
  return "";
}

struct Stats {
  int64_t drafted = 0, accepted = 0, verify_steps = 0;
};

class NgramDrafter {
 public:
  NgramDrafter(int64_t n_min, int64_t n_max) : n_min_(n_min), n_max_(n_max), index_(n_max + 1) {}

  void extend(const std::vector<int64_t>& ids) {
    for (int64_t t : ids) push(t);
  }
  void push(int64_t t) {
    const int64_t j = static_cast<int64_t>(tokens_.size());  // the n-grams ending at j - 1 continue at j
    for (int64_t n = n_min_; n <= n_max_; ++n)
      if (j >= n) index_[n][key(j - n, n)] = j;
    tokens_.push_back(t);
  }

  std::vector<int64_t> draft(int64_t k) const {
    std::vector<int64_t> out;
    const int64_t end = static_cast<int64_t>(tokens_.size());
    if (k < 1) return out;
    for (int64_t n = std::min(n_max_, end); n >= n_min_; --n) {
      auto it = index_[n].find(key(end - n, n));
      if (it == index_[n].end() || !same(it->second - n, end - n, n)) continue;
      const int64_t start = it->second, period = end - start;
      for (int64_t i = 0; i < k; ++i) out.push_back(tokens_[start + i % period]);
      return out;
    }
    return out;
  }

 private:
  uint64_t key(int64_t at, int64_t n) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(tokens_[at + i])) * 1099511628211ull;
    return h;
  }
  bool same(int64_t a, int64_t b, int64_t n) const {  // a hash hit is checked: no draft from a collision
    return std::equal(tokens_.begin() + a, tokens_.begin() + a + n, tokens_.begin() + b);
  }
  int64_t n_min_, n_max_;
  std::vector<int64_t> tokens_;
  std::vector<std::unordered_map<uint64_t, int64_t>> index_;
};

class DraftBudget {
 public:
  explicit DraftBudget(int64_t k_max) : k_max_(k_max) {}

  int64_t choose() const {
    auto t1 = times_.find(1);
    if (t1 == times_.end()) return k_max_;  // nothing measured yet: try the full draft
    double best = 1.0 / t1->second;
    int64_t best_k = 0;
    for (int64_t k = 1; k <= k_max_; ++k) {
      double tokens = 0, a = 1;
      for (int64_t i = 0; i <= k; ++i, a *= rate_) tokens += a;
      auto t = times_.find(k + 1);
      const double cost = t != times_.end() ? t->second : t1->second * (1 + 0.1 * k);
      if (tokens / cost > best * 1.02) {  // a draft must beat a plain step by a margin to be worth its risk
        best = tokens / cost;
        best_k = k;
      }
    }
    return best_k;
  }
  void timed(int64_t width, double ms) {
    auto it = times_.find(width);
    if (it == times_.end()) times_[width] = ms;
    else it->second = 0.7 * it->second + 0.3 * ms;
  }
  void drafted(int64_t k, int64_t accepted) {
    const double w = std::min(0.5, 0.15 * static_cast<double>(k));
    rate_ = (1 - w) * rate_ + w * static_cast<double>(accepted) / static_cast<double>(k);
  }
  void plain_step() {
    if (rate_ < 0.5) rate_ += (0.5 - rate_) * 0.02;
  }

 private:
  int64_t k_max_;
  double rate_ = 0.6;
  std::map<int64_t, double> times_;
};

// A grammar the output must follow (--json-schema / --grammar): masks a row of logits in its current state (a copy
// it holds, valid until its next call), takes each token chosen, and says how much of a draft it accepts.
class Grammar {
 public:
  virtual ~Grammar() = default;
  virtual const float* masked(const float* logits) = 0;
  virtual void consume(int64_t token) = 0;
  virtual int64_t valid_prefix(const std::vector<int64_t>& draft) = 0;
};

// (drafted tokens kept, the token after them) from the verify rows: row i (vocab floats) scores draft[i]. With a
// grammar, row i is masked in its state after draft[0..i) and every token kept is given to it.
inline std::pair<int64_t, int64_t> accept_drafts(const float* rows, int64_t vocab, const std::vector<int64_t>& draft,
                                                 Sampler& sampler, Grammar* grammar = nullptr) {
  const int64_t k = static_cast<int64_t>(draft.size());
  auto row_at = [&](int64_t i) { return grammar ? grammar->masked(rows + i * vocab) : rows + i * vocab; };
  auto pick = [&](int64_t i, int64_t t) {
    if (grammar) grammar->consume(t);
    return std::pair<int64_t, int64_t>{i, t};
  };
  for (int64_t i = 0; i < k; ++i) {
    const float* row = row_at(i);
    if (sampler.greedy()) {
      const int64_t best = Sampler::argmax(row, vocab);
      if (best != draft[i]) return pick(i, best);
    } else {
      sampler.prepare(row, vocab);
      if (sampler.uniform() >= sampler.prob(draft[i]))
        return pick(i, sampler.draw_excluding(draft[i]));  // the residual max(0, p - q) of a draft that is d for sure
    }
    if (grammar) grammar->consume(draft[i]);
  }
  return pick(k, sampler.sample(row_at(k), vocab));
}

}  // namespace llmrt::speculate
