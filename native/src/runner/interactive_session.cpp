#include "runner/interactive_session.h"

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace llmrt::runner {

using cli::parse_int;
using cli::UsageError;

void run_interactive(const Options& o, const ChatTemplate& tpl, const Tokenizer& tok, const ProgramInfo& info,
                     const LoadInfo& li, KvCacheOwner& cache, Runner& runner) {
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
    std::vector<int64_t> ids = encode_turn(tok, tpl, line, first);
    int64_t need = static_cast<int64_t>(ids.size()) + (pending >= 0 ? 1 : 0);
    if (need == 0) {  // e.g. raw text (--chat 0) the tokenizer has no tokens for
      std::fprintf(stderr, "[refused] this line encodes to no tokens\n> ");
      continue;
    }
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
}

}  // namespace llmrt::runner
