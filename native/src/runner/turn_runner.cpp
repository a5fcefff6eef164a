#include "runner/turn_runner.h"

#include <algorithm>
#include <cstdio>

#include "runtime/sysmem.h"
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
  r.prompt_ids = ids;
  const int64_t V = prog_.info().vocab_size;
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
  int64_t next = sampler_.sample(first_logits.data(), V);
  r.sampling_ms += ms_since(ts);
  r.ttft_ms = ms_since(t0);
  auto td = Clock::now();
  Utf8Stream stream;
  bool first_piece = true;
  for (;;) {
    r.generated_ids.push_back(next);
    if (stops_.count(next)) {
      r.stop_reason = "stop_token";
      break;
    }
    if (tok_) {
      std::string piece = stream.push(tok_->decode_token(static_cast<int32_t>(next), first_piece));
      first_piece = false;
      r.text += piece;
      if (!o_.quiet && !piece.empty()) {
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
    }
    if (static_cast<int64_t>(r.generated_ids.size()) >= o_.max_new_tokens) {
      r.stop_reason = "max_new_tokens";
      r.pending = next;
      break;
    }
    if (cache_.length() >= ctx) {
      r.stop_reason = "context_full";
      r.pending = next;
      break;
    }
    const std::vector<float>& logits = feed({next});
    ++r.decode_steps;
    ts = Clock::now();
    next = sampler_.sample(logits.data(), V);
    r.sampling_ms += ms_since(ts);
  }
  std::string tail = stream.finish();
  r.text += tail;
  if (!o_.quiet) {
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  r.decode_ms = ms_since(td);
  r.rss_decode = rss_mib();
  return r;
}

}  // namespace llmrt::runner
