// llm_runner: a standalone single-session runner for the pipeline's .pte programs.
// Run with --help for the flags and their defaults.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "runner/cli_common.h"
#include "runtime/chat_template.h"
#include "runtime/kv_cache.h"
#include "runtime/llm_program.h"
#include "runtime/sampler.h"
#include "runtime/sysmem.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

using json = nlohmann::json;
using namespace llmrt;
using namespace llmrt::cli;  // Clock, ms_since, parse_int, UsageError

// llm_runner's own flags; those both runners take are parsed by cli::CommonOptions.
struct Options : cli::CommonOptions {
  std::string prompt, prompt_ids;
  bool has_prompt = false, has_prompt_ids = false;
  bool warmup = false, interactive = false, encode = false;
  // off-graph KV cache (programs exported with cache.mode=offgraph)
  int64_t kv_max_capacity = 0;  // 0 = in-graph program
  std::string kv_windows;       // empty = the program's get_windows
};

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
      "  --tokenizer PATH      HF tokenizer.json (required unless --prompt-ids)\n"
      "  --prompt TEXT         user prompt (the chat template is applied)\n"
      "  --prompt-ids LIST     comma-separated token ids, used as they are (no template, no BOS)\n"
      "  --chat NAME           chat template: llama3 | gemma | gemma4 | chatml | 0 (raw text\n"
      "                        with BOS) (default: %s)\n"
      "  --max-new-tokens N    generation budget per turn (default: %lld)\n"
      "  --temperature T       0 = greedy argmax (default: %g)\n"
      "  --top-p P             nucleus sampling, 1 = off (default: %g)\n"
      "  --top-k K             top-k sampling, 0 = off (default: %lld)\n"
      "  --seed S              sampling seed (default: %llu)\n"
      "  --warmup              run one untimed prefill chunk + decode step first (default: off)\n"
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
      "  --kv-max-capacity N   off-graph KV cache of N positions, for programs exported with\n"
      "                        cache.mode=offgraph; 0 = the program keeps its cache (in-graph)\n"
      "                        (default: %lld)\n"
      "  --kv-initial-capacity N  positions first allocated per flat layer; doubles on demand\n"
      "                        up to --kv-max-capacity (default: %lld)\n"
      "  --kv-storage-dtype T  fp32 | fp16 | bf16 (default: the program's activation dtype)\n"
      "  --kv-windows LIST     comma list of windows repeated over the caches, 0 = flat\n"
      "                        (full attention), e.g. 512,0 (default: the program's get_windows)\n"
      "  --help                this text\n"
      "\n"
      "Output: the generated text streams to stdout; the report goes to stderr and ends with\n"
      "a line 'STATS_JSON: {...}' (prompt_ids, generated_ids incl. a final stop token, text,\n"
      "timings, memory). Exit code 0 on success, 1 on errors, 2 on bad usage.\n",
      d.chat.c_str(), static_cast<long long>(d.max_new_tokens), d.temperature, d.top_p,
      static_cast<long long>(d.top_k), static_cast<unsigned long long>(d.seed),
      static_cast<long long>(d.threads), static_cast<long long>(d.kv_max_capacity),
      static_cast<long long>(d.kv_initial_capacity));
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
    else if (a == "--kv-windows") {
      o.kv_windows = args.value();
      o.kv_flags = true;
      try {
        offgraph::parse_windows(o.kv_windows);
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
    }
    else if (a == "--warmup") { args.no_value(); o.warmup = true; }
    else if (a == "--interactive") { args.no_value(); o.interactive = true; }
    else if (a == "--encode") { args.no_value(); o.encode = true; }
    else throw UsageError("unknown argument '" + a + "' (see --help)");
  }
  o.check_max_new_tokens();
  o.check_sampling();
  o.check_threads();
  if (o.kv_max_capacity < 0) throw UsageError("--kv-max-capacity must be >= 0 (0 = in-graph program)");
  o.check_kv_initial_capacity();
  if (o.kv_flags && o.kv_max_capacity == 0)
    throw UsageError("--kv-initial-capacity, --kv-storage-dtype and --kv-windows need --kv-max-capacity");
  if (o.has_prompt && o.has_prompt_ids) throw UsageError("give --prompt or --prompt-ids, not both");
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

