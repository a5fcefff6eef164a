#include "runner/turn_runner.h"

#include <algorithm>
#include <cstdio>

#include "platform/sysmem.h"
#include "tokenizer/utf8.h"

namespace llmrt::runner {

using cli::Clock;
using cli::ms_since;

const std::vector<float>& Runner::feed(const std::vector<int64_t>& ids) {
  const int64_t chunk = chunk_;
  // no tokens means no logits to sample from; callers refuse an empty turn before this
  if (ids.empty()) throw ProgramError("a turn with no tokens to feed");
  const std::vector<float>* logits = nullptr;
  for (size_t i = 0; i < ids.size(); i += chunk) {
    int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(ids.size() - i));
    int64_t pos = cache_.length();
    std::string why;
    if (!cache_.bind(pos, n, &why)) throw ProgramError(why);
    logits = &prog_.forward(ids.data() + i, n, pos);
    cache_.commit(pos, n);
  }
  return *logits;
}

void Runner::warmup() {
  int64_t n = std::min<int64_t>(chunk_, cache_.capacity() - 1);
  std::vector<int64_t> ids(std::max<int64_t>(n, 1), prog_.info().bos_id);
  feed(ids);
  if (cache_.length() < cache_.capacity()) feed({prog_.info().bos_id});
  cache_.reset();
}

