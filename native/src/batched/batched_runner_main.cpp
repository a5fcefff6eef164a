// llm_batched_runner: several independent sessions over one loaded off-graph program, with an
// opt-in prefix cache (offgraph-cache.md §4). Run with --help for the flags and their defaults.
//
//   llm_batched_runner --pte og.pte --tokenizer tokenizer.json --chat gemma --prefix-cache-entries 2
//       --prompt-rounds 2 "What is the capital of France?" "Name a prime."
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "batched/batched_engine.h"
#include "batched/serve_loop.h"
#include "runner/cli_common.h"
#include "runtime/chat_template.h"
#include "platform/huge_pages.h"
#include "runtime/llm_program.h"
#include "platform/sysmem.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

using json = nlohmann::json;
using namespace llmrt;
using namespace llmrt::cli;  // Clock, ms_since, parse_int, UsageError

// llm_batched_runner's own flags and prompts; cli::CommonOptions parses the shared flags.
struct Options : cli::CommonOptions {
  std::string out_prefix;
  std::vector<std::string> prompts;
  bool ids = false, serve = false;
  int64_t max_session_tokens = 0, max_decode_sequences = 4;
  std::string cache_kind = "batched-sequence";
  int64_t prefix_cache_entries = 0, prompt_rounds = 1;
};

void print_help() {
  Options d;
  std::printf(
      "llm_batched_runner: serve several prompts as independent sessions over one off-graph\n"
      "program (cache.mode=offgraph), decode steps of the sessions sharing forwards, with an\n"
      "opt-in prefix cache.\n"
      "\n"
      "usage: llm_batched_runner --pte FILE --tokenizer tokenizer.json [options] PROMPT [PROMPT...]\n"
      "       llm_batched_runner --pte FILE --ids [options] 1,2,3 4,5,6\n"
      "\n"
      "  --pte PATH                  off-graph program to run (required)\n"
      "  --data PATH                 a data file the program reads its weights from (an adapter\n"
      "                              program's foundation.ptd); default: the files it names, beside it\n"
      "  --tokenizer PATH            HF tokenizer.json (required unless --ids)\n"
      "  --ids                       the prompts are comma-separated token ids, used as they are\n"
      "                              (no template, no BOS) (default: off)\n"
      "%s"
      "  --max-new-tokens N          generation budget per session (default: %lld)\n"
      "  --max-session-tokens N      KV positions per session, at most the program's max context;\n"
      "                              0 = the program's max context (default: %lld)\n"
      "  --max-decode-sequences N    sessions active at once (default: %lld)\n"
      "  --cache-kind K              batched-sequence (one off-graph cache per session) |\n"
      "                              batched-cell (one pool of cells shared by the sessions)\n"
      "                              (default: %s)\n"
      "  --kv-initial-capacity N     positions first allocated per flat layer (per session, or\n"
      "                              cells of the pool); doubles on demand; -1 = the default\n"
      "                              (clamped to the session) (default: %lld)\n"
      "  --kv-storage-dtype T        fp32 | fp16 | bf16 | int8 | int4 (default: the program's activation dtype)\n"
      "  --kv-windows LIST           comma list of windows repeated over the caches, 0 = flat\n"
      "                              (full attention), e.g. 512,0; the rows per forward stay the\n"
      "                              exported chunk (default: the program's get_windows)\n"
      "  --temperature T             0 = greedy argmax (default: %g)\n"
      "  --top-p P                   nucleus sampling, 1 = off (default: %g)\n"
      "  --top-k K                   top-k sampling, 0 = off (default: %lld)\n"
      "  --seed S                    the session of prompt p samples with seed S + p (default: %lld)\n"
      "  --prefix-cache-entries N    snapshots kept by the prefix cache, 0 = off (default: %lld)\n"
      "  --prompt-rounds N           run the prompts N times on fresh sessions, keeping the prefix\n"
      "                              cache (default: %lld)\n"
      "  --serve                     no prompts: take requests as JSON lines on stdin and answer\n"
      "                              with events on stdout (python -m pipeline.serve runs it;\n"
      "                              src/batched/serve_loop.h) (default: off)\n"
      "  --out-prefix P              write each generation's text to P_<n>.txt, n = round x prompts\n"
      "                              + prompt (default: none)\n"
      "  --stats-json PATH           write the reports as JSON lines (default: none)\n"
      "  --ignore-eos                generate the whole budget (benchmarks) (default: off)\n"
      "  --threads N                 XNNPACK/ExecuTorch thread-pool size, 0 = runtime default\n"
      "                              (default: %lld)\n"
      "  --quiet                     do not print the texts to stdout (default: off)\n"
      "  --huge-pages on|off         back the weights XNNPACK packs and the KV cache with 2 MiB\n"
      "                              pages after the load (Linux >= 6.1): faster decode (default: on)\n"
      "%s"
      "%s"
      "  --help                      this text\n"
      "\n"
      "Every flag also takes underscores, as the reference spells them: --max_new_tokens,\n"
      "--cache_kind, --max_session_tokens, --prefix_cache_entries, --prompt_rounds, ...\n"
      "\n"
      "Output: each generation's text goes to stdout; the reports go to stderr: one line per\n"
      "generation ('GEN_JSON: {...}': prompt / cached / generated tokens, time to first token,\n"
      "decode ms/token), the round-to-round parity of the outputs, and the engine ('ENGINE_JSON:\n"
      "{...}': wall time, forwards, decode tok/s over all sessions, peak sessions). Exit code 0\n"
      "when every generation succeeded, 1 on errors or a failed generation, 2 on bad usage.\n",
      cli::chat_help(30).c_str(), static_cast<long long>(d.max_new_tokens), static_cast<long long>(d.max_session_tokens),
      static_cast<long long>(d.max_decode_sequences), d.cache_kind.c_str(),
      static_cast<long long>(d.kv_initial_capacity), d.temperature, d.top_p, static_cast<long long>(d.top_k),
      static_cast<long long>(d.seed), static_cast<long long>(d.prefix_cache_entries),
      static_cast<long long>(d.prompt_rounds), static_cast<long long>(d.threads),
      cli::speculate_help(30).c_str(), cli::verify_pte_help(30).c_str());
}

