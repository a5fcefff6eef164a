// One turn of generation over a loaded program: prefill in chunks, then sample and decode until a
// stop token, the budget or a full cache; the text streams to stdout as it is decoded.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "runner/grammar_sidecar.h"
#include "runner/runner_options.h"
#include "runtime/kv_cache.h"
#include "runtime/llm_program.h"
#include "runtime/sampler.h"
#include "runtime/speculate.h"
#include "tokenizer/tokenizer.h"

namespace llmrt::runner {

struct TurnResult {
  std::vector<int64_t> prompt_ids, generated_ids;
  std::string text;
  std::string stop_reason;
  int64_t pending = -1;  // last generated token not yet fed to the program
  double prefill_ms = 0, ttft_ms = 0, decode_ms = 0, sampling_ms = 0;
  int64_t decode_steps = 0;
  double rss_prefill = 0, rss_decode = 0;
  bool speculated = false;          // decoded with --speculate ngram
  speculate::Stats spec;
  double plain_decode_tok_s = -1;   // --compare-plain: the same turn without speculation
  int identical = -1;               // its tokens equal this turn's (greedy): 1/0, -1 when sampling
  int64_t grammar_masks = 0;        // --json-schema / --grammar: masks asked of the sidecar, and their time
  bool grammar_complete = true;     // false: a limit came before the grammar's end (stop_reason "length")
  double grammar_mask_ms = 0;
};

// Holds the sampler across turns, so an interactive session keeps one random stream.
class Runner {
 public:
  Runner(const Options& o, LlmProgram& prog, KvCacheOwner& cache, const Tokenizer* tok, int64_t chunk)
      : o_(o), prog_(prog), cache_(cache), tok_(tok),
        sampler_(o.temperature, o.top_p, o.top_k, o.seed), chunk_(chunk) {}

  void add_stop(int64_t id) { stops_.insert(id); }
  const std::unordered_set<int64_t>& stops() const { return stops_; }

  // Feeds ids in chunks of max_seq_len; returns the last logits.
  const std::vector<float>& feed(const std::vector<int64_t>& ids);

  // One untimed prefill chunk and decode step, then an empty cache again.
  void warmup();

  // One turn: prefill `ids` (pending token first), then decode.
  TurnResult run(std::vector<int64_t> ids, int64_t pending);

  // Whether run() speculates (--speculate ngram); --compare-plain turns it off for its second run.
  void set_speculate(bool on) { speculate_ = on; }
  void set_quiet(bool on) { quiet_ = on; }
  // --json-schema / --grammar: every token is chosen under the grammar (null: none).
  void set_grammar(GrammarSidecar* g) { grammar_ = g; }

 private:
  // Decode after `next` with prompt-lookup drafts; `emit` takes a token and says whether the turn ends there.
  template <class Emit>
  void decode_speculative(const std::vector<int64_t>& context, int64_t next, Emit&& emit, TurnResult& r);
  // The next token from a row of logits: sampled, under the grammar if there is one.
  int64_t choose(const std::vector<float>& logits);
  // After a verify step fed `fed` at `pos`: the cache keeps fed[:m].
  void keep(int64_t pos, const std::vector<int64_t>& fed, int64_t m);

  const Options& o_;
  LlmProgram& prog_;
  KvCacheOwner& cache_;
  const Tokenizer* tok_;
  Sampler sampler_;
  std::unordered_set<int64_t> stops_;
  int64_t chunk_;
  bool speculate_ = o_.speculate.on, quiet_ = o_.quiet;
  std::vector<int64_t> positions_;
  GrammarSidecar* grammar_ = nullptr;
  bool grammar_used_ = false;
};

}  // namespace llmrt::runner
