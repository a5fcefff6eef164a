// The batched runner's engine: independent sessions over one loaded off-graph program.
//
// Each session owns a SessionCache (session_cache.h / cell_pool.h) and its own seeded sampler.
// Requests are admitted in order while fewer than max_decode_sequences sessions are active; an
// admitted prompt first asks the prefix cache (prefix_cache.h) for a snapshot to resume from.
//
// Scheduler (decode first). Every engine step is ONE forward of at most `chunk` rows, made of row
// groups of different sessions (bound to the kernel as an offgraph::BatchStep, so each group writes
// to and attends over its own cache; the positions input carries each row's own position):
//   - logits mode `full` (the program returns every row) or `selected` (it returns the rows asked: one per
//     decoding session and per prompt that ends in the step): one row for each decoding session, least
//     recently served first (at most chunk - 1 while a prompt is waiting, so prefill always moves),
//     then prompt pieces of the prefilling sessions in admission order fill the rows left; each
//     decode row and each piece that ends its prompt gets its logits row.
//   - `last` (only the last row has logits): one logits group per forward, placed last: the least
//     recently served of the decoding sessions and the prompts that can end in this step (decoders
//     win ties); prompt pieces that do not end their prompt ride along before it. Decode tokens are
//     then one per forward, but prefill shares the decode forwards.
// Speculation (--speculate ngram, `full` or `selected` programs): a decoding session's row group is its pending token
// and a draft from its own context (speculate.h), every row with logits; the session keeps what the acceptance rule
// keeps and rewinds its cache past the rest. A recurrent state is snapshot before the step and restored, and the kept
// tokens are fed again as a step of their own (no logits: the next token is already known).
// A prompt's snapshot is captured right after the step that ends its prefill, before any decode. With recurrent
// layers (a hybrid program), whose state holds one position only, it is captured one token earlier: the prompt's
// last token gets a step of its own, so that the same prompt again, or one that extends it, resumes from the
// snapshot and replays that token.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "batched/cell_pool.h"
#include "batched/prefix_cache.h"
#include "batched/session_cache.h"
#include "runtime/llm_program.h"
#include "runtime/sampler.h"
#include "runtime/speculate.h"

namespace llmrt {

enum class CacheKind { sequence, cell };
const char* cache_kind_name(CacheKind k);  // "batched-sequence" / "batched-cell"

struct EngineOptions {
  CacheKind cache_kind = CacheKind::sequence;
  int64_t max_session_tokens = 0;    // KV positions per session
  int64_t max_decode_sequences = 4;  // sessions active at once
  int64_t max_new_tokens = 50;
  int64_t kv_initial_capacity = 512;
  int kv_dtype = kv::kFloat;
  double temperature = 0.0, top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 42;  // session of prompt p samples with seed + p
  size_t prefix_cache_entries = 0;
  // A finished session's cache (prompt and reply, the last token unfed) is kept too, so that a conversation's next
  // turn, which resends both, prefills only what follows them (the server's; attention-only programs)
  bool capture_replies = false;
  int64_t shared_layers = 0;  // KV-shared layers (get_n_shared_layers): they read their source's cache
  std::vector<offgraph::StateSpec> states;  // recurrent layers (get_state_shapes): one state per session
  speculate::Options speculate;             // --speculate ngram: each decoding session's rows carry its draft
};

// What one request may set for itself (the server's); unset fields take the engine's options.
struct RequestOptions {
  std::optional<int64_t> max_new_tokens;
  std::optional<double> temperature, top_p;
  std::optional<int64_t> top_k;
  std::optional<uint64_t> seed;
  bool speculate = true;  // false: no drafts for this request even when the engine speculates
  bool ignore_stops = false;  // generate the whole budget (benchmarks)
  // Each sample waits for its allowed-token mask (set_mask): a grammar outside the engine. Such a session is left out
  // of a step until its mask is in, and never speculates.
  bool masked = false;
  std::vector<uint32_t> mask;  // masked: its first sample's mask (set_mask gives the next ones)
};

struct Request {
  int64_t id = 0;  // generation number
  int round = 0, prompt = 0;
  std::vector<int64_t> ids;
  RequestOptions opts;
};

struct Generation {
  Request req;
  bool ok = true;
  std::string error;
  int64_t cached_tokens = 0;       // prompt tokens resumed from a prefix-cache snapshot
  std::vector<std::string> prefix_refusals;
  std::vector<int64_t> generated;  // a final stop token included
  std::string stop_reason;
  speculate::Stats spec;           // --speculate ngram
  double queued_ms = 0, ttft_ms = 0, decode_ms = 0;  // decode: first token -> last token
  double decode_ms_per_token() const {
    return generated.size() > 1 ? decode_ms / static_cast<double>(generated.size() - 1) : 0.0;
  }
};

// Tokens a session took in one step (several with speculation), in order.
struct TokenEvent {
  int64_t id;
  std::vector<int64_t> tokens;
};

struct EngineStats {
  double wall_ms = 0, decode_ms = 0, capture_ms = 0;  // decode: forward time shared out by rows
  int64_t forwards = 0, rows = 0, max_rows = 0, prefill_tokens = 0, decode_tokens = 0, generated = 0;
  int64_t drafted = 0, accepted = 0;  // --speculate ngram
  int64_t peak_sessions = 0, peak_kv_bytes = 0;
  double decode_tok_s() const { return decode_ms > 0 ? decode_tokens * 1000.0 / decode_ms : 0.0; }
  void add(const EngineStats& o);
};

class Engine {
 public:
  // chunk: rows per forward (<= the program's max_seq_len; a ring holds window + chunk - 1 slots).
  Engine(LlmProgram& program, std::vector<offgraph::LayerSpec> specs, int64_t chunk, EngineOptions opts,
         std::unordered_set<int64_t> stops);
  ~Engine();

