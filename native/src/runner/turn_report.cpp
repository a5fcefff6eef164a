#include "runner/turn_report.h"

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "kernels/isa.h"
#include "platform/sysmem.h"

namespace llmrt::runner {

using json = nlohmann::json;

json stats_json(const Options& o, const ProgramInfo& info, const LoadInfo& li, const TurnResult& r,
                const KvCacheOwner& cache, int turn) {
  auto rate = [](double n, double ms) { return ms > 0 ? n * 1000.0 / ms : 0.0; };
  json j;
  j["pte"] = o.pte;
  j["chat"] = o.chat;
  j["turn"] = turn;
  j["prompt_tokens"] = r.prompt_ids.size();
  j["generated_tokens"] = r.generated_ids.size();
  j["prompt_ids"] = r.prompt_ids;
  j["generated_ids"] = r.generated_ids;
  j["text"] = r.text;
  j["stop_reason"] = r.stop_reason;
  j["load_ms"] = li.load_ms;
  j["tokenizer_load_ms"] = li.tokenizer_ms;
  j["ttft_ms"] = r.ttft_ms;
  j["prefill_ms"] = r.prefill_ms;
  j["prefill_tok_s"] = rate(static_cast<double>(r.prompt_ids.size()), r.prefill_ms);
  j["decode_ms"] = r.decode_ms;
  j["decode_steps"] = r.decode_steps;
  j["decode_tok_s"] = rate(static_cast<double>(r.decode_steps), r.decode_ms);
  j["sampling_ms"] = r.sampling_ms;
  j["rss_after_load_mib"] = li.rss_load;
  j["rss_after_prefill_mib"] = r.rss_prefill;
  j["rss_after_decode_mib"] = r.rss_decode;
  j["peak_rss_mib"] = peak_rss_mib();
  j["cache_kind"] = cache.kind();
  j["cache_length"] = cache.length();
  j["cache_capacity"] = cache.capacity();
  j["cache_bytes"] = cache.bytes();
  j["cache_report"] = cache.describe();
  j["threads"] = li.threads;
  j["huge_pages_mib"] = static_cast<double>(li.huge.bytes) / (1 << 20);
  j["max_context_len"] = info.max_context_len;
  j["max_seq_len"] = info.max_seq_len;
  j["vocab_size"] = info.vocab_size;
  j["logits_mode"] = logits_mode_name(info.logits_mode);
  j["logits_dtype"] = info.logits_dtype;
  j["isa"] = isa::active_name();
  j["recipe_hash"] = info.has_recipe_hash ? json(info.recipe_hash) : json(nullptr);
  if (r.grammar_masks > 0)
    j["grammar"] = {{"masks", r.grammar_masks}, {"mask_ms_per_token", r.grammar_mask_ms / r.grammar_masks},
                    {"complete", r.grammar_complete}};
  if (r.speculated) {
    json s;
    s["drafted"] = r.spec.drafted;
    s["accepted"] = r.spec.accepted;
    s["verify_steps"] = r.spec.verify_steps;
    s["acceptance"] = r.spec.drafted ? json(static_cast<double>(r.spec.accepted) / r.spec.drafted) : json(nullptr);
    if (r.plain_decode_tok_s >= 0) {
      const double now = rate(static_cast<double>(r.decode_steps), r.decode_ms);
      s["plain_decode_tok_s"] = r.plain_decode_tok_s;
      s["speedup"] = r.plain_decode_tok_s > 0 ? json(now / r.plain_decode_tok_s) : json(nullptr);
      s["identical"] = r.identical < 0 ? json(nullptr) : json(r.identical == 1);
    }
    j["speculation"] = s;
  }
  return j;
}

void report(const Options& o, const ProgramInfo& info, const LoadInfo& li, const TurnResult& r,
            const KvCacheOwner& cache, int turn) {
  json j = stats_json(o, info, li, r, cache, turn);
  std::fprintf(stderr,
               "[memory] rss after load %.1f MiB | after prefill %.1f MiB | after decode %.1f MiB | "
               "peak %.1f MiB\n",
               li.rss_load, r.rss_prefill, r.rss_decode, j["peak_rss_mib"].get<double>());
  std::fprintf(stderr, "[cache] fill %lld/%lld", static_cast<long long>(cache.length()),
               static_cast<long long>(cache.capacity()));
  if (cache.bytes() >= 0) std::fprintf(stderr, " | K/V storage %.1f KiB", cache.bytes() / 1024.0);
  std::fprintf(stderr, "\n");
  std::fprintf(stderr,
               "[stats] prompt %zu tok | generated %zu tok (%s) | load %.1f ms (tokenizer %.1f ms) | "
               "ttft %.1f ms | prefill %.1f tok/s | decode %.1f tok/s | sampling %.2f ms\n",
               r.prompt_ids.size(), r.generated_ids.size(), r.stop_reason.c_str(), li.load_ms,
               li.tokenizer_ms, r.ttft_ms, j["prefill_tok_s"].get<double>(),
               j["decode_tok_s"].get<double>(), r.sampling_ms);
  if (j.contains("grammar"))
    std::fprintf(stderr, "[grammar] %lld masks from the sidecar, %.3f ms per token\n",
                 static_cast<long long>(r.grammar_masks), j["grammar"]["mask_ms_per_token"].get<double>());
  if (!r.grammar_complete)
    std::fprintf(stderr, "[grammar] warning: the output is incomplete: the %s came before the grammar's end, so it "
                 "may not parse (raise --max-new-tokens, or give the schema fewer or shorter fields)\n",
                 r.stop_reason == "length" ? "token limit (--max-new-tokens)" : "context's end");
  if (j.contains("speculation")) {
    const json& s = j["speculation"];
    std::fprintf(stderr, "[speculate] drafted %lld, accepted %lld in %lld verify steps",
                 static_cast<long long>(r.spec.drafted), static_cast<long long>(r.spec.accepted),
                 static_cast<long long>(r.spec.verify_steps));
    if (s.contains("speedup") && !s["speedup"].is_null())
      std::fprintf(stderr, " | %.2fx the plain run's %.1f tok/s%s", s["speedup"].get<double>(),
                   r.plain_decode_tok_s, r.identical < 0 ? "" : r.identical ? ", tokens identical" : ", tokens DIFFER");
    std::fprintf(stderr, "\n");
  }
  std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace);
  std::fprintf(stderr, "STATS_JSON: %s\n", line.c_str());
  if (!o.stats_json.empty()) {
    std::ofstream f(o.stats_json, turn == 0 ? std::ios::trunc : std::ios::app);
    if (!f) throw std::runtime_error("cannot write --stats-json file '" + o.stats_json + "'");
    f << line << "\n";
  }
}

}  // namespace llmrt::runner
