// llm_runner: a standalone single-session runner for the pipeline's .pte programs.
// Run with --help for the flags and their defaults.
//
// This file loads the program, the tokenizer and the KV cache owner and runs one prompt or hands over
// to the interactive loop. Beside it: runner_options (flags, --help), turn_runner (prefill + decode),
// turn_report (stats JSON, report lines), interactive_session (the stdin loop).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runner/cli_common.h"
#include "runner/interactive_session.h"
#include "runner/runner_options.h"
#include "runner/turn_report.h"
#include "runner/turn_runner.h"
#include "runtime/chat_template.h"
#include "runtime/kv_cache.h"
#include "runtime/llm_program.h"
#include "platform/sysmem.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace llmrt;
using namespace llmrt::cli;  // Clock, ms_since, UsageError
using namespace llmrt::runner;

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

// --speculate ngram: refused before any token where a verify step cannot run or cannot be rolled back.
void check_speculation(const Options& o, const LlmProgram& prog, const KvCacheOwner& cache, int64_t chunk) {
  const std::string why = speculate::why_not(prog.verify_rows() > 1, logits_mode_name(prog.info().logits_mode),
                                             o.speculate.draft_max, std::min(chunk, prog.verify_rows()));
  if (!why.empty()) throw ProgramError(why);
  if (cache.recurrent() && !cache.can_snapshot())
    throw ProgramError("--speculate: this program keeps its recurrent state inside the program (cache.mode=custom), "
                       "where the runner cannot roll it back: build with cache.mode=offgraph");
}

// --compare-plain: the turn again from an empty cache without speculation; its speed, and (greedy) whether its
// tokens are the same. The cache holds the plain run afterwards.
void compare_plain(Runner& runner, KvCacheOwner& cache, const std::vector<int64_t>& ids, const Options& o,
                   TurnResult* r) {
  cache.reset();
  runner.set_speculate(false);
  runner.set_quiet(true);  // its text is this turn's again
  TurnResult plain = runner.run(ids, -1);
  runner.set_speculate(true);
  runner.set_quiet(o.quiet);
  r->plain_decode_tok_s = plain.decode_ms > 0 ? plain.decode_steps * 1000.0 / plain.decode_ms : 0;
  r->identical = o.temperature > 0 ? -1 : plain.generated_ids == r->generated_ids ? 1 : 0;
}

int run_encode(const Options& o) {
  if (!o.chat.empty()) chat_template(o.chat);  // validate before the slow parts
  auto tok = Tokenizer::from_file(o.tokenizer);
  std::string program_template;
  if (!o.pte.empty()) {
    cli::verify_program(o);
    program_template = LlmProgram(o.pte, o.data).info().chat_template;
  }
  ChatTemplate tpl = chat_template(cli::resolve_chat(o.chat, program_template));
  std::vector<int64_t> ids = encode_turn(*tok, tpl, o.prompt, true);
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  std::printf("%s\n", line.c_str());
  return 0;
}

void print_program(const Options& o, const ProgramInfo& info, const Tokenizer* tok, const LoadInfo& li) {
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
}

// The runtime-owned cache --kv-max-capacity asks for (an off-graph program), sized from the program's geometry
std::unique_ptr<KvCacheOwner> offgraph_cache(const Options& o, LlmProgram& prog, int64_t chunk) {
  if (!prog.info().offgraph)
    throw ProgramError("--kv-max-capacity selects the off-graph KV cache, but this program keeps its "
                       "cache in the graph (no constant method 'get_n_caches'); drop --kv-* flags");
  LlmProgram::CacheGeometry g = prog.cache_geometry();
  // --kv-windows changes the policy only: the prefill chunk stays as exported, a ring holds window + chunk - 1
  const std::vector<int64_t> windows = o.windows(g.windows);
  std::vector<offgraph::LayerSpec> specs;
  for (int64_t l = 0; l < g.n_caches; ++l) specs.push_back({g.kv_heads[l], g.head_dims[l], g.v_dims[l], windows[l]});
  auto owner = std::make_unique<OffgraphCacheOwner>(std::move(specs), o.kv_max_capacity, chunk, o.kv_initial(),
                                                    o.kv_dtype(prog.info().activation_dtype), g.n_shared);
  if (prog.has_method("get_state_shapes")) owner->set_states(prog.read_int_list("get_state_shapes"));
  prog.set_position_limit(o.kv_max_capacity);
  return owner;
}

// The bookkeeping of a program that keeps its cache in the graph: its rings and recurrent states, if any
std::unique_ptr<KvCacheOwner> in_graph_cache(LlmProgram& prog) {
  if (prog.info().offgraph)
    throw ProgramError("this program keeps its KV cache off-graph (it has 'get_n_caches'): run it with "
                       "--kv-max-capacity N (positions to hold)");
  std::vector<InGraphCache::Ring> rings;
  if (prog.has_method("get_ring_slots")) {  // a custom-mode program with sliding-window rings
    std::vector<int64_t> w = prog.read_int_list("get_ring_windows"), s = prog.read_int_list("get_ring_slots");
    if (w.size() != s.size()) throw ProgramError("get_ring_windows and get_ring_slots differ in length");
    for (size_t l = 0; l < w.size(); ++l) rings.push_back({w[l], s[l]});
  }
  InGraphCache::Layers layers;
  if (prog.has_method("get_layer_kinds")) {  // recurrent layers: their state is the program's
    layers.kinds = prog.read_int_list("get_layer_kinds");
    const std::vector<int64_t> dims = prog.read_int_list("get_state_shapes");
    layers.states = offgraph::state_specs(dims.data(), dims.size());
  }
  return std::make_unique<InGraphCache>(prog.info().max_context_len, std::move(rings), std::move(layers));
}