  // Runs the requests to the end; the generations come back in request order.
  std::vector<Generation> run(const std::vector<Request>& requests, EngineStats* stats);

  // The incremental interface (llm_batched_runner --serve): requests join the queue at any time and are admitted
  // between steps, in order, while fewer than max_decode_sequences are active.
  void submit(Request r);
  // A queued or active request ends with stop reason "cancelled" at the next step; false if unknown.
  bool cancel(int64_t id);
  // The allowed tokens of a masked request's next sample: vocab bits, little-endian words. False if unknown.
  bool set_mask(int64_t id, std::vector<uint32_t> bits);
  // A step can run now: some request is queued, or some active session is not waiting for its mask.
  bool can_step() const;
  bool idle() const { return queue_.empty() && active_.empty(); }
  int64_t queued() const { return static_cast<int64_t>(queue_.size()); }
  int64_t active() const { return static_cast<int64_t>(active_.size()); }
  // Admits what fits, runs one forward (when a session can take one), and returns the requests that ended;
  // `tokens` gets each session's new tokens, before its end.
  std::vector<Generation> step(EngineStats* stats, std::vector<TokenEvent>* tokens);

  const PrefixCache& prefix_cache() const { return prefix_; }
  // Decode rows of several sessions share a forward (logits mode `full` or `selected`).
  bool full_logits() const { return full_; }
  int64_t chunk() const { return chunk_; }
  // The cache report ("[cache] ..." lines).
  std::string describe() const;

 private:
  struct Session;
  struct Piece {
    Session* s;
    int64_t n;    // rows
    bool logits;  // needs the logits of its last row (a speculating session: of every row)
  };

  std::unique_ptr<SessionCache> new_cache();
  std::unique_ptr<Session> admit(const Request& r);
  std::vector<Piece> plan_step();
  // Prompt tokens s may still take before its prefix snapshot (recurrent states: all but the last), or all.
  int64_t prefill_room(const Session& s) const;
  void capture(Session& s, std::vector<int64_t> key, double* ms);
  void execute(std::vector<Piece>& step, EngineStats* stats);
  // Takes the token sampled for s; false once the session is done.
  bool accept(Session& s, int64_t token);
  // A speculating session's verify rows (1 + its draft): the tokens kept, the cache rolled back past the rest.
  void accept_verified(Session& s, int64_t pos, int64_t n, const float* rows, EngineStats* st);
  // Draft tokens s may take this step: its budget, its tokens left, its cache room.
  int64_t draft_room(const Session& s) const;
  void finish(Session& s, const std::string& reason);
  void fail(Session& s, const std::string& error);
  int64_t kv_bytes() const;
  bool waiting(const Session& s) const;  // a masked session whose next sample has no mask yet
  bool steppable(const Session& s) const;  // it can take rows in the next forward
  int64_t sample(Session& s, const float* row);

  LlmProgram& prog_;
  std::vector<offgraph::LayerSpec> specs_;
  int64_t chunk_;
  EngineOptions o_;
  std::unordered_set<int64_t> stops_;
  bool full_;
  std::unique_ptr<CellPool> pool_;  // before every cache that uses it (destroyed after them)
  PrefixCache prefix_;
  std::vector<std::weak_ptr<const PrefixSnapshot>> snapshots_;
  std::vector<std::unique_ptr<Session>> active_;
  struct Queued {
    Request req;
    std::chrono::steady_clock::time_point at;
    bool cancelled = false;
  };
  std::deque<Queued> queue_;
  std::vector<float> masked_row_;
  uint64_t clock_ = 0;  // steps run, for fairness
  std::vector<int64_t> tokens_, positions_, logit_rows_;
};

}  // namespace llmrt
