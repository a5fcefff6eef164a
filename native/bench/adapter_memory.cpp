// adapter_memory: what each further program costs a process that holds several, e.g. an app with one program per
// fine-tune. Loads each .pte (with the data files it names, as the runners find them), runs one forward on it, and
// prints the process's resident memory after each as a JSON line. --weight-cache turns on XNNPACK's weight cache
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

// VmRSS and RssFile of /proc/self/status, in MiB.
void rss_mib(double* total, double* file) {
  std::ifstream status("/proc/self/status");
  std::string key;
  *total = *file = 0;
  while (status >> key) {
    double kb = 0;
    if (key == "VmRSS:" && status >> kb) *total = kb / 1024;
    if (key == "RssFile:" && status >> kb) *file = kb / 1024;
  }
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
  double total = 0, file = 0;
  rss_mib(&total, &file);
  std::printf("{\"program\": null, \"rss_mib\": %.1f, \"rss_file_mib\": %.1f}\n", total, file);
  std::vector<std::unique_ptr<llmrt::LlmProgram>> held;
  try {
    for (const auto& pte : ptes) {
      held.push_back(std::make_unique<llmrt::LlmProgram>(pte));
      const int64_t tokens[2] = {1, 2};
      held.back()->forward(tokens, 2, 0);
      rss_mib(&total, &file);
      std::printf("{\"program\": \"%s\", \"data_files\": %zu, \"rss_mib\": %.1f, \"rss_file_mib\": %.1f}\n",
                  pte.c_str(), held.back()->data_files().size(), total, file);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
