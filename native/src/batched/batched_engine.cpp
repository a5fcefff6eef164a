#include "batched/batched_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

namespace llmrt {

namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// A prefix-cache entry: a session cache frozen right after its prompt's prefill (with recurrent states: before its
// last token).
class CacheSnapshot final : public PrefixSnapshot {
 public:
  explicit CacheSnapshot(std::unique_ptr<SessionCache> cache)
      : cache_(std::move(cache)), point_(cache_->recurrent() ? cache_->length() : -1) {}
  bool can_restore(int64_t n, std::string* why) const override { return cache_->can_rewind(n, why); }
  int64_t resume_point() const override { return point_; }
  const SessionCache& cache() const { return *cache_; }

 private:
  std::unique_ptr<SessionCache> cache_;
  int64_t point_;
};

// Unbinds the batched step however the forward ends.
struct BatchBinding {
  explicit BatchBinding(const offgraph::BatchStep* step) {
    offgraph::set_last_error("");
    offgraph::bind_batch(step);
  }
  ~BatchBinding() { offgraph::bind_batch(nullptr); }
};

}  // namespace

const char* cache_kind_name(CacheKind k) {
  return k == CacheKind::cell ? "batched-cell" : "batched-sequence";
}

void EngineStats::add(const EngineStats& o) {
  wall_ms += o.wall_ms;
  decode_ms += o.decode_ms;
  capture_ms += o.capture_ms;
  forwards += o.forwards;
  rows += o.rows;
  max_rows = std::max(max_rows, o.max_rows);
  prefill_tokens += o.prefill_tokens;
  decode_tokens += o.decode_tokens;
  generated += o.generated;
  drafted += o.drafted;
  accepted += o.accepted;
  peak_sessions = std::max(peak_sessions, o.peak_sessions);
  peak_kv_bytes = std::max(peak_kv_bytes, o.peak_kv_bytes);
}

struct Engine::Session {
  Generation gen;
  std::unique_ptr<SessionCache> cache;
  Sampler sampler;
  int64_t fed = 0;        // prompt tokens in the cache
  int64_t pending = -1;   // sampled, not yet fed
  int64_t max_new;        // the request's budget, or the engine's
  bool spec;              // drafts for this session (the engine speculates and the request allows it)
  bool masked;            // each sample waits for a mask (set_mask)
  bool has_mask;
  std::vector<uint32_t> mask;
  size_t reported = 0;    // tokens handed to step()'s caller
  bool decoding = false;  // the prompt is in, decode steps from here
  bool done = false;
  uint64_t served = 0;    // clock of the last step that gave it logits
  Clock::time_point admitted, first_token, last_token;
  // speculation: the drafter over its context, its draft budget, this step's draft, the tokens to feed again after
  // a recurrent state's restore, and the snapshot taken before a verify step
  std::unique_ptr<speculate::NgramDrafter> drafter;
  std::unique_ptr<speculate::DraftBudget> budget;
  std::vector<int64_t> draft, replay;
  offgraph::OffgraphKvCache::Snapshot snap;

  Session(const Request& r, const EngineOptions& o)
      : sampler(r.opts.temperature.value_or(o.temperature), r.opts.top_p.value_or(o.top_p),
                r.opts.top_k.value_or(o.top_k), r.opts.seed.value_or(o.seed + static_cast<uint64_t>(r.prompt))),
        max_new(r.opts.max_new_tokens.value_or(o.max_new_tokens)),
        spec(o.speculate.on && r.opts.speculate && !r.opts.masked), masked(r.opts.masked),
        has_mask(!r.opts.mask.empty()), mask(r.opts.mask) {
    gen.req = r;
    gen.req.opts.mask.clear();
  }
  int64_t remaining() const { return static_cast<int64_t>(gen.req.ids.size()) - fed; }
};

