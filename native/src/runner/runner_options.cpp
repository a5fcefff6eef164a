#include "runner/runner_options.h"

#include <cstdio>
#include <sstream>
#include <stdexcept>

#include "kernels/offgraph_cache.h"

namespace llmrt::runner {

using cli::parse_int;
using cli::UsageError;

void print_help() {
  Options d;
  std::printf(
      "llm_runner: run an ExecuTorch LLM program (.pte) exported by the pipeline.\n"
      "\n"
      "usage: llm_runner --pte FILE --tokenizer tokenizer.json --prompt TEXT [options]\n"
      "       llm_runner --pte FILE --prompt-ids 1,2,3 [--tokenizer tokenizer.json] [options]\n"
      "       llm_runner --tokenizer tokenizer.json --prompt TEXT --chat NAME --encode\n"
      "       llm_runner --pte FILE --tokenizer tokenizer.json --chat NAME --interactive\n"
      "\n"
      "  --pte PATH            program to run (required unless --encode)\n"
      "  --data PATH           a data file the program reads its weights from (an adapter program's\n"
      "                        foundation.ptd); default: the files it names, beside the .pte\n"
      "  --tokenizer PATH      HF tokenizer.json (required unless --prompt-ids)\n"
      "  --prompt TEXT         user prompt (the chat template is applied)\n"
      "  --prompt-ids LIST     comma-separated token ids, used as they are (no template, no BOS)\n"
      "%s"
      "  --max-new-tokens N    generation budget per turn (default: %lld)\n"
      "  --temperature T       0 = greedy argmax (default: %g)\n"
      "  --top-p P             nucleus sampling, 1 = off (default: %g)\n"
      "  --top-k K             top-k sampling, 0 = off (default: %lld)\n"
      "  --seed S              sampling seed (default: %llu)\n"
      "  --warmup              run one untimed prefill chunk + decode step first (default: off)\n"
      "  --json-schema FILE    the output is JSON valid against this schema (llguidance, in a\n"
      "                        Python sidecar: python -m pipeline constrain_sidecar; the Python\n"
      "                        is $LLMPIPE_PYTHON or python3) (default: none)\n"
      "  --grammar FILE        the output parses by this grammar, GBNF (with ::=) or Lark, as\n"
      "                        --json-schema (default: none)\n"
      "  --ignore-eos          generate the whole budget, stop tokens included (benchmarks)\n"
      "                        (default: off)\n"
      "  --interactive         multi-turn chat on stdin; commands: /reset, /undo [N], /quit\n"
      "                        (default: off)\n"
      "  --stats-json PATH     write the stats as one JSON line per turn (default: none)\n"
      "  --encode              print the prompt's ids (after the template) and exit; --pte is\n"
      "                        optional (used for its BOS id with --chat 0) (default: off)\n"
      "  --threads N           XNNPACK/ExecuTorch thread-pool size, 0 = runtime default\n"
      "                        (default: %lld)\n"
      "  --quiet               do not stream the text to stdout (default: off)\n"
      "  --huge-pages on|off   back the weights XNNPACK packs and the KV cache with 2 MiB pages\n"
      "                        after the load (Linux >= 6.1): faster decode (default: on)\n"
      "  --kv-max-capacity N   off-graph KV cache of N positions, for programs exported with\n"
      "                        cache.mode=offgraph; 0 = the program keeps its cache (in-graph)\n"
      "                        (default: %lld)\n"
      "  --kv-initial-capacity N  positions first allocated per flat layer; doubles on demand\n"
      "                        up to --kv-max-capacity; -1 = the default (clamped to the\n"
      "                        capacity) (default: %lld)\n"
      "  --kv-storage-dtype T  fp32 | fp16 | bf16 | int8 | int4 (default: the program's activation dtype)\n"
      "  --kv-windows LIST     comma list of windows repeated over the caches, 0 = flat\n"
      "                        (full attention), e.g. 512,0; the prefill chunk stays as exported\n"
      "                        (default: the program's get_windows)\n"
      "%s"
      "%s"
      "  --help                this text\n"
      "\n"
      "Every flag also takes underscores, as the reference spells them: --max_new_tokens,\n"
      "--kv_max_capacity, --kv_initial_capacity, ...\n"
      "\n"
      "Output: the generated text streams to stdout; the report goes to stderr and ends with\n"
      "a line 'STATS_JSON: {...}' (prompt_ids, generated_ids incl. a final stop token, text,\n"
      "timings, memory). Exit code 0 on success, 1 on errors, 2 on bad usage.\n",
      cli::chat_help(24).c_str(), static_cast<long long>(d.max_new_tokens), d.temperature, d.top_p,
      static_cast<long long>(d.top_k), static_cast<unsigned long long>(d.seed),
      static_cast<long long>(d.threads), static_cast<long long>(d.kv_max_capacity),
      static_cast<long long>(d.kv_initial_capacity), cli::speculate_help(24).c_str(),
      cli::verify_pte_help(24).c_str());
}

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  std::string cur;
  std::stringstream ss(s);
  while (std::getline(ss, cur, ',')) {
    size_t a = cur.find_first_not_of(" \t"), b = cur.find_last_not_of(" \t");
    if (a == std::string::npos) throw UsageError("--prompt-ids has an empty entry: '" + s + "'");
    ids.push_back(parse_int("--prompt-ids", cur.substr(a, b - a + 1)));
  }
  if (ids.empty()) throw UsageError("--prompt-ids is empty");
  return ids;
}

