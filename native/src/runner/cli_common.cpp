#include "runner/cli_common.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <executorch/runtime/platform/platform.h>
#include <executorch/runtime/platform/runtime.h>

#include "kernels/offgraph_cache.h"
#include "runtime/chat_template.h"
#include "runtime/llm_program.h"
#include "runtime/pte_check.h"
#include "runtime/threadpool.h"

namespace llmrt::cli {

int64_t parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    long long x = std::stoll(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return x;
  } catch (const std::exception&) {
    throw UsageError(flag + " expects an integer, got '" + v + "'");
  }
}

double parse_double(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    double x = std::stod(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return x;
  } catch (const std::exception&) {
    throw UsageError(flag + " expects a number, got '" + v + "'");
  }
}

bool ArgReader::next() {
  if (++i_ >= argc_) return false;
  arg_ = name_ = argv_[i_];
  inline_value_.clear();
  has_inline_ = false;
  if (arg_.rfind("--", 0) == 0) {
    size_t eq = arg_.find('=');
    if (eq != std::string::npos) {
      inline_value_ = arg_.substr(eq + 1);
      name_ = arg_.substr(0, eq);
      has_inline_ = true;
    }
    // both spellings: the reference documents --max_new_tokens, --cache_kind, ...; the name is read dashed
    for (size_t k = 2; k < name_.size(); ++k)
      if (name_[k] == '_') name_[k] = '-';
  }
  return true;
}

std::string ArgReader::value() {
  if (has_inline_) return inline_value_;
  if (i_ + 1 >= argc_) throw UsageError(name_ + " needs a value");
  return argv_[++i_];
}

void ArgReader::no_value() const {
  if (has_inline_) throw UsageError(name_ + " takes no value");
}

std::string ArgReader::optional_value(const std::string& absent) const {
  return has_inline_ ? inline_value_ : absent;
}

