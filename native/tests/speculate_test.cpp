// speculate_test: prompt-lookup speculation's parts in the runners (src/runtime/speculate.h), without a program: the
// n-gram drafter (longest and latest match, a period repeats), the draft budget (stops drafting when drafts fail,
// tries again later), and the acceptance rule, whose first token is distributed as the sampler's own distribution
// whatever the draft. Prints "ok <case>" or "FAIL <case>: <what>"; exit 1 if any case failed.
// Run by tests/native/test_speculate_native.py.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/speculate.h"

namespace {

using namespace llmrt;
using Ids = std::vector<int64_t>;
int g_failed = 0;

void check(const char* name, bool ok, const std::string& what = "") {
  if (ok) std::printf("ok %s\n", name);
  else std::printf("FAIL %s: %s\n", name, what.c_str()), ++g_failed;
}

std::string str(const Ids& v) {
  std::string s;
  for (int64_t t : v) s += std::to_string(t) + " ";
  return s;
}

void drafter() {
  speculate::NgramDrafter d(2, 3);
  d.extend({1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2});
  Ids a = d.draft(3);
  check("the latest continuation of the longest match", a == Ids{4, 5, 7}, str(a));
  d.push(3);
  Ids b = d.draft(2);
  check("a trigram match", b == Ids{9, 1}, str(b));
  speculate::NgramDrafter p(2, 2);
  p.extend({5, 6, 5, 6});
  Ids c = p.draft(5);
  check("a match near the end repeats as a period", c == Ids{5, 6, 5, 6, 5}, str(c));
  check("no match, no draft", speculate::NgramDrafter(2, 4).draft(3).empty() && p.draft(0).empty());
}

void budget() {
  speculate::DraftBudget b(6);
  bool first = b.choose() == 6;
  for (int k = 1; k <= 7; ++k) b.timed(k, 10.0 * (1 + 0.1 * (k - 1)));
  for (int i = 0; i < 10; ++i) b.drafted(4, 4);
  bool high = b.choose() >= 4;
  for (int i = 0; i < 20; ++i) b.drafted(std::max<int64_t>(b.choose(), 1), 0);
  bool off = b.choose() == 0;
  for (int i = 0; i < 200; ++i) b.plain_step();
  check("the budget drafts while drafts pay, stops when they fail, tries again", first && high && off &&
        b.choose() > 0);
}

// The first token of a verify step over rows [2][V] with a two-token draft, n times: its distribution against the
// sampler's (prepare + prob), as a total variation distance.
double first_token_tv(double temperature, double top_p, int64_t top_k, const Ids& draft) {
  const int64_t V = 12;
  std::mt19937 g(3);
  std::normal_distribution<float> nd(0.f, 2.f);
  std::vector<float> rows(3 * V);
  for (float& x : rows) x = nd(g);
  Sampler s(temperature, top_p, top_k, 11);
  std::vector<double> want(V), got(V, 0.0);
  s.prepare(rows.data(), V);
  for (int64_t t = 0; t < V; ++t) want[t] = s.prob(t);
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    auto [a, after] = speculate::accept_drafts(rows.data(), V, draft, s);
    got[a > 0 ? draft[0] : after] += 1.0 / n;
  }
  double tv = 0;
  for (int64_t t = 0; t < V; ++t) tv += 0.5 * std::fabs(got[t] - want[t]);
  return tv;
}

void sampling_rule() {
  const struct { double temperature, top_p; int64_t top_k; } cases[] = {{1.0, 1.0, 0}, {0.7, 1.0, 4}, {1.0, 0.8, 0}};
  for (const auto& c : cases)
    for (const Ids& draft : {Ids{0, 1}, Ids{5, 5}, Ids{11, 2}}) {
      double tv = first_token_tv(c.temperature, c.top_p, c.top_k, draft);
      check(("the acceptance rule keeps the distribution (T " + std::to_string(c.temperature) + ", top-p " +
             std::to_string(c.top_p) + ", top-k " + std::to_string(c.top_k) + ", draft " + str(draft) + ")").c_str(),
            tv < 0.012, "total variation " + std::to_string(tv));
    }
  // greedy: kept while it is the argmax, then the argmax
  const int64_t V = 4;
  std::vector<float> rows = {0, 3, 1, 0, /**/ 2, 0, 0, 1, /**/ 0, 0, 5, 0};
  Sampler greedy(0.0, 1.0, 0, 1);
  auto [a, after] = speculate::accept_drafts(rows.data(), V, {1, 3}, greedy);
  auto [a2, after2] = speculate::accept_drafts(rows.data(), V, {1, 0}, greedy);
  check("greedy keeps the argmax prefix", a == 1 && after == 0 && a2 == 2 && after2 == 2,
        std::to_string(a) + " " + std::to_string(after) + " " + std::to_string(a2) + " " + std::to_string(after2));
}

}  // namespace

int main() {
  drafter();
  budget();
  sampling_rule();
  return g_failed ? 1 : 0;
}
