// Greedy / temperature + top-k + top-p sampling over float logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace llmrt {

class Sampler {
 public:
  Sampler(double temperature, double top_p, int64_t top_k, uint64_t seed)
      : temperature_(temperature), top_p_(top_p), top_k_(top_k), rng_(seed) {}

  bool greedy() const { return temperature_ <= 0.0; }

  int64_t sample(const float* logits, int64_t n) {
    if (greedy()) return argmax(logits, n);
    // Candidates: top-k (all when k <= 0), in descending logit order.
    int64_t k = (top_k_ > 0 && top_k_ < n) ? top_k_ : n;
    if (top_p_ < 1.0 && k == n) {
      // Grow a sorted prefix until it covers top_p of the mass: avoids sorting
      // the whole vocabulary for every token.
      float mx = logits[argmax(logits, n)];
      double total = 0;
      for (int64_t i = 0; i < n; ++i) total += expw(logits[i], mx);
      for (int64_t m = std::min<int64_t>(64, n);; m = std::min<int64_t>(m * 4, n)) {
        top_indices(logits, n, m);
        double mass = 0;
        for (int64_t i = 0; i < m; ++i) mass += expw(logits[idx_[i]], mx);
        if (mass / total >= top_p_ || m == n) {
          k = m;
          break;
        }
      }
    } else {
      top_indices(logits, n, k);
    }
    float mx = logits[idx_[0]];
    probs_.resize(k);
    double sum = 0;
    for (int64_t i = 0; i < k; ++i) sum += (probs_[i] = expw(logits[idx_[i]], mx));
    int64_t keep = k;
    if (top_p_ < 1.0) {
      double c = 0;
      for (int64_t i = 0; i < k; ++i) {
        c += probs_[i] / sum;
        if (c >= top_p_) {
          keep = i + 1;
          break;
        }
      }
    }
    double kept = 0;
    for (int64_t i = 0; i < keep; ++i) kept += probs_[i];
    double r = std::uniform_real_distribution<double>(0.0, kept)(rng_);
    for (int64_t i = 0; i < keep; ++i) {
      r -= probs_[i];
      if (r < 0) return idx_[i];
    }
    return idx_[keep - 1];
  }

  static int64_t argmax(const float* x, int64_t n) {
    int64_t best = 0;
    float bv = -INFINITY;
    bool any = false;
    for (int64_t i = 0; i < n; ++i) {
      float v = x[i];
      if (std::isnan(v)) continue;
      if (!any || v > bv) {  // first maximum wins, like torch.argmax
        bv = v;
        best = i;
        any = true;
      }
    }
    return best;
  }

 private:
  double expw(float l, float mx) const {
    if (std::isnan(l)) return 0.0;
    return std::exp((static_cast<double>(l) - mx) / temperature_);
  }
  void top_indices(const float* x, int64_t n, int64_t m) {
    idx_.resize(n);
    std::iota(idx_.begin(), idx_.end(), 0);
    auto cmp = [x](int64_t a, int64_t b) {
      float va = std::isnan(x[a]) ? -INFINITY : x[a], vb = std::isnan(x[b]) ? -INFINITY : x[b];
      return va > vb || (va == vb && a < b);
    };
    if (m < n) {
      std::nth_element(idx_.begin(), idx_.begin() + m, idx_.end(), cmp);
    }
    std::sort(idx_.begin(), idx_.begin() + m, cmp);
  }

  double temperature_, top_p_;
  int64_t top_k_;
  std::mt19937_64 rng_;
  std::vector<int64_t> idx_;
  std::vector<double> probs_;
};

}  // namespace llmrt