bool CommonOptions::parse(ArgReader& args) {
  const std::string& a = args.name();
  if (a == "--pte") pte = args.value();
  else if (a == "--data") data.push_back(args.value());
  else if (a == "--tokenizer") tokenizer = args.value();
  else if (a == "--chat") chat = args.value();
  else if (a == "--stats-json") stats_json = args.value();
  else if (a == "--max-new-tokens") max_new_tokens = parse_int(a, args.value());
  else if (a == "--temperature") temperature = parse_double(a, args.value());
  else if (a == "--top-p") top_p = parse_double(a, args.value());
  else if (a == "--top-k") top_k = parse_int(a, args.value());
  else if (a == "--seed") seed = static_cast<uint64_t>(parse_int(a, args.value()));
  else if (a == "--threads") threads = parse_int(a, args.value());
  else if (a == "--huge-pages") {
    const std::string v = args.value();
    if (v != "on" && v != "off") throw UsageError("--huge-pages takes on or off, got '" + v + "'");
    huge_pages = v == "on";
  }
  else if (a == "--kv-initial-capacity") {
    kv_initial_capacity = parse_int(a, args.value());
    kv_flags = true;
  } else if (a == "--kv-windows") {
    kv_windows = args.value();
    kv_flags = true;
    try {
      offgraph::parse_windows(kv_windows);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  } else if (a == "--kv-storage-dtype") {
    kv_storage_dtype = args.value();
    kv_flags = true;
  } else if (a == "--verify-pte") {
    verify_pte = args.optional_value("auto");
    if (verify_pte != "auto" && !is_sha256_hex(verify_pte))
      throw UsageError("--verify-pte expects 64 hex digits (a SHA-256) or 'auto', got '" + verify_pte + "'");
  } else if (a == "--speculate") {
    const std::string v = args.value();
    if (v != "ngram" && v != "off") throw UsageError("--speculate takes ngram or off, got '" + v + "'");
    speculate.on = v == "ngram";
  } else if (a == "--draft-max") speculate.draft_max = parse_int(a, args.value());
  else if (a == "--ngram-min") speculate.ngram_min = parse_int(a, args.value());
  else if (a == "--ngram-max") speculate.ngram_max = parse_int(a, args.value());
  else if (a == "--compare-plain") { args.no_value(); compare_plain = true; }
  else if (a == "--ignore-eos") { args.no_value(); ignore_eos = true; }
  else if (a == "--quiet") { args.no_value(); quiet = true; }
  else return false;
  return true;
}

void CommonOptions::check_speculate() const {
  if (speculate.draft_max < 1) throw UsageError("--draft-max must be >= 1");
  if (speculate.ngram_min < 1 || speculate.ngram_max < speculate.ngram_min || speculate.ngram_max > 64)
    throw UsageError("--ngram-min " + std::to_string(speculate.ngram_min) + " / --ngram-max " +
                     std::to_string(speculate.ngram_max) + ": need 1 <= min <= max <= 64");
  if (compare_plain && !speculate.on) throw UsageError("--compare-plain needs --speculate ngram");
  if (speculate.on && speculate.draft_max > speculate::kExactRows - 1)
    std::fprintf(stderr, "[speculate] --draft-max %lld: verify steps wider than %lld rows run other kernels, whose "
                 "logits differ from a decode step's by rounding: greedy output may differ from plain decoding at "
                 "near-ties\n", static_cast<long long>(speculate.draft_max),
                 static_cast<long long>(speculate::kExactRows));
}

void CommonOptions::check_max_new_tokens() const {
  if (max_new_tokens < 0) throw UsageError("--max-new-tokens must be >= 0");
}

void CommonOptions::check_sampling() const {
  if (temperature < 0) throw UsageError("--temperature must be >= 0");
  if (!(top_p > 0.0 && top_p <= 1.0)) throw UsageError("--top-p must be in (0, 1]");
  if (top_k < 0) throw UsageError("--top-k must be >= 0");
}

void CommonOptions::check_threads() const {
  if (threads < 0) throw UsageError("--threads must be >= 0");
}

void CommonOptions::check_kv_initial_capacity() const {
  if (kv_initial_capacity < 1 && kv_initial_capacity != kKvInitialDefault)
    throw UsageError("--kv-initial-capacity must be >= 1, or -1 for the default (" +
                     std::to_string(kKvInitialCapacity) + ", clamped to the capacity), got " +
                     std::to_string(kv_initial_capacity));
}

void CommonOptions::check_kv_storage_dtype() const {
  if (offgraph::parse_dtype(kv_storage_dtype) < 0)
    throw UsageError("--kv-storage-dtype expects fp32, fp16, bf16, int8 or int4, got '" + kv_storage_dtype + "'");
}

int64_t CommonOptions::kv_initial() const {
  return kv_initial_capacity == kKvInitialDefault ? kKvInitialCapacity : kv_initial_capacity;
}

std::vector<int64_t> CommonOptions::windows(std::vector<int64_t> program_windows) const {
  if (kv_windows.empty()) return program_windows;
  const std::vector<int64_t> pat = offgraph::parse_windows(kv_windows);
  for (size_t l = 0; l < program_windows.size(); ++l) program_windows[l] = pat[l % pat.size()];
  return program_windows;
}

int CommonOptions::kv_dtype(int64_t activation_dtype) const {
  return kv_storage_dtype.empty() ? static_cast<int>(activation_dtype) : offgraph::parse_dtype(kv_storage_dtype);
}

std::string resolve_chat(const std::string& flag, const std::string& program_template) {
  if (!flag.empty()) return flag;
  if (program_template.empty()) {
    std::fprintf(stderr, "[chat] the program records no chat template (get_chat_template: built before it, or no "
                         "--pte): raw text; --chat NAME picks one\n");
    return "0";
  }
  try {
    chat_template(program_template);
  } catch (const std::invalid_argument& e) {
    throw ProgramError(std::string("constant method 'get_chat_template': ") + e.what());
  }
  std::fprintf(stderr, "[chat] %s (the program's get_chat_template; --chat overrides)\n", program_template.c_str());
  return program_template;
}

std::string chat_help(int width) {
  const std::string pad(width, ' ');
  std::string flag = "  --chat NAME";
  flag += std::string(width - flag.size(), ' ');
  return flag + "chat template: llama3 | gemma | gemma4 | chatml | 0 (raw text\n" + pad +
         "with BOS) (default: the template the program records in\n" + pad +
         "get_chat_template; raw text for a program without it)\n";
}

std::string speculate_help(int width) {
  const std::string pad(width, ' ');
  auto line = [&](std::string flag, const std::string& text) {
    flag = "  " + flag;
    flag += flag.size() < static_cast<size_t>(width) ? std::string(width - flag.size(), ' ') : "\n" + pad;
    return flag + text;
  };
  const speculate::Options d;
  return line("--speculate off|ngram", "ngram: prompt-lookup speculative decoding: drafts from the\n" + pad +
                                           "context, verified in one forward (a program exported with\n" + pad +
                                           "export.logits_mode=tail, selected or full) (default: off)\n") +
         line("--draft-max K", "most tokens drafted a step, below the program's chunk; the\n" + pad +
                                   "draft adapts to the acceptance rate; above 3, greedy output\n" + pad +
                                   "may differ from plain decoding at near-ties (default: " +
                                   std::to_string(d.draft_max) + ")\n") +
         line("--ngram-min N", "shortest n-gram a draft is matched on (default: " + std::to_string(d.ngram_min) +
                                   ")\n") +
         line("--ngram-max N", "longest n-gram a draft is matched on (default: " + std::to_string(d.ngram_max) +
                                   ")\n") +
         line("--compare-plain", "run each turn again without speculation and report the\n" + pad +
                                     "speedup and whether the tokens are the same (default: off)\n");
}

std::string verify_pte_help(int width) {
  const std::string pad(width, ' ');
  std::string flag = "  --verify-pte[=HEX|auto]";
  flag += flag.size() < static_cast<size_t>(width) ? std::string(width - flag.size(), ' ') : "\n" + pad;
  return flag + "check the .pte's SHA-256 before loading it: against HEX,\n" + pad +
         "or (auto, or no value) against outputs[<file name>].sha256\n" + pad +
         "in the manifest.json beside it (the pipeline's lower-stage\n" + pad +
         "cache entry); a mismatch or no record: exit 1 (default: off)\n";
}

void verify_program(const CommonOptions& o) {
  if (o.verify_pte.empty()) return;
  std::string digest = verify_pte_digest(o.pte, o.verify_pte);
  std::fprintf(stderr, "[verify] %s sha256 %s (%s)\n", o.pte.c_str(), digest.c_str(),
               o.verify_pte == "auto" ? "matches manifest.json" : "matches --verify-pte");
}

void check_prompt_ids(const std::vector<int64_t>& ids, int64_t vocab_size) {
  for (int64_t id : ids)
    if (id < 0 || id >= vocab_size)
      throw UsageError("prompt id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(vocab_size) + ")");
}

int set_threads(int64_t n) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool && n > 0) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(n));
  return thread_count();
}

