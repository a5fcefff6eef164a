#include "tokenizer/json_scan.h"

#include <cstring>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace llmrt::tokenizer_detail::fj {


[[noreturn]] void fail(const Cur& c, const std::string& what) {
  throw TokenizerError("tokenizer.json: malformed JSON (" + what + ") at byte " +
                       std::to_string(c.p - c.base));
}

namespace {

unsigned hex4(Cur& c) {
  if (c.e - c.p < 4) fail(c, "short \\u escape");
  unsigned v = 0;
  for (int k = 0; k < 4; ++k) {
    char h = *c.p++;
    v <<= 4;
    if (h >= '0' && h <= '9') v |= h - '0';
    else if (h >= 'a' && h <= 'f') v |= h - 'a' + 10;
    else if (h >= 'A' && h <= 'F') v |= h - 'A' + 10;
    else fail(c, "bad \\u escape");
  }
  return v;
}

void skip_string(Cur& c) {
  ++c.p;  // opening quote
  for (;;) {
    const char* q = static_cast<const char*>(std::memchr(c.p, '"', c.e - c.p));
    if (!q) fail(c, "unterminated string");
    size_t nbs = 0;  // backslashes right before the quote
    for (const char* b = q; b > c.p && b[-1] == '\\'; --b) ++nbs;
    c.p = q + 1;
    if (nbs % 2 == 0) return;
  }
}

}  // namespace

void read_string(Cur& c, std::string& out) {
  ws(c);
  if (c.p >= c.e || *c.p != '"') fail(c, "expected string");
  ++c.p;
  out.clear();
  for (;;) {
    const char* q = static_cast<const char*>(std::memchr(c.p, '"', c.e - c.p));
    if (!q) fail(c, "unterminated string");
    const char* bs = static_cast<const char*>(std::memchr(c.p, '\\', q - c.p));
    if (!bs) {  // fast path: no escape before the closing quote
      out.append(c.p, q - c.p);
      c.p = q + 1;
      return;
    }
    out.append(c.p, bs - c.p);
    c.p = bs + 1;
    if (c.p >= c.e) fail(c, "unterminated escape");
    char esc = *c.p++;
    switch (esc) {
      case '"': out.push_back('"'); break;
      case '\\': out.push_back('\\'); break;
      case '/': out.push_back('/'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'u': {
        unsigned cp = hex4(c);
        if (cp >= 0xD800 && cp < 0xDC00 && c.e - c.p >= 6 && c.p[0] == '\\' && c.p[1] == 'u') {
          c.p += 2;
          unsigned lo = hex4(c);
          if (lo >= 0xDC00 && lo < 0xE000) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else {
            utf8_append(out, 0xFFFD);
            cp = lo;
          }
        }
        if (cp >= 0xD800 && cp < 0xE000) cp = 0xFFFD;  // lone surrogate
        utf8_append(out, cp);
        break;
      }
      default: fail(c, "bad escape");
    }
  }
}

// Skips one value (not validated: the parts kept are parsed properly later).
void skip_value(Cur& c) {
  ws(c);
  if (c.p >= c.e) fail(c, "expected value");
  if (*c.p == '"') {
    skip_string(c);
    return;
  }
  if (*c.p == '{' || *c.p == '[') {
    int depth = 0;
    while (c.p < c.e) {
      char ch = *c.p;
      if (ch == '"') {
        skip_string(c);
        continue;
      }
      ++c.p;
      if (ch == '{' || ch == '[') ++depth;
      else if (ch == '}' || ch == ']') {
        if (--depth == 0) return;
      }
    }
    fail(c, "unterminated container");
  }
  while (c.p < c.e && *c.p != ',' && *c.p != '}' && *c.p != ']' && *c.p != ' ' && *c.p != '\n' &&
         *c.p != '\r' && *c.p != '\t')
    ++c.p;
}

int64_t read_int(Cur& c) {
  ws(c);
  bool neg = false;
  if (c.p < c.e && *c.p == '-') {
    neg = true;
    ++c.p;
  }
  if (c.p >= c.e || *c.p < '0' || *c.p > '9') fail(c, "expected integer");
  int64_t v = 0;
  while (c.p < c.e && *c.p >= '0' && *c.p <= '9') {
    v = v * 10 + (*c.p - '0');
    if (v > (int64_t(1) << 40)) fail(c, "integer too large");
    ++c.p;
  }
  if (c.p < c.e && (*c.p == '.' || *c.p == 'e' || *c.p == 'E')) fail(c, "expected integer");
  return neg ? -v : v;
}

}  // namespace llmrt::tokenizer_detail::fj