Options parse_args(int argc, char** argv, bool* help) {
  Options o;
  *help = false;
  bool flags_done = false;
  cli::ArgReader args(argc, argv);
  while (args.next()) {
    if (flags_done || args.arg().rfind("--", 0) != 0) {
      o.prompts.push_back(args.arg());
      continue;
    }
    if (args.arg() == "--") {
      flags_done = true;
      continue;
    }
    const std::string& a = args.name();
    if (a == "--help") {
      *help = true;
      return o;
    }
    if (o.parse(args)) continue;
    if (a == "--max-session-tokens") o.max_session_tokens = parse_int(a, args.value());
    else if (a == "--max-decode-sequences") o.max_decode_sequences = parse_int(a, args.value());
    else if (a == "--cache-kind") o.cache_kind = args.value();
    else if (a == "--prefix-cache-entries") o.prefix_cache_entries = parse_int(a, args.value());
    else if (a == "--prompt-rounds") o.prompt_rounds = parse_int(a, args.value());
    else if (a == "--out-prefix") o.out_prefix = args.value();
    else if (a == "--ids") { args.no_value(); o.ids = true; }
    else if (a == "--serve") { args.no_value(); o.serve = true; }
    else throw UsageError("unknown argument '" + a + "' (see --help)");
  }
  if (o.pte.empty()) throw UsageError("--pte is required (see --help)");
  if (o.serve && !o.prompts.empty()) throw UsageError("--serve takes its requests on stdin, not as arguments");
  if (o.prompts.empty() && !o.serve) throw UsageError("give at least one prompt (positional arguments)");
  if (!o.ids && !o.serve && o.tokenizer.empty()) throw UsageError("--tokenizer is required unless --ids is given");
  if (o.cache_kind != "batched-sequence" && o.cache_kind != "batched-cell")
    throw UsageError("--cache-kind expects batched-sequence or batched-cell, got '" + o.cache_kind + "'");
  if (!o.kv_storage_dtype.empty()) o.check_kv_storage_dtype();  // empty: the program's dtype
  o.check_max_new_tokens();
  if (o.max_session_tokens < 0)
    throw UsageError("--max-session-tokens must be >= 0 (0 = the program's max context)");
  if (o.max_decode_sequences < 1) throw UsageError("--max-decode-sequences must be >= 1");
  o.check_kv_initial_capacity();
  o.check_sampling();
  if (o.prefix_cache_entries < 0) throw UsageError("--prefix-cache-entries must be >= 0 (0 = off)");
  if (o.prompt_rounds < 1) throw UsageError("--prompt-rounds must be >= 1");
  o.check_threads();
  o.check_speculate();
  if (o.compare_plain) throw UsageError("--compare-plain is llm_runner's (run the batch again without --speculate)");
  if (!o.chat.empty()) try {
    chat_template(o.chat);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--chat: ") + e.what());
  }
  return o;
}