Options parse_args(int argc, char** argv, bool* help) {
  Options o;
  *help = false;
  cli::ArgReader args(argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--help" || a == "-h") {
      *help = true;
      return o;
    }
    if (o.parse(args)) {
      // a bad dtype is refused where it stands, before the flags after it are read
      if (a == "--kv-storage-dtype") o.check_kv_storage_dtype();
      continue;
    }
    if (a == "--prompt") {
      o.prompt = args.value();
      o.has_prompt = true;
    } else if (a == "--prompt-ids") {
      o.prompt_ids = args.value();
      o.has_prompt_ids = true;
    } else if (a == "--kv-max-capacity") o.kv_max_capacity = parse_int(a, args.value());
    else if (a == "--json-schema") o.json_schema = args.value();
    else if (a == "--grammar") o.grammar = args.value();
    else if (a == "--warmup") { args.no_value(); o.warmup = true; }
    else if (a == "--interactive") { args.no_value(); o.interactive = true; }
    else if (a == "--encode") { args.no_value(); o.encode = true; }
    else throw UsageError("unknown argument '" + a + "' (see --help)");
  }
  o.check_max_new_tokens();
  o.check_sampling();
  o.check_threads();
  o.check_speculate();
  if (o.kv_max_capacity < 0) throw UsageError("--kv-max-capacity must be >= 0 (0 = in-graph program)");
  o.check_kv_initial_capacity();
  if (o.kv_flags && o.kv_max_capacity == 0)
    throw UsageError("--kv-initial-capacity, --kv-storage-dtype and --kv-windows need --kv-max-capacity");
  if (o.has_prompt && o.has_prompt_ids) throw UsageError("give --prompt or --prompt-ids, not both");
  if (!o.json_schema.empty() && !o.grammar.empty()) throw UsageError("give --json-schema or --grammar, not both");
  if ((!o.json_schema.empty() || !o.grammar.empty()) && o.tokenizer.empty())
    throw UsageError("--json-schema and --grammar need --tokenizer (the grammar is read over its vocabulary)");
  if (o.encode) {
    if (o.tokenizer.empty()) throw UsageError("--encode needs --tokenizer");
    if (!o.has_prompt) throw UsageError("--encode needs --prompt");
    return o;
  }
  if (o.pte.empty()) throw UsageError("--pte is required (see --help)");
  if (o.tokenizer.empty() && !o.has_prompt_ids)
    throw UsageError("--tokenizer is required unless --prompt-ids is given");
  if (o.interactive && (o.has_prompt || o.has_prompt_ids))
    throw UsageError("--interactive reads the prompts from stdin; drop --prompt/--prompt-ids");
  if (o.interactive && o.tokenizer.empty()) throw UsageError("--interactive needs --tokenizer");
  if (!o.interactive && !o.has_prompt && !o.has_prompt_ids)
    throw UsageError("give --prompt, --prompt-ids or --interactive");
  return o;
}

}  // namespace llmrt::runner