int thread_count() {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  return pool ? static_cast<int>(pool->get_thread_count()) : 0;
}

namespace {

// ExecuTorch logs Info lines to stderr; keep only errors.
void pal_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
             const char* message, size_t length) {
  if (level != kError && level != kFatal) return;
  while (length > 0 && (message[length - 1] == '\n' || message[length - 1] == '\r')) --length;
  const char* base = filename ? std::strrchr(filename, '/') : nullptr;
  std::fprintf(stderr, "[executorch %c %s:%zu] %.*s\n", static_cast<char>(level),
               base ? base + 1 : (filename ? filename : "?"), line, static_cast<int>(length), message);
}

// ExecuTorch's fatal checks (ET_CHECK) abort the process: e.g. a kernel of a damaged program handed a
// value of the wrong type. That is a detected error, not a crash: exit 1 with the check's message (logged
// just before by pal_log) instead of dying by SIGABRT. Memory faults are not caught here.
[[noreturn]] void pal_abort() {
  std::fflush(stdout);
  std::fprintf(stderr,
               "error: the ExecuTorch runtime stopped on a failed check (the [executorch F ...] line above): "
               "the program is damaged or uses something this runner does not support\n");
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace

void init_runtime() {
  // only the log and abort hooks are ours; the null entries keep the runtime's defaults
  executorch::runtime::PalImpl pal = executorch::runtime::PalImpl::create(pal_log, __FILE__);
  pal.abort = pal_abort;
  executorch::runtime::register_pal(pal);
  executorch::runtime::runtime_init();
}

int exit_with(const std::exception& e, int code) {
  if (code == 1) std::fflush(stdout);
  std::fprintf(stderr, "error: %s\n", e.what());
  return code;
}

}  // namespace llmrt::cli
