// What llm_runner reports after each turn: the stats JSON (the STATS_JSON line and --stats-json)
// and the human lines before it, all on stderr.
#pragma once

#include <nlohmann/json.hpp>

#include "runner/runner_options.h"
#include "runner/turn_runner.h"
#include "platform/huge_pages.h"
#include "runtime/kv_cache.h"
#include "runtime/llm_program.h"

namespace llmrt::runner {

// Measured once at load, repeated in every turn's stats.
struct LoadInfo {
  double load_ms = 0, tokenizer_ms = 0, rss_load = 0;
  int threads = 0;
  HugePages huge;  // what --huge-pages put on 2 MiB pages
};

// The stats of one turn; the field names are read by the Python side and the tests.
nlohmann::json stats_json(const Options& o, const ProgramInfo& info, const LoadInfo& li, const TurnResult& r,
                          const KvCacheOwner& cache, int turn);

// Prints the [memory], [cache], [stats] and STATS_JSON lines; with --stats-json also writes the JSON
// line to that file (turn 0 truncates it, later turns append).
void report(const Options& o, const ProgramInfo& info, const LoadInfo& li, const TurnResult& r,
            const KvCacheOwner& cache, int turn);

}  // namespace llmrt::runner