Engine::Engine(LlmProgram& program, std::vector<offgraph::LayerSpec> specs, int64_t chunk, EngineOptions opts,
               std::unordered_set<int64_t> stops)
    : prog_(program), specs_(std::move(specs)), chunk_(chunk), o_(opts), stops_(std::move(stops)),
      full_(program.all_rows_logits()), prefix_(opts.prefix_cache_entries) {
  if (chunk_ < 1 || chunk_ > program.info().max_seq_len)
    throw std::invalid_argument("rows per forward must be in [1, " + std::to_string(program.info().max_seq_len) +
                                "], got " + std::to_string(chunk_));
  if (o_.max_decode_sequences < 1) throw std::invalid_argument("--max-decode-sequences must be >= 1");
  if (o_.speculate.on) {
    const std::string why = speculate::why_not(full_, logits_mode_name(program.info().logits_mode),
                                               o_.speculate.draft_max, chunk_);
    if (!why.empty()) throw std::invalid_argument(why);
  }
  if (o_.cache_kind == CacheKind::cell)
    pool_ = std::make_unique<CellPool>(specs_, o_.max_session_tokens, chunk_, o_.kv_initial_capacity, o_.kv_dtype,
                                       o_.states);
  else
    new_cache();  // checks the geometry now, not at the first admission
  prog_.set_position_limit(o_.max_session_tokens);
}

Engine::~Engine() {
  active_.clear();  // sessions and snapshots go before the pool
  prefix_.clear();
}

std::unique_ptr<SessionCache> Engine::new_cache() {
  if (pool_) return std::make_unique<CellCache>(*pool_);
  return std::make_unique<SequenceCache>(specs_, o_.max_session_tokens, chunk_, o_.kv_initial_capacity, o_.kv_dtype,
                                         o_.states);
}

std::string Engine::describe() const {
  // the layer line ends as the single runner's does (", S shared" when KV-shared layers read their source's cache),
  // then the recurrent state's line
  std::string tail = o_.shared_layers > 0 ? ", " + std::to_string(o_.shared_layers) + " shared" : "";
  if (!o_.states.empty()) tail += "\n" + offgraph::state_line(o_.states, true);
  if (pool_) return pool_->describe() + tail + "\n[cache] batched-cell: one pool of cells shared by every session";
  SequenceCache probe(specs_, o_.max_session_tokens, chunk_, o_.kv_initial_capacity, o_.kv_dtype, o_.states);
  return probe.cache().describe() + tail + "\n[cache] batched-sequence: one off-graph cache per session";
}

int64_t Engine::kv_bytes() const {
  int64_t b = pool_ ? pool_->bytes() : 0;  // a pooled session's own bytes are its recurrent states
  for (const auto& s : active_) b += s->cache->bytes();
  for (const auto& w : snapshots_)
    if (auto snap = w.lock()) b += static_cast<const CacheSnapshot&>(*snap).cache().bytes();
  return b;
}

std::unique_ptr<Engine::Session> Engine::admit(const Request& r) {
  auto s = std::make_unique<Session>(r, o_);
  s->admitted = Clock::now();
  s->served = clock_;
  const int64_t n = static_cast<int64_t>(r.ids.size());
  if (n == 0) {
    fail(*s, "the prompt is empty (no tokens)");
    return s;
  }
  if (n > o_.max_session_tokens) {
    fail(*s, "the prompt has " + std::to_string(n) + " tokens but a session holds " +
                 std::to_string(o_.max_session_tokens) + " (--max-session-tokens)");
    return s;
  }
  if (PrefixHit hit = prefix_.lookup(r.ids)) {
    s->cache = static_cast<const CacheSnapshot&>(*hit.snapshot).cache().clone();
    std::string why;
    if (!s->cache->rewind(hit.reused, &why)) throw std::logic_error("prefix cache: restore refused: " + why);
    s->fed = s->gen.cached_tokens = hit.reused;
    s->gen.prefix_refusals = std::move(hit.refusals);
  } else {
    s->gen.prefix_refusals = std::move(hit.refusals);
    s->cache = new_cache();
  }
  return s;
}

int64_t Engine::prefill_room(const Session& s) const {
  const int64_t n = static_cast<int64_t>(s.gen.req.ids.size());
  if (o_.states.empty() || !prefix_.enabled() || n < 2 || s.fed >= n - 1) return s.remaining();
  return n - 1 - s.fed;
}

