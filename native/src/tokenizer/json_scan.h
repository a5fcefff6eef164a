// A minimal JSON cursor, used only to find and read model.vocab and model.merges quickly (they are
// >95% of a large tokenizer.json); load.cpp hands the rest of the file to nlohmann::json.
#pragma once

#include <cstdint>
#include <string>

namespace llmrt::tokenizer_detail::fj {

struct Cur {
  const char* p;
  const char* e;
  const char* base;
};

// Throws TokenizerError naming the byte offset.
[[noreturn]] void fail(const Cur& c, const std::string& what);

inline void ws(Cur& c) {
  while (c.p < c.e && (*c.p == ' ' || *c.p == '\n' || *c.p == '\r' || *c.p == '\t')) ++c.p;
}

inline void expect(Cur& c, char ch) {
  ws(c);
  if (c.p >= c.e || *c.p != ch) fail(c, std::string("expected '") + ch + "'");
  ++c.p;
}

// Reads a string starting at '"' into out (escapes decoded).
void read_string(Cur& c, std::string& out);
// Skips one value (not validated: the parts kept are parsed properly later).
void skip_value(Cur& c);
int64_t read_int(Cur& c);

// Returns true at ',' (consumed), false at the closing char (consumed).
inline bool next_or_close(Cur& c, char close) {
  ws(c);
  if (c.p < c.e && *c.p == ',') {
    ++c.p;
    return true;
  }
  if (c.p < c.e && *c.p == close) {
    ++c.p;
    return false;
  }
  fail(c, std::string("expected ',' or '") + close + "'");
}

}  // namespace llmrt::tokenizer_detail::fj
