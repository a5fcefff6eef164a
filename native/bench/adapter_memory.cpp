// adapter_memory: what each further program costs a process that holds several, e.g. an app with one program per
// fine-tune. Loads each .pte (with the data files it names, as the runners find them), runs one forward on it, and
// prints the process's resident memory (RSS and PSS) after each as a JSON line. --weight-cache turns on XNNPACK's weight cache
// first: packed weights are then kept once per data key, so programs over one foundation.ptd share theirs.
//
//   native/build/adapter_memory [--weight-cache] A.pte B.pte ...      (bench/adapters.py runs it)
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/runtime.h>

#include "runtime/llm_program.h"

namespace {

struct Memory {
  double rss = 0, rss_file = 0, pss = 0;  // MiB
};

// VmRSS and RssFile of /proc/self/status, and Pss of /proc/self/smaps_rollup: a file page mapped by two programs'
// loaders counts twice in RSS, once in PSS (the memory the process really holds).
Memory memory() {
  Memory m;
  std::string key;
  double kb = 0;
  std::ifstream status("/proc/self/status");
  while (status >> key) {
    if (key == "VmRSS:" && status >> kb) m.rss = kb / 1024;
    if (key == "RssFile:" && status >> kb) m.rss_file = kb / 1024;
  }
  std::ifstream rollup("/proc/self/smaps_rollup");
  while (rollup >> key)
    if (key == "Pss:" && rollup >> kb) m.pss = kb / 1024;
  return m;
}

void print(const char* program, size_t data_files) {
  const Memory m = memory();
  std::printf("{\"program\": %s%s%s, \"data_files\": %zu, \"rss_mib\": %.1f, \"rss_file_mib\": %.1f, "
              "\"pss_mib\": %.1f}\n", program ? "\"" : "", program ? program : "null", program ? "\"" : "",
              data_files, m.rss, m.rss_file, m.pss);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  executorch::runtime::runtime_init();
  bool weight_cache = false;
  std::vector<std::string> ptes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--weight-cache") == 0) weight_cache = true;
    else ptes.emplace_back(argv[i]);
  }
  if (ptes.empty()) {
    std::fprintf(stderr, "usage: adapter_memory [--weight-cache] A.pte [B.pte ...]\n");
    return 2;
  }
  if (weight_cache) {
    executorch::runtime::BackendOptions<1> opts;
    opts.set_option("weight_cache_enabled", true);
    if (executorch::runtime::set_option("XnnpackBackend", opts.view()) != executorch::runtime::Error::Ok) {
      std::fprintf(stderr, "error: XNNPACK refused weight_cache_enabled\n");
      return 1;
    }
  }
  print(nullptr, 0);
  std::vector<std::unique_ptr<llmrt::LlmProgram>> held;
  try {
    for (const auto& pte : ptes) {
      held.push_back(std::make_unique<llmrt::LlmProgram>(pte));
      const int64_t tokens[2] = {1, 2};
      held.back()->forward(tokens, 2, 0);
      print(pte.c_str(), held.back()->data_files().size());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
