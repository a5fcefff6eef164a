#include "runner/grammar_sidecar.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "runtime/llm_program.h"

namespace llmrt::runner {

GrammarSidecar::GrammarSidecar(const std::string& python, const std::string& tokenizer, int64_t vocab,
                               const std::string& flag, const std::string& file)
    : vocab_(vocab), bits_(static_cast<size_t>((vocab + 31) / 32)) {
  int in[2], out[2];  // in: runner -> sidecar, out: sidecar -> runner
  if (pipe(in) != 0 || pipe(out) != 0) throw ProgramError(std::string("grammar sidecar: pipe: ") + strerror(errno));
  const std::string v = std::to_string(vocab);
  std::vector<const char*> argv = {python.c_str(), "-m", "pipeline", "constrain_sidecar", "--tokenizer",
                                   tokenizer.c_str(), "--vocab", v.c_str(), flag.c_str(), file.c_str(), nullptr};
  pid_ = fork();
  if (pid_ < 0) throw ProgramError(std::string("grammar sidecar: fork: ") + strerror(errno));
  if (pid_ == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    execvp(argv[0], const_cast<char* const*>(argv.data()));
    std::fprintf(stdout, "error cannot start %s: %s\n", python.c_str(), strerror(errno));
    std::fflush(stdout);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  const std::string ready = line();
  if (ready.rfind("ready ", 0) != 0)
    throw ProgramError(ready.rfind("error ", 0) == 0 ? ready.substr(6)
                                                     : "grammar sidecar (python -m pipeline constrain_sidecar) "
                                                       "did not start: '" + ready + "' (set LLMPIPE_PYTHON)");
}

GrammarSidecar::~GrammarSidecar() {
  if (to_) std::fclose(to_);  // end of its stdin: it exits
  if (from_) std::fclose(from_);
  if (pid_ > 0) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == 0) {
      usleep(100000);
      if (waitpid(pid_, &status, WNOHANG) == 0) {
        kill(pid_, SIGTERM);
        waitpid(pid_, &status, 0);
      }
    }
  }
}

void GrammarSidecar::send(const std::string& s) {
  if (std::fputs((s + "\n").c_str(), to_) < 0 || std::fflush(to_) != 0)
    throw ProgramError("grammar sidecar: it has exited");
}

std::string GrammarSidecar::line() {
  std::string s;
  for (int c; (c = std::fgetc(from_)) != EOF && c != '\n';) s += static_cast<char>(c);
  if (s.empty() && std::feof(from_)) throw ProgramError("grammar sidecar: it has exited");
  return s;
}

const float* GrammarSidecar::masked(const float* logits) {
  const auto t0 = std::chrono::steady_clock::now();
  send("M");
  const size_t bytes = bits_.size() * sizeof(uint32_t);
  if (std::fread(bits_.data(), 1, bytes, from_) != bytes) throw ProgramError("grammar sidecar: a short mask");
  masked_.assign(logits, logits + vocab_);
  for (int64_t t = 0; t < vocab_; ++t)
    if (!(bits_[static_cast<size_t>(t >> 5)] >> (t & 31) & 1u)) masked_[static_cast<size_t>(t)] = -INFINITY;
  mask_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ++masks;
  return masked_.data();
}

void GrammarSidecar::consume(int64_t token) {
  send("C " + std::to_string(token));
  const std::string r = line();
  if (r != "ok") throw ProgramError("grammar: " + (r.size() > 6 ? r.substr(6) : r));
}

int64_t GrammarSidecar::valid_prefix(const std::vector<int64_t>& draft) {
  std::string s = "V ";
  for (size_t i = 0; i < draft.size(); ++i) s += (i ? "," : "") + std::to_string(draft[i]);
  send(s);
  return std::stoll(line());
}

bool GrammarSidecar::done() {
  send("S");
  return line() == "1";
}

bool GrammarSidecar::complete() {
  send("A");
  return line() == "1";
}

void GrammarSidecar::reset() {
  send("R");
  line();
}

}  // namespace llmrt::runner