struct TurnResult {
  std::vector<int64_t> prompt_ids, generated_ids;
  std::string text;
  std::string stop_reason;
  int64_t pending = -1;  // last generated token not yet fed to the program
  double prefill_ms = 0, ttft_ms = 0, decode_ms = 0, sampling_ms = 0;
  int64_t decode_steps = 0;
  double rss_prefill = 0, rss_decode = 0;
};

class Runner {
 public:
  Runner(const Options& o, LlmProgram& prog, KvCacheOwner& cache, const Tokenizer* tok, int64_t chunk)
      : o_(o), prog_(prog), cache_(cache), tok_(tok),
        sampler_(o.temperature, o.top_p, o.top_k, o.seed), chunk_(chunk) {}

  void add_stop(int64_t id) { stops_.insert(id); }
  const std::unordered_set<int64_t>& stops() const { return stops_; }

  // Feeds ids in chunks of max_seq_len; returns the last logits.
  const std::vector<float>& feed(const std::vector<int64_t>& ids) {
    const int64_t chunk = chunk_;
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

  void warmup() {
    int64_t n = std::min<int64_t>(chunk_, cache_.capacity() - 1);
    std::vector<int64_t> ids(std::max<int64_t>(n, 1), prog_.info().bos_id);
    feed(ids);
    if (cache_.length() < cache_.capacity()) feed({prog_.info().bos_id});
    cache_.reset();
  }

  // One turn: prefill `ids` (pending token first), then decode.
  TurnResult run(std::vector<int64_t> ids, int64_t pending) {
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

 private:
  const Options& o_;
  LlmProgram& prog_;
  KvCacheOwner& cache_;
  const Tokenizer* tok_;
  Sampler sampler_;
  std::unordered_set<int64_t> stops_;
  int64_t chunk_;
};

struct LoadInfo {
  double load_ms = 0, tokenizer_ms = 0, rss_load = 0;
  int threads = 0;
};

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
  j["max_context_len"] = info.max_context_len;
  j["max_seq_len"] = info.max_seq_len;
  j["vocab_size"] = info.vocab_size;
  j["logits_mode"] = logits_mode_name(info.logits_mode);
  j["logits_dtype"] = info.logits_dtype;
  j["recipe_hash"] = info.has_recipe_hash ? json(info.recipe_hash) : json(nullptr);
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
  std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace);
  std::fprintf(stderr, "STATS_JSON: %s\n", line.c_str());
  if (!o.stats_json.empty()) {
    std::ofstream f(o.stats_json, turn == 0 ? std::ios::trunc : std::ios::app);
    if (!f) throw std::runtime_error("cannot write --stats-json file '" + o.stats_json + "'");
    f << line << "\n";
  }
}

void check_vocab(const Tokenizer& tok, const ProgramInfo& info) {
  // Rule: every id the tokenizer can produce must be a valid row of the
  // program's logits/embedding. A tokenizer with fewer ids than the program is
  // fine (vocabularies are often padded, e.g. to a multiple of 64); one with
  // more is the wrong tokenizer for this program.
  if (tok.vocab_size() > info.vocab_size)
    throw ProgramError("tokenizer vocabulary (" + std::to_string(tok.vocab_size()) +
                       " ids) does not match the program's vocabulary (" +
                       std::to_string(info.vocab_size) +
                       "): the tokenizer can produce ids the program does not have");
  for (int64_t id : info.eos_ids)
    if (id >= tok.vocab_size())
      throw ProgramError("the program's EOS id " + std::to_string(id) +
                         " is not in the tokenizer (" + std::to_string(tok.vocab_size()) +
                         " ids): wrong tokenizer for this program?");
  if (tok.vocab_size() < info.vocab_size)
    std::fprintf(stderr, "[tokenizer] %lld ids for a program vocabulary of %lld (padded)\n",
                 static_cast<long long>(tok.vocab_size()), static_cast<long long>(info.vocab_size));
}

