// sampler_test: the runner's greedy argmax (src/runtime/sampler.h, vectorized) against a plain loop with torch.argmax's
// rule (first maximum wins, NaNs skipped, 0 when all are NaN), on lengths around the vector widths and on gemma's
// vocabulary, with ties, NaNs, infinities and signed zeros. Exit 0 when every case agrees; prints ALL PASS.
// Run by tests/native/test_sampler.py.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "runtime/sampler.h"

namespace {

int64_t plain_argmax(const std::vector<float>& x) {
  int64_t best = 0;
  bool any = false;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) continue;
    if (!any || x[i] > x[best]) best = static_cast<int64_t>(i), any = true;
  }
  return best;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uni(-20.f, 20.f);
  const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 3.0f};
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 70; ++n) lengths.push_back(n);
  lengths.push_back(49152);
  lengths.push_back(262144);
  int cases = 0, failures = 0;
  for (int64_t n : lengths) {
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x(n);
      // trial 0-9: few distinct values (ties everywhere); 10-19: with specials; 20-29: all one special; rest random
      for (auto& v : x) v = trial < 10 ? std::floor(uni(rng) / 10.f) : uni(rng);
      if (trial >= 10 && trial < 20)
        for (int k = 0; k < 1 + trial % 5; ++k) x[rng() % n] = specials[rng() % 6];
      if (trial >= 20 && trial < 30)
        for (auto& v : x) v = specials[trial % 6];
      if (trial == 30) x[n - 1] = 100.f;  // the max in the scalar tail
      int64_t want = plain_argmax(x), got = llmrt::Sampler::argmax(x.data(), n);
      ++cases;
      if (got != want) {
        ++failures;
        std::printf("FAIL n=%lld trial=%d: got %lld, want %lld\n", static_cast<long long>(n), trial,
                    static_cast<long long>(got), static_cast<long long>(want));
      }
    }
  }
  std::printf("%d cases, %d failures\n", cases, failures);
  if (!failures) std::printf("ALL PASS\n");
  return failures ? 1 : 0;
}