std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  std::stringstream ss(s);
  std::string cur;
  while (std::getline(ss, cur, ',')) {
    size_t a = cur.find_first_not_of(" \t"), b = cur.find_last_not_of(" \t");
    if (a == std::string::npos) throw UsageError("--ids: prompt '" + s + "' has an empty entry");
    ids.push_back(parse_int("--ids", cur.substr(a, b - a + 1)));
  }
  return ids;
}

std::string decode_text(const Tokenizer* tok, const std::vector<int64_t>& ids,
                        const std::unordered_set<int64_t>& stops) {
  std::string text;
  if (!tok) {
    for (int64_t id : ids) text += (text.empty() ? "" : " ") + std::to_string(id);
    return text;
  }
  Utf8Stream stream;
  bool first = true;
  for (int64_t id : ids) {
    if (stops.count(id)) break;
    text += stream.push(tok->decode_token(static_cast<int32_t>(id), first));
    first = false;
  }
  return text + stream.finish();
}

json gen_json(const Generation& g, const std::string& text) {
  const size_t n = g.generated.size();
  json j;
  j["generation"] = g.req.id;
  j["round"] = g.req.round;
  j["prompt"] = g.req.prompt;
  j["status"] = g.ok ? "ok" : "error";
  if (!g.ok) j["error"] = g.error;
  j["prompt_tokens"] = g.req.ids.size();
  j["cached_tokens"] = g.cached_tokens;
  j["generated_tokens"] = n;
  j["prompt_ids"] = g.req.ids;
  j["generated_ids"] = g.generated;
  j["text"] = text;
  j["stop_reason"] = g.stop_reason;
  j["queued_ms"] = g.queued_ms;
  j["ttft_ms"] = g.ttft_ms;
  j["decode_ms"] = g.decode_ms;
  j["decode_ms_per_token"] = g.decode_ms_per_token();
  j["prefix_refusals"] = g.prefix_refusals;
  if (g.spec.verify_steps > 0 || g.spec.drafted > 0)
    j["speculation"] = {{"drafted", g.spec.drafted}, {"accepted", g.spec.accepted},
                        {"verify_steps", g.spec.verify_steps}};
  return j;
}

