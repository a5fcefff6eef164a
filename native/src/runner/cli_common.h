// Shared by the command-line runners (llm_runner, llm_batched_runner): main() with its exit codes,
// the argv reader and the flags both runners take, number parsing, timing and the thread pool.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/isa.h"
#include "runtime/speculate.h"

namespace llmrt::cli {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Bad usage: the runners exit 2 with the message.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

int64_t parse_int(const std::string& flag, const std::string& v);
double parse_double(const std::string& flag, const std::string& v);

// argv one argument at a time. An argument starting with "--" is a flag, "--name value" or
// "--name=value"; any other argument is left whole (a prompt, or "-h"). A flag's name is read with its
// underscores as dashes: --max_new_tokens is --max-new-tokens (the reference's spelling).
class ArgReader {
 public:
  ArgReader(int argc, char** argv) : argc_(argc), argv_(argv) {}

  // Moves to the next argument; false after the last one.
  bool next();
  // The argument as given.
  const std::string& arg() const { return arg_; }
  // The flag's name: the argument up to its '='.
  const std::string& name() const { return name_; }
  // The flag's value: what follows '=', else the next argument.
  std::string value();
  // For a flag that takes no value: refuses "--flag=value".
  void no_value() const;
  // For a flag whose value is optional ("--flag" or "--flag=value"): the inline value, else `absent`
  // (the next argument is never taken: it may be a prompt).
  std::string optional_value(const std::string& absent) const;

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string arg_, name_, inline_value_;
  bool has_inline_ = false;
};

// --kv-initial-capacity: the reference's default, also spelled -1 (offgraph-cache.md §3: 512, clamped to the
// capacity by the cache).
constexpr int64_t kKvInitialCapacity = 512;
constexpr int64_t kKvInitialDefault = -1;

// The flags both runners take: the same names, defaults and messages. Each runner's Options derives
// from it and reads its own flags after parse() declined them.
struct CommonOptions {
  std::string pte, tokenizer, stats_json;
  std::vector<std::string> data;  // --data (repeatable): the program's data files, if not beside the .pte
  std::string chat;  // empty = the program's get_chat_template, else raw text ("0")
  int64_t max_new_tokens = 50;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 42;
  bool ignore_eos = false, quiet = false;
  int64_t threads = 0;
  bool huge_pages = true;        // --huge-pages on|off: back the weights and the cache with 2 MiB pages
  int64_t kv_initial_capacity = kKvInitialCapacity;  // -1 = the default
  std::string kv_windows;        // empty = the program's get_windows
  std::string kv_storage_dtype;  // empty = the program's activation dtype
  bool kv_flags = false;         // a --kv-* flag other than --kv-max-capacity given
  std::string verify_pte;        // --verify-pte: a SHA-256 in hex, "auto" (manifest.json), empty = off
  speculate::Options speculate;  // --speculate ngram, --draft-max, --ngram-min, --ngram-max
  bool compare_plain = false;    // --compare-plain: each turn again without speculation, for the speedup

  // Reads the current flag if it is one of these (true); false leaves it to the runner.
  bool parse(ArgReader& args);

  // The range checks, one per flag (UsageError), so that each runner keeps the order in which it
  // reports them.
  void check_max_new_tokens() const;
  void check_sampling() const;  // --temperature, --top-p, --top-k
  void check_threads() const;
  void check_kv_initial_capacity() const;
  void check_kv_storage_dtype() const;  // also refuses an empty value
  void check_speculate() const;         // --draft-max, --ngram-min, --ngram-max

  // --kv-initial-capacity with -1 read as the default.
  int64_t kv_initial() const;
  // The cache windows: the program's, or the --kv-windows pattern repeated over the caches (0 = flat).
  std::vector<int64_t> windows(std::vector<int64_t> program_windows) const;

  // The K/V storage dtype code: --kv-storage-dtype, else the program's activation dtype.
  int kv_dtype(int64_t activation_dtype) const;
};

// The chat template a run uses: --chat if given, else the one the program records (get_chat_template), else
// raw text ("0") with a note on stderr (a program built before get_chat_template). `program_template` is
// ProgramInfo::chat_template; an unknown recorded name is a ProgramError naming the method.
std::string resolve_chat(const std::string& flag, const std::string& program_template);

// The help line of --chat, the same in both runners; `width` is the column of the descriptions.
std::string chat_help(int width);

// The help lines of the speculation flags, the same in both runners; `width` is the column of the descriptions.
std::string speculate_help(int width);

// The help line of --verify-pte, the same in both runners; `width` is the column of the descriptions.
std::string verify_pte_help(int width);

// --verify-pte: checks the .pte's SHA-256 before anything loads it (ProgramError: exit 1). No-op
// without the flag.
void verify_program(const CommonOptions& o);

// Refuses a prompt id outside [0, vocab_size) (UsageError).
void check_prompt_ids(const std::vector<int64_t>& ids, int64_t vocab_size);

// --threads N (0 = the runtime default); returns the pool's thread count.
int set_threads(int64_t n);
// The thread pool's size (0 without a pool).
int thread_count();

// Registers the PAL (ExecuTorch logs only its errors) and initializes the runtime.
void init_runtime();

// How a runner's exit code reads a std::invalid_argument thrown by run(): llm_runner as bad usage
// (an unknown --chat, cache sizes the off-graph cache refuses: exit 2), llm_batched_runner as an
// error (exit 1; it checks --chat while parsing).
enum class InvalidArgument { usage, error };

// Prints "error: <what>" to stderr and returns `code`; for an error (1) stdout is flushed first, since
// the generated text may have been streaming there.
int exit_with(const std::exception& e, int code);

// main() of a runner: the runtime, then parse_args (UsageError: exit 2; --help sets *help: print_help,
// exit 0) and run, whose UsageError exits 2 and any other exception 1.
template <class Options>
int run_main(int argc, char** argv, Options (*parse_args)(int, char**, bool*), void (*print_help)(),
             int (*run)(const Options&), InvalidArgument invalid_argument) {
  init_runtime();
  bool help = false;
  Options o;
  try {
    o = parse_args(argc, argv, &help);
  } catch (const UsageError& e) {
    return exit_with(e, 2);
  }
  if (help) {
    print_help();
    return 0;
  }
  if (!isa::problem().empty()) return exit_with(UsageError(isa::problem()), 2);  // a bad LLMPIPE_ISA
  std::fprintf(stderr, "[kernels] isa %s\n", isa::describe().c_str());
  try {
    return run(o);
  } catch (const UsageError& e) {
    return exit_with(e, 2);
  } catch (const std::invalid_argument& e) {
    return exit_with(e, invalid_argument == InvalidArgument::usage ? 2 : 1);
  } catch (const std::exception& e) {
    return exit_with(e, 1);
  }
}

}  // namespace llmrt::cli
