// --json-schema / --grammar in llm_runner: the grammar runs in a Python sidecar (python -m pipeline constrain_sidecar,
// llguidance) over two pipes, since no grammar engine on PyPI ships its C or C++ interface. The runner asks it for
// each token's allowed-token bitmask, tells it the token chosen, and has it check a speculative draft.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/speculate.h"

namespace llmrt::runner {

class GrammarSidecar final : public speculate::Grammar {
 public:
  // Starts the sidecar and waits for it to compile the grammar: a bad schema or grammar, or no Python with the
  // pipeline, is a ProgramError with its message, before any token. `flag` is --json-schema or --grammar.
  GrammarSidecar(const std::string& python, const std::string& tokenizer, int64_t vocab, const std::string& flag,
                 const std::string& file);
  ~GrammarSidecar() override;
  GrammarSidecar(const GrammarSidecar&) = delete;
  GrammarSidecar& operator=(const GrammarSidecar&) = delete;

  const float* masked(const float* logits) override;  // refused tokens at -inf
  void consume(int64_t token) override;
  int64_t valid_prefix(const std::vector<int64_t>& draft) override;
  bool done();
  bool complete();  // the output so far may end here (a whole sentence of the grammar)
  void reset();  // a new turn

  double mask_ms = 0;
  int64_t masks = 0;

 private:
  void send(const std::string& line);
  std::string line();
  int64_t vocab_;
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  std::vector<uint32_t> bits_;
  std::vector<float> masked_;
};

}  // namespace llmrt::runner