std::vector<Engine::Piece> Engine::plan_step() {
  std::vector<Piece> step;
  std::vector<Session*> dec, pre;
  for (auto& s : active_) {
    if (s->done) continue;
    if (s->decoding && !waiting(*s)) dec.push_back(s.get());
    else if (!s->decoding) pre.push_back(s.get());
  }
  std::stable_sort(dec.begin(), dec.end(), [](const Session* a, const Session* b) { return a->served < b->served; });
  int64_t rows = chunk_;
  if (full_) {
    const int64_t keep = pre.empty() || chunk_ == 1 ? 0 : 1;  // a row for the waiting prompts
    const int64_t nd = std::min<int64_t>(static_cast<int64_t>(dec.size()), rows - keep);
    for (int64_t i = 0; i < nd; ++i) {
      Session* s = dec[i];
      const int64_t replay = static_cast<int64_t>(s->replay.size());
      if (replay > 0 && replay <= rows - keep) {  // a restored state's kept tokens, fed again before it decodes
        s->draft.clear();
        step.push_back({s, replay, false});
        rows -= replay;
      } else if (replay == 0 && rows > keep) {
        s->draft.clear();
        step.push_back({s, 1, true});
        rows -= 1;
      }
    }
    // the rows left go to drafts, least recently served session first
    for (Piece& p : step) {
      if (!p.s->spec || !p.logits || rows - keep <= 0) continue;
      p.s->draft = p.s->drafter->draft(std::min(draft_room(*p.s), rows - keep));
      p.n += static_cast<int64_t>(p.s->draft.size());
      rows -= static_cast<int64_t>(p.s->draft.size());
    }
    for (Session* s : pre) {
      if (rows == 0) break;
      const int64_t m = std::min({rows, prefill_room(*s), s->remaining() - (waiting(*s) ? 1 : 0)});
      if (m <= 0) continue;
      step.push_back({s, m, m == s->remaining()});
      rows -= m;
    }
    return step;
  }
  Session* last = dec.empty() ? nullptr : dec.front();
  for (Session* s : pre)
    if (s->remaining() <= chunk_ && prefill_room(*s) == s->remaining() && !waiting(*s) &&
        (last == nullptr || s->served < last->served))
      last = s;
  if (last) rows -= last->decoding ? 1 : last->remaining();
  for (Session* s : pre) {
    if (rows == 0) break;
    if (s == last) continue;
    const int64_t m = std::min({rows, s->remaining() - 1, prefill_room(*s)});  // this piece must not end its prompt
    if (m > 0) {
      step.push_back({s, m, false});
      rows -= m;
    }
  }
  if (last) step.push_back({last, last->decoding ? 1 : last->remaining(), true});
  return step;
}