TurnResult Runner::run(std::vector<int64_t> ids, int64_t pending) {
  TurnResult r;
  if (pending >= 0) ids.insert(ids.begin(), pending);
  if (grammar_ && grammar_used_) grammar_->reset();  // each turn's output follows the grammar from its start
  grammar_used_ = grammar_ != nullptr;
  const int64_t masks0 = grammar_ ? grammar_->masks : 0;
  const double mask_ms0 = grammar_ ? grammar_->mask_ms : 0;
  r.prompt_ids = ids;
  const int64_t ctx = cache_.capacity();
  auto t0 = Clock::now();
  const std::vector<float>& first_logits = feed(ids);
  r.prefill_ms = ms_since(t0);
  r.rss_prefill = rss_mib();
  if (o_.max_new_tokens == 0) {
    r.stop_reason = "max_new_tokens";
    r.ttft_ms = r.prefill_ms;
    r.rss_decode = rss_mib();
    return r;
  }
  auto ts = Clock::now();
  int64_t next = choose(first_logits);
  r.sampling_ms += ms_since(ts);
  r.ttft_ms = ms_since(t0);
  auto td = Clock::now();
  Utf8Stream stream;
  bool first_piece = true;
  auto emit = [&](int64_t t) {  // true: the turn ends with t
    r.generated_ids.push_back(t);
    if (stops_.count(t)) {
      r.stop_reason = "stop_token";
      return true;
    }
    if (tok_) {
      std::string piece = stream.push(tok_->decode_token(static_cast<int32_t>(t), first_piece));
      first_piece = false;
      r.text += piece;
      if (!quiet_ && !piece.empty()) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
    }
    if (static_cast<int64_t>(r.generated_ids.size()) >= o_.max_new_tokens) {
      r.stop_reason = "max_new_tokens";
      r.pending = t;
      return true;
    }
    if (grammar_ && grammar_->done()) {  // the output is complete (its end-of-text token was taken)
      r.stop_reason = "grammar";
      r.pending = t;
      return true;
    }
    return false;
  };
  if (speculate_) {
    decode_speculative(ids, next, emit, r);
  } else if (!emit(next)) {
    for (;;) {
      if (cache_.length() >= ctx) {
        r.stop_reason = "context_full";
        r.pending = next;
        break;
      }
      const std::vector<float>& logits = feed({next});
      ++r.decode_steps;
      ts = Clock::now();
      next = choose(logits);
      r.sampling_ms += ms_since(ts);
      if (emit(next)) break;
    }
  }
  std::string tail = stream.finish();
  r.text += tail;
  if (!quiet_) {
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  r.decode_ms = ms_since(td);
  r.rss_decode = rss_mib();
  if (grammar_) {
    r.grammar_masks = grammar_->masks - masks0, r.grammar_mask_ms = grammar_->mask_ms - mask_ms0;
    // a token or context limit before the grammar's end: the output may not parse, and the report says so
    if ((r.stop_reason == "max_new_tokens" || r.stop_reason == "context_full") && !grammar_->complete()) {
      r.grammar_complete = false;
      if (r.stop_reason == "max_new_tokens") r.stop_reason = "length";
    }
  }
  return r;
}

template <class Emit>
void Runner::decode_speculative(const std::vector<int64_t>& context, int64_t next, Emit&& emit, TurnResult& r) {
  const int64_t V = prog_.info().vocab_size, ctx = cache_.capacity();
  const speculate::Options& so = o_.speculate;
  speculate::NgramDrafter drafter(so.ngram_min, so.ngram_max);
  speculate::DraftBudget budget(std::min({so.draft_max, chunk_ - 1, prog_.verify_rows() - 1}));
  drafter.extend(context);
  drafter.push(next);
  r.speculated = true;
  if (emit(next)) return;
  std::vector<int64_t> fed, rows;
  for (;;) {
    if (cache_.length() >= ctx) {
      r.stop_reason = "context_full";
      r.pending = next;
      return;
    }
    const int64_t room = std::min<int64_t>(o_.max_new_tokens - static_cast<int64_t>(r.generated_ids.size()) - 1,
                                           ctx - cache_.length() - 1);
    const int64_t k = std::max<int64_t>(0, std::min(budget.choose(), room));
    std::vector<int64_t> draft = drafter.draft(k);
    if (grammar_ && !draft.empty()) draft.resize(static_cast<size_t>(grammar_->valid_prefix(draft)));
    auto t = Clock::now();
    if (draft.empty()) {
      const std::vector<float>& logits = feed({next});
      next = choose(logits);
      budget.timed(1, ms_since(t));
      budget.plain_step();
      ++r.decode_steps;
      drafter.push(next);
      if (emit(next)) return;
      continue;
    }
    fed.assign(1, next);
    fed.insert(fed.end(), draft.begin(), draft.end());
    const int64_t pos = cache_.length(), n = static_cast<int64_t>(fed.size());
    positions_.resize(n);
    rows.resize(n);
    for (int64_t i = 0; i < n; ++i) positions_[i] = pos + i, rows[i] = i;
    if (cache_.recurrent()) cache_.snapshot();
    std::string why;
    if (!cache_.bind(pos, n, &why)) throw ProgramError(why);
    const std::vector<float>& logits = prog_.forward_rows(fed.data(), positions_.data(), n, rows);
    cache_.commit(pos, n);
    auto [a, after] = speculate::accept_drafts(logits.data(), V, draft, sampler_, grammar_);
    std::vector<int64_t> kept(draft.begin(), draft.begin() + a);
    kept.push_back(after);
    int64_t m = 0;
    bool done = false;
    for (int64_t tok : kept) {
      ++m;
      if ((done = emit(tok))) break;
    }
    keep(pos, fed, m);
    budget.timed(n, ms_since(t));
    budget.drafted(static_cast<int64_t>(draft.size()), a);
    r.spec.drafted += static_cast<int64_t>(draft.size());
    r.spec.accepted += a;
    ++r.spec.verify_steps;
    r.decode_steps += m;
    for (int64_t i = 0; i < m; ++i) drafter.push(kept[i]);
    next = kept[m - 1];
    if (done) return;
  }
}

int64_t Runner::choose(const std::vector<float>& logits) {
  const int64_t V = prog_.info().vocab_size;
  if (!grammar_) return sampler_.sample(logits.data(), V);
  const int64_t t = sampler_.sample(grammar_->masked(logits.data()), V);
  grammar_->consume(t);
  return t;
}

void Runner::keep(int64_t pos, const std::vector<int64_t>& fed, int64_t m) {
  if (m == static_cast<int64_t>(fed.size())) return;
  std::string why;
  if (cache_.recurrent()) {  // the state cannot step back: restore it, then feed the kept tokens again
    if (!cache_.restore(&why)) throw ProgramError(why);
    feed(std::vector<int64_t>(fed.begin(), fed.begin() + m));
    return;
  }
  if (!cache_.rewind(pos + m, &why)) throw ProgramError(why);
}

}  // namespace llmrt::runner