json engine_json(const EngineStats& s) {
  json j;
  j["wall_ms"] = s.wall_ms;
  j["forwards"] = s.forwards;
  j["rows"] = s.rows;
  j["max_rows"] = s.max_rows;
  j["rows_per_forward"] = s.forwards ? static_cast<double>(s.rows) / s.forwards : 0.0;
  j["prefill_tokens"] = s.prefill_tokens;
  j["decode_tokens"] = s.decode_tokens;
  j["decode_ms"] = s.decode_ms;
  j["decode_tok_s"] = s.decode_tok_s();
  j["generated_tokens"] = s.generated;
  j["peak_sessions"] = s.peak_sessions;
  j["kv_bytes_peak"] = s.peak_kv_bytes;
  j["snapshot_ms"] = s.capture_ms;
  j["drafted"] = s.drafted;
  j["accepted"] = s.accepted;
  return j;
}

// Every prompt's generations across rounds against round 0 (greedy: they must be equal).
json parity_json(const std::vector<Generation>& gens, int64_t n_prompts, int64_t rounds) {
  json out = json::array();
  for (int64_t p = 0; p < n_prompts; ++p) {
    const Generation& ref = gens[static_cast<size_t>(p)];
    json e;
    e["prompt"] = p;
    bool same = true;
    json diffs = json::array();
    for (int64_t r = 1; r < rounds; ++r) {
      const Generation& g = gens[static_cast<size_t>(r * n_prompts + p)];
      if (g.generated == ref.generated) continue;
      same = false;
      const auto mis = std::mismatch(g.generated.begin(), g.generated.end(), ref.generated.begin(), ref.generated.end());
      diffs.push_back({{"round", r}, {"first_difference", mis.first - g.generated.begin()}});
    }
    e["identical"] = same;
    e["differences"] = diffs;
    out.push_back(e);
  }
  return out;
}

void emit(std::ofstream* f, const char* tag, const json& j) {
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace);
  std::fprintf(stderr, "%s: %s\n", tag, line.c_str());
  if (f) *f << line << "\n";
}

// What the engine is asked for, from the options and the program (its recurrent states: one per session)
EngineOptions engine_options(const Options& o, LlmProgram& prog, int64_t max_session, int64_t shared_layers) {
  EngineOptions eo;
  eo.cache_kind = o.cache_kind == "batched-cell" ? CacheKind::cell : CacheKind::sequence;
  eo.max_session_tokens = max_session;
  eo.max_decode_sequences = o.max_decode_sequences;
  eo.max_new_tokens = o.max_new_tokens;
  eo.kv_initial_capacity = o.kv_initial();
  eo.kv_dtype = o.kv_dtype(prog.info().activation_dtype);
  eo.temperature = o.temperature;
  eo.top_p = o.top_p;
  eo.top_k = o.top_k;
  eo.seed = o.seed;
  eo.prefix_cache_entries = static_cast<size_t>(o.prefix_cache_entries);
  eo.shared_layers = shared_layers;
  eo.speculate = o.speculate;
  if (prog.has_method("get_state_shapes")) {
    const std::vector<int64_t> dims = prog.read_int_list("get_state_shapes");
    eo.states = offgraph::state_specs(dims.data(), dims.size());
  }
  return eo;
}

// The program's EOS ids and the chat template's turn end (none with --ignore-eos)
std::unordered_set<int64_t> stop_ids(const Options& o, const ProgramInfo& info, const ChatTemplate& tpl,
                                     const Tokenizer* tok) {
  std::unordered_set<int64_t> stops;
  if (o.ignore_eos) return stops;
  stops.insert(info.eos_ids.begin(), info.eos_ids.end());
  if (!tpl.raw && tok) {
    int32_t te = tok->token_to_id(tpl.turn_end);
    if (te >= 0) stops.insert(te);
  }
  return stops;
}

// What the run was set up with, for its header and its ENGINE_JSON record
struct Setup {
  double load_ms = 0;
  int threads = 0;
  int64_t max_session = 0;
  HugePages huge;
};