void Engine::execute(std::vector<Piece>& step, EngineStats* st) {
  const auto t0 = Clock::now();
  // room in every cache first: the kernel never allocates (a pool's storage must not move mid-step)
  std::vector<Piece> ok;
  for (Piece& p : step) {
    std::string why;
    if (p.s->cache->reserve(p.s->cache->length(), p.n, &why)) ok.push_back(p);
    else fail(*p.s, "cannot reserve the step: " + why);
  }
  step.swap(ok);
  if (step.empty()) return;
  offgraph::BatchStep batch;
  tokens_.clear();
  positions_.clear();
  logit_rows_.clear();
  int64_t decode_rows = 0, decode_tokens = 0;
  for (const Piece& p : step) {
    Session& s = *p.s;
    const int64_t pos = s.cache->length();
    batch.groups.push_back({s.cache.get(), pos, p.n});
    for (int64_t i = 0; i < p.n; ++i) {
      int64_t t;
      if (!s.decoding) t = s.gen.req.ids[static_cast<size_t>(s.fed + i)];
      else if (!s.replay.empty()) t = s.replay[static_cast<size_t>(i)];
      else t = i == 0 ? s.pending : s.draft[static_cast<size_t>(i - 1)];
      tokens_.push_back(t);
      positions_.push_back(pos + i);
      if (p.logits && (i == p.n - 1 || (s.decoding && !s.draft.empty()))) logit_rows_.push_back(
          static_cast<int64_t>(tokens_.size()) - 1);
    }
    if (s.decoding) decode_rows += p.n;
    if (s.decoding && !s.draft.empty() && s.cache->recurrent()) {  // a verify step: the state it cannot rewind
      s.snap.length = pos;
      s.snap.states = *s.cache->recurrent();
    }
  }
  const int64_t n = static_cast<int64_t>(tokens_.size());
  const std::vector<float>* logits = nullptr;
  try {
    BatchBinding bind(&batch);
    logits = &prog_.forward_rows(tokens_.data(), positions_.data(), n, logit_rows_);
  } catch (const std::exception& e) {
    for (Piece& p : step) fail(*p.s, e.what());
    return;
  }
  const int64_t V = prog_.info().vocab_size;
  size_t li = 0;
  double capture_ms = 0;
  for (Piece& p : step) {
    Session& s = *p.s;
    const int64_t pos = s.cache->length();
    s.cache->commit(pos, p.n);
    const float* row = p.logits ? logits->data() + static_cast<int64_t>(li) * V : nullptr;
    if (p.logits) {
      s.served = clock_;
      li += s.decoding && !s.draft.empty() ? static_cast<size_t>(p.n) : 1;
    }
    if (s.decoding) {
      const size_t before = s.gen.generated.size();
      if (!s.replay.empty()) s.replay.clear();
      else if (s.spec) accept_verified(s, pos, p.n, row, st);
      else accept(s, sample(s, row));
      decode_tokens += static_cast<int64_t>(s.gen.generated.size() - before);
      continue;
    }
    s.fed += p.n;
    st->prefill_tokens += p.n;
    const int64_t n_prompt = static_cast<int64_t>(s.gen.req.ids.size());
    if (s.remaining() > 0) {
      if (!o_.states.empty() && prefix_.enabled() && s.fed == n_prompt - 1) capture(s, s.gen.req.ids, &capture_ms);
      continue;
    }
    // right after the prefill, before decode writes into any ring
    if (o_.states.empty() && prefix_.enabled()) capture(s, s.gen.req.ids, &capture_ms);
    s.decoding = true;
    if (s.spec) {
      s.drafter = std::make_unique<speculate::NgramDrafter>(o_.speculate.ngram_min, o_.speculate.ngram_max);
      s.drafter->extend(s.gen.req.ids);
      // the cost of a row in a shared forward, not a forward of its own: each draft token a tenth of a step
      s.budget = std::make_unique<speculate::DraftBudget>(o_.speculate.draft_max);
      s.budget->timed(1, 1.0);
    }
    if (s.max_new == 0) {
      s.gen.ttft_ms = ms_between(s.admitted, Clock::now());
      finish(s, "max_new_tokens");
      continue;
    }
    if (accept(s, sample(s, row)) && s.drafter) s.drafter->push(s.pending);
  }
  const double ms = ms_between(t0, Clock::now()) - capture_ms;
  ++clock_;
  ++st->forwards;
  st->rows += n;
  st->max_rows = std::max(st->max_rows, n);
  st->decode_tokens += decode_tokens;
  st->decode_ms += ms * static_cast<double>(decode_rows) / static_cast<double>(n);
  st->capture_ms += capture_ms;
}

void Engine::capture(Session& s, std::vector<int64_t> key, double* ms) {
  const auto t0 = Clock::now();
  auto snap = std::make_shared<const CacheSnapshot>(s.cache->clone());
  snapshots_.push_back(snap);
  prefix_.insert(std::move(key), std::move(snap));
  *ms += ms_between(t0, Clock::now());
}

bool Engine::accept(Session& s, int64_t token) {
  const auto now = Clock::now();
  if (s.gen.generated.empty()) {
    s.first_token = now;
    s.gen.ttft_ms = ms_between(s.admitted, now);
  }
  s.last_token = now;
  s.gen.generated.push_back(token);
  if (!s.gen.req.opts.ignore_stops && stops_.count(token)) {
    finish(s, "stop_token");
  } else if (static_cast<int64_t>(s.gen.generated.size()) >= s.max_new) {
    finish(s, "max_new_tokens");
  } else if (s.cache->length() >= s.cache->capacity()) {
    finish(s, "context_full");
  } else {
    s.pending = token;
    return true;
  }
  return false;
}