// --json-schema / --grammar, compiled now: a bad schema is refused before any token
std::unique_ptr<GrammarSidecar> grammar_sidecar(const Options& o, const ProgramInfo& info) {
  if (o.json_schema.empty() && o.grammar.empty()) return nullptr;
  const char* py = std::getenv("LLMPIPE_PYTHON");
  return std::make_unique<GrammarSidecar>(py && *py ? py : "python3", o.tokenizer, info.vocab_size,
                                          o.json_schema.empty() ? "--grammar" : "--json-schema",
                                          o.json_schema.empty() ? o.grammar : o.json_schema);
}

// The program's EOS ids and the chat template's turn end stop a turn (unless --ignore-eos)
void add_stops(Runner& runner, const Options& o, const ProgramInfo& info, const ChatTemplate& tpl,
               const Tokenizer* tok) {
  if (o.ignore_eos) return;
  for (int64_t id : info.eos_ids) runner.add_stop(id);
  if (tpl.raw || !tok) return;
  int32_t te = tok->token_to_id(tpl.turn_end);
  if (te >= 0) runner.add_stop(te);
  else
    std::fprintf(stderr, "[warning] the tokenizer has no '%s' token (template %s)\n",
                 tpl.turn_end.c_str(), tpl.name.c_str());
}

// One turn on --prompt or --prompt-ids, then the report
int run_prompt(const Options& o, const ChatTemplate& tpl, const Tokenizer* tok, const ProgramInfo& info,
               const LoadInfo& li, KvCacheOwner& cache, Runner& runner) {
  std::vector<int64_t> ids = o.has_prompt_ids ? parse_ids(o.prompt_ids) : encode_turn(*tok, tpl, o.prompt, true);
  // an empty --prompt-ids is refused while parsing; a text that encodes to nothing is the tokenizer's doing
  if (ids.empty()) throw ProgramError("the prompt encodes to no tokens (tokenizer '" + o.tokenizer + "')");
  cli::check_prompt_ids(ids, info.vocab_size);
  if (static_cast<int64_t>(ids.size()) > cache.capacity())
    throw ProgramError("the prompt has " + std::to_string(ids.size()) +
                       " tokens but the " + (info.offgraph ? "KV cache" : "program's context") +
                       " holds " + std::to_string(cache.capacity()));
  TurnResult r = runner.run(ids, -1);
  if (o.compare_plain) compare_plain(runner, cache, ids, o, &r);
  report(o, info, li, r, cache, 0);
  return 0;
}

int run(const Options& given) {
  if (given.encode) return run_encode(given);
  Options o = given;
  if (!o.chat.empty()) chat_template(o.chat);  // validate before the slow parts
  cli::set_threads(o.threads);
  LoadInfo li;
  cli::verify_program(o);  // before the load: a damaged file never reaches ExecuTorch
  auto t0 = Clock::now();
  LlmProgram prog(o.pte, o.data);
  li.load_ms = ms_since(t0);
  const ProgramInfo& info = prog.info();
  std::unique_ptr<Tokenizer> tok;
  if (!o.tokenizer.empty()) {
    auto tt = Clock::now();
    tok = Tokenizer::from_file(o.tokenizer);
    li.tokenizer_ms = ms_since(tt);
    check_vocab(*tok, info);
  }
  o.chat = cli::resolve_chat(o.chat, info.chat_template);
  const ChatTemplate tpl = chat_template(o.chat);
  li.rss_load = rss_mib();
  li.threads = cli::thread_count();
  print_program(o, info, tok.get(), li);

  const int64_t chunk = info.max_seq_len;
  std::unique_ptr<KvCacheOwner> cache_owner = o.kv_max_capacity > 0 ? offgraph_cache(o, prog, chunk)
                                                                     : in_graph_cache(prog);
  KvCacheOwner& cache = *cache_owner;
  if (o.huge_pages) li.huge = back_with_huge_pages();
  std::fprintf(stderr, "%s\n", cache.describe().c_str());
  std::fprintf(stderr, "%s\n", describe(li.huge, o.huge_pages).c_str());
  std::fprintf(stderr, "[memory] rss after load %.1f MiB (load %.1f ms, threads %d)\n", li.rss_load,
               li.load_ms, li.threads);

  if (o.speculate.on) check_speculation(o, prog, cache, chunk);
  std::unique_ptr<GrammarSidecar> grammar = grammar_sidecar(o, info);
  Runner runner(o, prog, cache, tok.get(), chunk);
  runner.set_grammar(grammar.get());
  add_stops(runner, o, info, tpl, tok.get());
  if (o.warmup) {
    auto tw = Clock::now();
    runner.warmup();
    std::fprintf(stderr, "[warmup] %.1f ms\n", ms_since(tw));
  }
  if (!o.interactive) return run_prompt(o, tpl, tok.get(), info, li, cache, runner);
  run_interactive(o, tpl, *tok, info, li, cache, runner);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return llmrt::cli::run_main(argc, argv, llmrt::runner::parse_args, llmrt::runner::print_help, run,
                              llmrt::cli::InvalidArgument::usage);
}