void print_setup(const Options& o, const ProgramInfo& info, const Engine& engine, const Setup& su) {
  std::fprintf(stderr, "[program] %s | context %lld | chunk %lld | vocab %lld | logits %s | load %.1f ms | threads %d\n",
               o.pte.c_str(), static_cast<long long>(info.max_context_len), static_cast<long long>(info.max_seq_len),
               static_cast<long long>(info.vocab_size), logits_mode_name(info.logits_mode), su.load_ms, su.threads);
  std::fprintf(stderr, "%s\n", engine.describe().c_str());
  std::fprintf(stderr, "%s\n", describe(su.huge, o.huge_pages).c_str());
  std::fprintf(stderr,
               "[scheduler] decode-first | %lld rows per forward | %s (logits '%s') | max %lld sessions, %lld tokens each | "
               "prefix cache %lld entries\n",
               static_cast<long long>(info.max_seq_len),
               engine.full_logits() ? "decode rows of several sessions share a forward" : "one decode row per forward, prompt pieces ride along",
               logits_mode_name(info.logits_mode),
               static_cast<long long>(o.max_decode_sequences), static_cast<long long>(su.max_session),
               static_cast<long long>(o.prefix_cache_entries));
}

// A generation's text on stdout (unless --quiet), its [gen] line and GEN_JSON, its --out-prefix file
void print_generation(const Options& o, const Generation& gen, const std::string& text, std::ofstream* stats_file) {
  if (!o.quiet)
    std::printf("--- generation %lld (round %d, prompt %d) ---\n%s\n", static_cast<long long>(gen.req.id),
                gen.req.round, gen.req.prompt, text.c_str());
  std::fflush(stdout);
  std::fprintf(stderr,
               "[gen %lld] round %d prompt %d | prompt %zu tok | cached %lld | generated %zu tok (%s) | "
               "ttft %.1f ms | decode %.2f ms/tok%s%s\n",
               static_cast<long long>(gen.req.id), gen.req.round, gen.req.prompt, gen.req.ids.size(),
               static_cast<long long>(gen.cached_tokens), gen.generated.size(), gen.stop_reason.c_str(),
               gen.ttft_ms, gen.decode_ms_per_token(), gen.ok ? "" : " | error: ", gen.error.c_str());
  for (const std::string& why : gen.prefix_refusals)
    std::fprintf(stderr, "[prefix] gen %lld refused a snapshot: %s\n", static_cast<long long>(gen.req.id),
                 why.c_str());
  emit(stats_file, "GEN_JSON", gen_json(gen, text));
  if (!o.out_prefix.empty()) {
    const std::string path = o.out_prefix + "_" + std::to_string(gen.req.id) + ".txt";
    std::ofstream f(path, std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write --out-prefix file '" + path + "'");
    f << text;
  }
}

void print_parity(const json& parity, int64_t rounds) {
  for (const json& e : parity) {
    if (e["identical"].get<bool>()) {
      std::fprintf(stderr, "[parity] prompt %lld: %lld rounds, identical outputs\n",
                   static_cast<long long>(e["prompt"].get<int64_t>()), static_cast<long long>(rounds));
      continue;
    }
    for (const json& d : e["differences"])
      std::fprintf(stderr, "[parity] prompt %lld: MISMATCH, round %lld differs from round 0 at token %lld\n",
                   static_cast<long long>(e["prompt"].get<int64_t>()),
                   static_cast<long long>(d["round"].get<int64_t>()),
                   static_cast<long long>(d["first_difference"].get<int64_t>()));
  }
}

void print_totals(const Engine& engine, const EngineStats& total) {
  const PrefixStats& ps = engine.prefix_cache().stats();
  std::fprintf(stderr,
               "[prefix] %s | lookups %lld | hits %lld | misses %lld | refusals %lld | inserts %lld | evictions %lld\n",
               engine.prefix_cache().enabled() ? "on" : "off", static_cast<long long>(ps.lookups),
               static_cast<long long>(ps.hits), static_cast<long long>(ps.misses), static_cast<long long>(ps.refusals),
               static_cast<long long>(ps.inserts), static_cast<long long>(ps.evictions));
  std::fprintf(stderr,
               "[engine] wall %.1f ms | %lld forwards (%.2f rows avg, %lld max) | prefill %lld tok | decode %lld tok, "
               "%.1f tok/s over all sessions | peak sessions %lld | K/V peak %.1f KiB | peak rss %.1f MiB\n",
               total.wall_ms, static_cast<long long>(total.forwards),
               total.forwards ? static_cast<double>(total.rows) / total.forwards : 0.0,
               static_cast<long long>(total.max_rows), static_cast<long long>(total.prefill_tokens),
               static_cast<long long>(total.decode_tokens), total.decode_tok_s(),
               static_cast<long long>(total.peak_sessions), total.peak_kv_bytes / 1024.0, peak_rss_mib());
}

int64_t failed(const std::vector<Generation>& all) {
  int64_t n = 0;
  for (const Generation& gen : all) n += !gen.ok;
  return n;
}

// The ENGINE_JSON line: the totals, the setup, the rounds, parity and the prefix cache's counts
json engine_record(const Options& o, const ProgramInfo& info, const Engine& engine, const EngineStats& total,
                   const Setup& su, const json& rounds, const json& parity, const std::vector<Generation>& all) {
  const PrefixStats& ps = engine.prefix_cache().stats();
  json e = engine_json(total);
  e["pte"] = o.pte;
  e["cache_kind"] = o.cache_kind;
  e["cache_report"] = engine.describe();
  e["logits_mode"] = logits_mode_name(info.logits_mode);
  e["isa"] = isa::active_name();
  e["shared_decode_forwards"] = engine.full_logits();
  e["chunk"] = info.max_seq_len;
  e["max_session_tokens"] = su.max_session;
  e["max_decode_sequences"] = o.max_decode_sequences;
  e["prompts"] = o.prompts.size();
  e["prompt_rounds"] = o.prompt_rounds;
  e["generations"] = all.size();
  e["failed"] = failed(all);
  e["rounds"] = rounds;
  e["parity"] = parity;
  e["prefix_cache"] = {{"entries", o.prefix_cache_entries}, {"lookups", ps.lookups}, {"hits", ps.hits},
                       {"misses", ps.misses}, {"refusals", ps.refusals}, {"inserts", ps.inserts},
                       {"evictions", ps.evictions}};
  e["load_ms"] = su.load_ms;
  e["threads"] = su.threads;
  e["huge_pages_mib"] = static_cast<double>(su.huge.bytes) / (1 << 20);
  e["peak_rss_mib"] = peak_rss_mib();
  return e;
}

int run(const Options& given) {
  Options o = given;
  Setup su;
  su.threads = cli::set_threads(o.threads);
  auto t0 = Clock::now();
  cli::verify_program(o);
  LlmProgram prog(o.pte, o.data);
  su.load_ms = ms_since(t0);
  const ProgramInfo& info = prog.info();
  if (!info.offgraph)
    throw ProgramError("this program keeps its KV cache in the graph (no constant method 'get_n_caches'): "
                       "llm_batched_runner serves off-graph programs (cache.mode=offgraph); use llm_runner");
  const int64_t max_session = su.max_session =
      o.max_session_tokens == 0 ? info.max_context_len : o.max_session_tokens;
  if (max_session > info.max_context_len)
    throw UsageError("--max-session-tokens " + std::to_string(max_session) + " exceeds the program's max context " +
                     std::to_string(info.max_context_len) + " (get_max_context_len)");
  o.chat = cli::resolve_chat(o.chat, info.chat_template);  // with --ids only its turn end (a stop token)
  const ChatTemplate tpl = chat_template(o.chat);
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    tok = Tokenizer::from_file(o.tokenizer);
    if (tok->vocab_size() > info.vocab_size)
      throw ProgramError("tokenizer vocabulary (" + std::to_string(tok->vocab_size()) +
                         " ids) is larger than the program's (" + std::to_string(info.vocab_size) +
                         "): wrong tokenizer for this program");
  }

  // prompts -> ids
  std::vector<std::vector<int64_t>> prompts;
  for (const std::string& p : o.prompts) {
    std::vector<int64_t> ids = o.ids ? parse_ids(p) : encode_turn(*tok, tpl, p, true);
    cli::check_prompt_ids(ids, info.vocab_size);
    prompts.push_back(std::move(ids));
  }

  // the caches: the program's geometry, the windows of --kv-windows if given; the rows per forward stay the
  // exported chunk whatever the windows (a ring holds window + chunk - 1 slots)
  LlmProgram::CacheGeometry g = prog.cache_geometry();
  const std::vector<int64_t> windows = o.windows(g.windows);
  std::vector<offgraph::LayerSpec> specs;
  const int64_t chunk = info.max_seq_len;
  for (int64_t l = 0; l < g.n_caches; ++l) specs.push_back({g.kv_heads[l], g.head_dims[l], g.v_dims[l], windows[l]});
  EngineOptions eo = engine_options(o, prog, max_session, g.n_shared);
  eo.capture_replies = o.serve;  // a conversation's next turn resends the reply
  const std::unordered_set<int64_t> stops = stop_ids(o, info, tpl, tok.get());
  Engine engine(prog, specs, chunk, eo, stops);
  if (o.huge_pages) su.huge = back_with_huge_pages();
  print_setup(o, info, engine, su);
  if (o.serve)
    return serve_stdio(engine, info.vocab_size,
                       {{"vocab", info.vocab_size}, {"context", info.max_context_len}, {"max_session_tokens", max_session},
                        {"chunk", chunk}, {"logits_mode", logits_mode_name(info.logits_mode)},
                        {"stops", std::vector<int64_t>(stops.begin(), stops.end())},
                        {"max_decode_sequences", o.max_decode_sequences},
                        {"prefix_cache_entries", o.prefix_cache_entries}, {"speculate", o.speculate.on},
                        {"cache_report", engine.describe()}, {"threads", su.threads}, {"load_ms", su.load_ms},
                        {"isa", isa::active_name()}});

  std::unique_ptr<std::ofstream> stats_file;
  if (!o.stats_json.empty()) {
    stats_file = std::make_unique<std::ofstream>(o.stats_json, std::ios::trunc);
    if (!*stats_file) throw std::runtime_error("cannot write --stats-json file '" + o.stats_json + "'");
  }

  const int64_t np = static_cast<int64_t>(prompts.size());
  std::vector<Generation> all;
  EngineStats total;
  json rounds = json::array();
  for (int64_t r = 0; r < o.prompt_rounds; ++r) {
    std::vector<Request> reqs;
    for (int64_t p = 0; p < np; ++p)
      reqs.push_back(Request{r * np + p, static_cast<int>(r), static_cast<int>(p), prompts[p], {}});
    EngineStats st;
    std::vector<Generation> gens = engine.run(reqs, &st);
    total.add(st);
    rounds.push_back(engine_json(st));
    for (Generation& gen : gens) {
      print_generation(o, gen, decode_text(tok.get(), gen.generated, stops), stats_file.get());
      all.push_back(std::move(gen));
    }
  }

  const json parity = parity_json(all, np, o.prompt_rounds);
  if (o.prompt_rounds > 1) print_parity(parity, o.prompt_rounds);
  print_totals(engine, total);
  emit(stats_file.get(), "ENGINE_JSON", engine_record(o, info, engine, total, su, rounds, parity, all));
  if (const int64_t n = failed(all); n > 0) {
    std::fprintf(stderr, "error: %lld of %zu generations failed\n", static_cast<long long>(n), all.size());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main(argc, argv, parse_args, print_help, run, cli::InvalidArgument::error);
}