int64_t Engine::draft_room(const Session& s) const {
  // after the pending token: tokens left in the budget, and the cache's room with a position to spare (a stop on a
  // full cache is judged after the rollback, as in a plain step)
  const int64_t left = s.max_new - static_cast<int64_t>(s.gen.generated.size()) - 1;
  const int64_t room = s.cache->capacity() - s.cache->length() - 2;
  return std::max<int64_t>(0, std::min({s.budget->choose(), o_.speculate.draft_max, left, room}));
}

void Engine::accept_verified(Session& s, int64_t pos, int64_t n, const float* rows, EngineStats* st) {
  const int64_t V = prog_.info().vocab_size, k = static_cast<int64_t>(s.draft.size()), first = s.pending;
  auto [a, after] = speculate::accept_drafts(rows, V, s.draft, s.sampler);
  std::vector<int64_t> kept(s.draft.begin(), s.draft.begin() + a);
  kept.push_back(after);
  int64_t m = 0;
  bool going = true;
  for (int64_t t : kept) {
    ++m;
    if (!(going = accept(s, t))) break;
  }
  if (k > 0) {
    s.gen.spec.drafted += k;
    s.gen.spec.accepted += a;
    ++s.gen.spec.verify_steps;
    st->drafted += k;
    st->accepted += a;
    s.budget->drafted(k, a);
  } else {
    s.budget->plain_step();
  }
  if (!going) return;
  for (int64_t i = 0; i < m; ++i) s.drafter->push(kept[static_cast<size_t>(i)]);
  if (m == n) return;  // the cache holds [pending, d1..d_{m-1}]: rewind past the rest
  std::string why;
  if (s.cache->recurrent()) {  // the state before the step, then [pending, d1..d_{m-1}] again in a step of their own
    if (!s.cache->restore(s.snap, &why)) return fail(s, "speculation: " + why);
    s.replay.assign(1, first);
    s.replay.insert(s.replay.end(), s.draft.begin(), s.draft.begin() + (m - 1));
    return;
  }
  if (!s.cache->rewind(pos + m, &why)) fail(s, "speculation: " + why);
}

void Engine::finish(Session& s, const std::string& reason) {
  s.gen.stop_reason = reason;
  if (!s.gen.generated.empty()) s.gen.decode_ms = ms_between(s.first_token, s.last_token);
  s.done = true;
}

void Engine::fail(Session& s, const std::string& error) {
  s.gen.ok = false;
  s.gen.error = error;
  s.gen.stop_reason = "error";
  s.done = true;
}

bool Engine::waiting(const Session& s) const { return s.masked && !s.has_mask; }

bool Engine::steppable(const Session& s) const {
  return !s.done && (!waiting(s) || (!s.decoding && s.remaining() > 1));  // a waiting prompt's pieces but its last
}

int64_t Engine::sample(Session& s, const float* row) {
  const int64_t V = prog_.info().vocab_size;
  if (!s.masked) return s.sampler.sample(row, V);
  masked_row_.assign(row, row + V);
  for (int64_t t = 0; t < V; ++t)
    if (!((s.mask[static_cast<size_t>(t >> 5)] >> (t & 31)) & 1u)) masked_row_[static_cast<size_t>(t)] = -INFINITY;
  s.has_mask = false;
  return s.sampler.sample(masked_row_.data(), V);
}

void Engine::submit(Request r) { queue_.push_back({std::move(r), Clock::now()}); }

bool Engine::cancel(int64_t id) {
  for (auto& s : active_)
    if (s && s->gen.req.id == id && !s->done) {
      finish(*s, "cancelled");
      return true;
    }
  for (auto it = queue_.begin(); it != queue_.end(); ++it)
    if (it->req.id == id) {  // step() hands it back
      it->cancelled = true;
      return true;
    }
  return false;
}

