// llm_runner's command line: its Options, the --help text and the argv parser.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runner/cli_common.h"

namespace llmrt::runner {

// llm_runner's own flags; those both runners take are parsed by cli::CommonOptions.
struct Options : cli::CommonOptions {
  std::string prompt, prompt_ids;
  bool has_prompt = false, has_prompt_ids = false;
  bool warmup = false, interactive = false, encode = false;
  // off-graph KV cache (programs exported with cache.mode=offgraph)
  int64_t kv_max_capacity = 0;  // 0 = in-graph program
  // --json-schema FILE / --grammar FILE (GBNF or Lark): the output follows it (grammar_sidecar.h)
  std::string json_schema, grammar;
};

// --help; the defaults it shows are read from a default Options, so they cannot drift.
void print_help();

// Reads and checks every flag (cli::UsageError, exit 2); --help/-h sets *help and stops reading.
Options parse_args(int argc, char** argv, bool* help);

// The --prompt-ids value "1,2,3" as ids (cli::UsageError on an empty or non-integer entry).
std::vector<int64_t> parse_ids(const std::string& s);

}  // namespace llmrt::runner