int run_encode(const Options& o) {
  ChatTemplate tpl = chat_template(o.chat);
  auto tok = Tokenizer::from_file(o.tokenizer);
  int64_t bos = -1;
  if (!o.pte.empty()) {
    LlmProgram prog(o.pte);
    bos = prog.info().bos_id;
  }
  std::vector<int64_t> ids = encode_turn(*tok, tpl, o.prompt, true, bos);
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

int run(const Options& o) {
  if (o.encode) return run_encode(o);
  ChatTemplate tpl = chat_template(o.chat);  // validate before the slow parts
  cli::set_threads(o.threads);
  LoadInfo li;
  auto t0 = Clock::now();
  LlmProgram prog(o.pte);
  li.load_ms = ms_since(t0);
  const ProgramInfo& info = prog.info();
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    auto tt = Clock::now();
    tok = Tokenizer::from_file(o.tokenizer);
    li.tokenizer_ms = ms_since(tt);
    check_vocab(*tok, info);
  }
  li.rss_load = rss_mib();
  li.threads = cli::thread_count();

  std::string eos;
  for (int64_t id : info.eos_ids) eos += (eos.empty() ? "" : ",") + std::to_string(id);
  std::fprintf(stderr,
               "[program] %s | context %lld | chunk %lld | vocab %lld | activations %s | logits %s | "
               "bos %lld | eos [%s]%s%s\n",
               o.pte.c_str(), static_cast<long long>(info.max_context_len),
               static_cast<long long>(info.max_seq_len), static_cast<long long>(info.vocab_size),
               scalar_type_name(info.activation_dtype), logits_mode_name(info.logits_mode),
               static_cast<long long>(info.bos_id), eos.c_str(),
               info.has_recipe_hash ? " | recipe_hash " : "",
               info.has_recipe_hash ? info.recipe_hash.c_str() : "");
  if (tok)
    std::fprintf(stderr, "[tokenizer] %s | %lld ids | loaded in %.1f ms\n", o.tokenizer.c_str(),
                 static_cast<long long>(tok->vocab_size()), li.tokenizer_ms);
  std::unique_ptr<KvCacheOwner> cache_owner;
  int64_t chunk = info.max_seq_len;
  if (o.kv_max_capacity > 0) {
    if (!info.offgraph)
      throw ProgramError("--kv-max-capacity selects the off-graph KV cache, but this program keeps its "
                         "cache in the graph (no constant method 'get_n_caches'); drop --kv-* flags");
    LlmProgram::CacheGeometry g = prog.cache_geometry();
    std::vector<int64_t> windows = g.windows;
    if (!o.kv_windows.empty()) {
      std::vector<int64_t> pat = offgraph::parse_windows(o.kv_windows);
      for (int64_t l = 0; l < g.n_caches; ++l) windows[l] = pat[l % pat.size()];
    }
    std::vector<offgraph::LayerSpec> specs;
    for (int64_t l = 0; l < g.n_caches; ++l) {
      specs.push_back({g.kv_heads[l], g.head_dims[l], g.v_dims[l], windows[l]});
      if (windows[l] > 0 && windows[l] < chunk) chunk = windows[l];  // a ring holds w + chunk - 1
    }
    if (chunk < info.max_seq_len)
      std::fprintf(stderr, "[cache] prefill chunk %lld -> %lld (narrowest ring window)\n",
                   static_cast<long long>(info.max_seq_len), static_cast<long long>(chunk));
    cache_owner = std::make_unique<OffgraphCacheOwner>(std::move(specs), o.kv_max_capacity, chunk,
                                                       o.kv_initial_capacity, o.kv_dtype(info.activation_dtype));
    prog.set_position_limit(o.kv_max_capacity);
  } else {
    if (info.offgraph)
      throw ProgramError("this program keeps its KV cache off-graph (it has 'get_n_caches'): run it with "
                         "--kv-max-capacity N (positions to hold)");
    std::vector<InGraphCache::Ring> rings;
    if (prog.has_method("get_ring_slots")) {  // a custom-mode program with sliding-window rings
      std::vector<int64_t> w = prog.read_int_list("get_ring_windows"), s = prog.read_int_list("get_ring_slots");
      if (w.size() != s.size()) throw ProgramError("get_ring_windows and get_ring_slots differ in length");
      for (size_t l = 0; l < w.size(); ++l) rings.push_back({w[l], s[l]});
    }
    cache_owner = std::make_unique<InGraphCache>(info.max_context_len, std::move(rings));
  }
  KvCacheOwner& cache = *cache_owner;
  std::fprintf(stderr, "%s\n", cache.describe().c_str());
  std::fprintf(stderr, "[memory] rss after load %.1f MiB (load %.1f ms, threads %d)\n", li.rss_load,
               li.load_ms, li.threads);

  Runner runner(o, prog, cache, tok.get(), chunk);
  for (int64_t id : info.eos_ids)
    if (!o.ignore_eos) runner.add_stop(id);
  if (!tpl.raw && tok && !o.ignore_eos) {
    int32_t te = tok->token_to_id(tpl.turn_end);
    if (te >= 0) runner.add_stop(te);
    else
      std::fprintf(stderr, "[warning] the tokenizer has no '%s' token (template %s)\n",
                   tpl.turn_end.c_str(), tpl.name.c_str());
  }
  if (o.warmup) {
    auto tw = Clock::now();
    runner.warmup();
    std::fprintf(stderr, "[warmup] %.1f ms\n", ms_since(tw));
  }

  if (!o.interactive) {
    std::vector<int64_t> ids = o.has_prompt_ids ? parse_ids(o.prompt_ids)
                                                : encode_turn(*tok, tpl, o.prompt, true, info.bos_id);
    if (ids.empty()) throw UsageError("the prompt is empty (no tokens)");
    cli::check_prompt_ids(ids, info.vocab_size);
    if (static_cast<int64_t>(ids.size()) > cache.capacity())
      throw ProgramError("the prompt has " + std::to_string(ids.size()) +
                         " tokens but the " + (info.offgraph ? "KV cache" : "program's context") +
                         " holds " + std::to_string(cache.capacity()));
    TurnResult r = runner.run(ids, -1);
    report(o, info, li, r, cache, 0);
    return 0;
  }

  // Interactive: one context, turns admitted only if they fit.
  struct Mark {
    int64_t pos;
    int64_t pending;
  };
  std::vector<Mark> marks;  // state before each admitted turn
  int64_t pending = -1;
  int turn = 0;
  std::string line;
  std::fprintf(stderr, "[interactive] /reset, /undo [N], /quit\n> ");
  while (std::getline(std::cin, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == "/quit" || line == "/exit") break;
    if (line == "/reset") {
      cache.reset();
      marks.clear();
      pending = -1;
      std::fprintf(stderr, "[reset] context cleared\n> ");
      continue;
    }
    if (line.rfind("/undo", 0) == 0) {
      int64_t n = 1;
      std::string arg = line.substr(5);
      size_t a = arg.find_first_not_of(' ');
      try {
        if (a != std::string::npos) n = parse_int("/undo", arg.substr(a));
      } catch (const UsageError& e) {
        std::fprintf(stderr, "[undo] %s\n> ", e.what());
        continue;
      }
      if (n < 1 || n > static_cast<int64_t>(marks.size())) {
        std::fprintf(stderr, "[undo] cannot undo %lld turn(s): %zu in the context\n> ",
                     static_cast<long long>(n), marks.size());
        continue;
      }
      Mark m = marks[marks.size() - n];
      std::string why;
      if (!cache.rewind(m.pos, &why)) {
        std::fprintf(stderr, "[undo] refused: %s\n> ", why.c_str());
        continue;
      }
      marks.resize(marks.size() - n);
      pending = m.pending;
      std::fprintf(stderr, "[undo] %lld turn(s) undone; context %lld/%lld\n> ",
                   static_cast<long long>(n), static_cast<long long>(cache.length()),
                   static_cast<long long>(cache.capacity()));
      continue;
    }
    if (line.empty()) {
      std::fprintf(stderr, "> ");
      continue;
    }
    bool first = marks.empty();
    std::vector<int64_t> ids = encode_turn(*tok, tpl, line, first, info.bos_id);
    int64_t need = static_cast<int64_t>(ids.size()) + (pending >= 0 ? 1 : 0);
    int64_t free_slots = cache.capacity() - cache.length();
    if (need > free_slots) {
      std::fprintf(stderr,
                   "[refused] this turn needs %lld tokens but only %lld of %lld are free; use /undo "
                   "or /reset\n> ",
                   static_cast<long long>(need), static_cast<long long>(free_slots),
                   static_cast<long long>(cache.capacity()));
      continue;
    }
    marks.push_back(Mark{cache.length(), pending});
    TurnResult r = runner.run(ids, pending);
    pending = r.pending;
    if (r.stop_reason == "stop_token") pending = -1;  // closed by the template next turn
    report(o, info, li, r, cache, turn++);
    std::fprintf(stderr, "> ");
  }
  std::fprintf(stderr, "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return cli::run_main(argc, argv, parse_args, print_help, run, cli::InvalidArgument::usage);
}