bool Engine::set_mask(int64_t id, std::vector<uint32_t> bits) {
  const size_t words = static_cast<size_t>((prog_.info().vocab_size + 31) / 32);
  if (bits.size() != words) throw std::invalid_argument("a mask holds " + std::to_string(words) + " words, got " +
                                                        std::to_string(bits.size()));
  for (auto& s : active_)
    if (s && s->gen.req.id == id && s->masked) {
      s->mask = std::move(bits);
      s->has_mask = true;
      return true;
    }
  return false;
}

bool Engine::can_step() const {
  if (!queue_.empty() && static_cast<int64_t>(active_.size()) < o_.max_decode_sequences) return true;
  for (const auto& s : active_)
    if (s->done || steppable(*s)) return true;  // a session that is done is retired by the next step
  return false;
}

std::vector<Generation> Engine::step(EngineStats* st, std::vector<TokenEvent>* tokens) {
  std::vector<Generation> out;
  while (!queue_.empty() && static_cast<int64_t>(active_.size()) < o_.max_decode_sequences) {
    Queued q = std::move(queue_.front());
    queue_.pop_front();
    std::unique_ptr<Session> s = q.cancelled ? std::make_unique<Session>(q.req, o_) : admit(q.req);
    if (q.cancelled) finish(*s, "cancelled");
    s->gen.queued_ms = ms_between(q.at, Clock::now());
    if (s->done) out.push_back(std::move(s->gen));
    else active_.push_back(std::move(s));
  }
  st->peak_sessions = std::max<int64_t>(st->peak_sessions, static_cast<int64_t>(active_.size()));
  if (std::any_of(active_.begin(), active_.end(), [&](const auto& s) { return steppable(*s); })) {
    std::vector<Piece> plan = plan_step();
    if (plan.empty()) throw std::logic_error("the scheduler planned an empty step");
    execute(plan, st);
    st->peak_kv_bytes = std::max(st->peak_kv_bytes, kv_bytes());
  }
  for (auto& s : active_) {
    const auto& g = s->gen.generated;
    if (tokens && g.size() > s->reported)
      tokens->push_back({s->gen.req.id, std::vector<int64_t>(g.begin() + static_cast<std::ptrdiff_t>(s->reported),
                                                              g.end())});
    s->reported = g.size();
    if (!s->done) continue;
    const auto& ids = s->gen.req.ids;
    if (o_.capture_replies && prefix_.enabled() && o_.states.empty() && s->gen.ok && g.size() > 1 &&
        s->cache->length() == static_cast<int64_t>(ids.size() + g.size() - 1)) {
      std::vector<int64_t> key(ids);
      key.insert(key.end(), g.begin(), g.end() - 1);
      double ms = 0;
      capture(*s, std::move(key), &ms);
      st->capture_ms += ms;
    }
    st->generated += static_cast<int64_t>(g.size());
    out.push_back(std::move(s->gen));
    s.reset();
  }
  active_.erase(std::remove(active_.begin(), active_.end(), nullptr), active_.end());
  snapshots_.erase(std::remove_if(snapshots_.begin(), snapshots_.end(),
                                  [](const std::weak_ptr<const PrefixSnapshot>& w) { return w.expired(); }),
                   snapshots_.end());
  return out;
}

std::vector<Generation> Engine::run(const std::vector<Request>& requests, EngineStats* stats) {
  EngineStats st;
  const auto t0 = Clock::now();
  for (const Request& r : requests) submit(r);
  std::vector<Generation> out(requests.size());
  while (!idle()) {
    if (!can_step()) throw std::logic_error("run(): masked requests wait for masks nobody gives");
    for (Generation& g : step(&st, nullptr)) {
      const auto at = std::find_if(requests.begin(), requests.end(), [&](const Request& r) { return r.id == g.req.id; });
      out[static_cast<size_t>(at - requests.begin())] = std::move(g);
    }
  }
  st.wall_ms = ms_between(t0, Clock::now());
  if (stats) *stats = st;
  return out;
}

}  // namespace llmrt
