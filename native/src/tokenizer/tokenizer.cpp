// HF tokenizer.json reader: see tokenizer.h for what is supported.
#include "tokenizer/tokenizer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <queue>
#include <unordered_map>
#include <utility>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "tokenizer/utf8.h"

namespace llmrt {

using json = nlohmann::json;

namespace {

// ---------------------------------------------------------------------------
// A minimal JSON cursor, used only to find and read model.vocab and
// model.merges quickly (they are >95% of a large tokenizer.json); the rest of
// the file is handed to nlohmann::json.
namespace fj {

struct Cur {
  const char* p;
  const char* e;
  const char* base;
};

[[noreturn]] void fail(const Cur& c, const std::string& what) {
  throw TokenizerError("tokenizer.json: malformed JSON (" + what + ") at byte " +
                       std::to_string(c.p - c.base));
}

inline void ws(Cur& c) {
  while (c.p < c.e && (*c.p == ' ' || *c.p == '\n' || *c.p == '\r' || *c.p == '\t')) ++c.p;
}

inline void expect(Cur& c, char ch) {
  ws(c);
  if (c.p >= c.e || *c.p != ch) fail(c, std::string("expected '") + ch + "'");
  ++c.p;
}

inline unsigned hex4(Cur& c) {
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

// Reads a string starting at '"' into out (escapes decoded).
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

}  // namespace fj

// ---------------------------------------------------------------------------
// Open-addressing maps.

class VocabMap {
 public:
  void build(const std::vector<std::string>* keys, const std::vector<uint8_t>* present) {
    keys_ = keys;
    size_t n = 0;
    for (auto p : *present) n += p;
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{0, -1});
    mask_ = cap - 1;
    for (size_t id = 0; id < keys->size(); ++id) {
      if (!(*present)[id]) continue;
      size_t h = hash((*keys)[id]);
      uint32_t fp = static_cast<uint32_t>(h >> 32);
      size_t i = h & mask_;
      for (;;) {
        Slot& s = slots_[i];
        if (s.id < 0) {
          s = Slot{fp, static_cast<int32_t>(id)};
          break;
        }
        if (s.fp == fp && (*keys)[s.id] == (*keys)[id]) break;  // duplicate: first id wins
        i = (i + 1) & mask_;
      }
    }
  }
  // Looks up n keys whose hashes are given, overlapping the memory latency of
  // the lookups (used to resolve ~1.5M merge strings at load time).
  void find_batch(const std::string_view* keys, const size_t* hashes, size_t n, int32_t* out) const {
    constexpr size_t kMax = 64;
    int32_t cand[kMax];
    for (size_t base = 0; base < n; base += kMax) {
      size_t m = std::min(kMax, n - base);
      for (size_t k = 0; k < m; ++k) __builtin_prefetch(&slots_[hashes[base + k] & mask_]);
      for (size_t k = 0; k < m; ++k) {
        size_t h = hashes[base + k];
        uint32_t fp = static_cast<uint32_t>(h >> 32);
        cand[k] = -1;
        for (size_t i = h & mask_;; i = (i + 1) & mask_) {
          const Slot& s = slots_[i];
          if (s.id < 0) break;
          if (s.fp == fp) {
            cand[k] = s.id;
            __builtin_prefetch(&(*keys_)[s.id]);
            break;
          }
        }
      }
      for (size_t k = 0; k < m; ++k) {
        int32_t c = cand[k];
        // No fingerprint match: absent. A match on a different key: full probe.
        out[base + k] = c < 0 ? -1 : ((*keys_)[c] == keys[base + k] ? c : find(keys[base + k]));
      }
    }
  }
  static size_t fnv_extend(uint64_t h, std::string_view s) {
    for (unsigned char ch : s) {
      h ^= ch;
      h *= 1099511628211ULL;
    }
    return static_cast<size_t>(h);
  }
  static size_t finalize(uint64_t h) {
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return static_cast<size_t>(h);
  }
  static constexpr uint64_t kFnvBasis = 1469598103934665603ULL;

  int32_t find(std::string_view k) const {
    if (slots_.empty()) return -1;
    size_t h = hash(k);
    uint32_t fp = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.id < 0) return -1;
      if (s.fp == fp && (*keys_)[s.id] == k) return s.id;
    }
  }

 private:
  struct Slot {
    uint32_t fp;
    int32_t id;
  };
  // FNV-1a, then a 64-bit finalizer (short keys: cheaper than murmur here).
  static size_t hash(std::string_view s) { return finalize(fnv_extend(kFnvBasis, s)); }
  const std::vector<std::string>* keys_ = nullptr;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct MergeVal {
  int32_t rank;
  int32_t id;
};

class MergeMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, MergeVal{0, 0});
    mask_ = cap - 1;
  }
  void insert_or_assign(uint64_t key, MergeVal v) {
    size_t h = mix(key) & mask_;
    while (keys_[h] != kEmpty && keys_[h] != key) h = (h + 1) & mask_;
    if (keys_[h] == kEmpty) ++size_;
    keys_[h] = key;
    vals_[h] = v;
  }
  const MergeVal* find(uint64_t key) const {
    if (keys_.empty()) return nullptr;
    size_t h = mix(key) & mask_;
    for (;;) {
      uint64_t k = keys_[h];
      if (k == key) return &vals_[h];
      if (k == kEmpty) return nullptr;
      h = (h + 1) & mask_;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
  }
  std::vector<uint64_t> keys_;
  std::vector<MergeVal> vals_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// ---------------------------------------------------------------------------
// PCRE2 regex (UTF + UCP, JIT when available).

class Regex {
 public:
  explicit Regex(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof(buf));
      throw TokenizerError("tokenizer.json: cannot compile regex '" + pattern +
                           "': " + reinterpret_cast<char*>(buf) + " at offset " +
                           std::to_string(off));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    md_ = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (jit_) {
      stack_ = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
      mctx_ = pcre2_match_context_create(nullptr);
      pcre2_jit_stack_assign(mctx_, nullptr, stack_);
    }
  }
  ~Regex() {
    if (md_) pcre2_match_data_free(md_);
    if (mctx_) pcre2_match_context_free(mctx_);
    if (stack_) pcre2_jit_stack_free(stack_);
    if (code_) pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // All non-overlapping matches (start, end) in s, which must be valid UTF-8.
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    size_t pos = 0;
    auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    while (pos <= s.size()) {
      int rc = pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md_, mctx_);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR buf[256];
        pcre2_get_error_message(rc, buf, sizeof(buf));
        throw TokenizerError(std::string("regex match failed: ") + reinterpret_cast<char*>(buf));
      }
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md_);
      size_t a = ov[0], b = ov[1];
      out.emplace_back(a, b);
      if (b > a) {
        pos = b;
      } else {  // empty match: step one character
        if (a >= s.size()) break;
        pos = a + utf8_lead_len(static_cast<unsigned char>(s[a]));
      }
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* md_ = nullptr;
  pcre2_match_context* mctx_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
  bool jit_ = false;
};

// GPT-2 byte <-> unicode table used by ByteLevel.
struct ByteMap {
  std::string enc[256];  // byte -> UTF-8 of its printable char
  std::unordered_map<uint32_t, uint8_t> dec;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = keep ? b : 256 + n++;
      utf8_append(enc[b], cp);
      dec[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

bool is_unicode_space(uint32_t cp) {
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// HF checks single_word tokens with the Rust regex crate's Unicode \w
// (Alphabetic, M, Nd, Pc, Join_Control); this class is its PCRE2 equivalent.
bool is_word_cp(uint32_t cp) {
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) || cp == '_';
  static const Regex word(R"([\p{L}\p{Nl}\p{Nd}\p{M}\p{Pc}\x{200C}\x{200D}])");
  std::string ch;
  utf8_append(ch, cp);
  std::vector<std::pair<size_t, size_t>> m;
  word.find_all(ch, m);
  return !m.empty();
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& s) {
  if (s == "Removed") return Behavior::Removed;
  if (s == "Isolated") return Behavior::Isolated;
  if (s == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::MergedWithNext;
  if (s == "Contiguous") return Behavior::Contiguous;
  throw TokenizerError("tokenizer.json: unknown split behavior '" + s + "'");
}

// Applies HF's SplitDelimiterBehavior to (range, is_match) pieces of s.
void apply_behavior(std::vector<std::pair<std::pair<size_t, size_t>, bool>>& m, Behavior b,
                    std::vector<std::pair<size_t, size_t>>& out) {
  out.clear();
  switch (b) {
    case Behavior::Isolated:
      for (auto& x : m) out.push_back(x.first);
      break;
    case Behavior::Removed:
      for (auto& x : m)
        if (!x.second) out.push_back(x.first);
      break;
    case Behavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& x : m) {
        if (x.second && !prev && !out.empty()) out.back().second = x.first.second;
        else out.push_back(x.first);
        prev = x.second;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev = false;
      for (size_t k = m.size(); k-- > 0;) {
        auto& x = m[k];
        if (x.second && !prev && !out.empty()) out.back().first = x.first.first;
        else out.push_back(x.first);
        prev = x.second;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev = false;
      for (auto& x : m) {
        if (x.second == prev && !out.empty()) out.back().second = x.first.second;
        else out.push_back(x.first);
        prev = x.second;
      }
      break;
    }
  }
}

// A pattern for Split-like steps: a literal string or a regex.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;

  static Pattern from_json(const json& p, const char* where) {
    Pattern out;
    if (p.is_object() && p.contains("String")) {
      out.literal = p["String"].get<std::string>();
      if (out.literal.empty())
        throw TokenizerError(std::string("tokenizer.json: empty pattern in ") + where);
    } else if (p.is_object() && p.contains("Regex")) {
      out.regex = std::make_unique<Regex>(p["Regex"].get<std::string>());
    } else {
      throw TokenizerError(std::string("tokenizer.json: unsupported pattern in ") + where);
    }
    return out;
  }

  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    if (regex) {
      regex->find_all(s, out);
      return;
    }
    out.clear();
    size_t pos = 0;
    while ((pos = s.find(literal, pos)) != std::string_view::npos) {
      out.emplace_back(pos, pos + literal.size());
      pos += literal.size();
    }
  }
};

// Splits s by the matches of pat, with behavior b (and optional invert).
void split_pieces(std::string_view s, const Pattern& pat, Behavior b, bool invert,
                  std::vector<std::pair<size_t, size_t>>& out) {
  std::vector<std::pair<size_t, size_t>> found;
  pat.find_all(s, found);
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> m;
  m.reserve(found.size() * 2 + 1);
  size_t prev = 0;
  for (auto& f : found) {
    if (prev != f.first) m.push_back({{prev, f.first}, invert});
    m.push_back({f, !invert});
    prev = f.second;
  }
  if (prev != s.size()) m.push_back({{prev, s.size()}, invert});
  apply_behavior(m, b, out);
}

// A pre-tokenized piece: text plus whether it starts at offset 0 of the input.
struct Word {
  std::string s;
  bool at_start;
};

// ---------------------------------------------------------------------------
// Normalizers.
struct Normalizer {
  enum Kind { kReplace, kPrepend, kSequence } kind;
  Pattern pattern;
  std::string content;
  std::vector<std::unique_ptr<Normalizer>> children;

  static std::unique_ptr<Normalizer> from_json(const json& j) {
    auto n = std::make_unique<Normalizer>();
    std::string t = j.value("type", "");
    if (t == "Replace") {
      n->kind = kReplace;
      n->pattern = Pattern::from_json(j.at("pattern"), "Replace normalizer");
      n->content = j.at("content").get<std::string>();
    } else if (t == "Prepend") {
      n->kind = kPrepend;
      n->content = j.at("prepend").get<std::string>();
    } else if (t == "Sequence") {
      n->kind = kSequence;
      for (auto& c : j.at("normalizers")) n->children.push_back(from_json(c));
    } else {
      throw TokenizerError("tokenizer.json: unsupported normalizer type '" + t + "'");
    }
    return n;
  }

  void apply(std::string& s) const {
    switch (kind) {
      case kReplace: {
        std::vector<std::pair<size_t, size_t>> found;
        pattern.find_all(s, found);
        if (found.empty()) return;
        std::string out;
        out.reserve(s.size() + found.size() * content.size());
        size_t prev = 0;
        for (auto& f : found) {
          out.append(s, prev, f.first - prev);
          out += content;
          prev = f.second;
        }
        out.append(s, prev, std::string::npos);
        s.swap(out);
        return;
      }
      case kPrepend:
        if (!s.empty()) s.insert(0, content);
        return;
      case kSequence:
        for (auto& c : children) c->apply(s);
        return;
    }
  }
};

// ---------------------------------------------------------------------------
// Pre-tokenizers.
struct PreTokenizer {
  enum Kind { kByteLevel, kSplit, kMetaspace, kSequence } kind;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Split (also used for Digits / Whitespace / WhitespaceSplit)
  Pattern pattern;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  // Metaspace
  std::string replacement;
  std::string prepend_scheme;  // always | first | never
  bool split = true;
  std::vector<std::unique_ptr<PreTokenizer>> children;

  static std::unique_ptr<PreTokenizer> from_json(const json& j) {
    auto p = std::make_unique<PreTokenizer>();
    std::string t = j.value("type", "");
    if (t == "ByteLevel") {
      p->kind = kByteLevel;
      p->add_prefix_space = j.value("add_prefix_space", false);
      p->use_regex = j.value("use_regex", true);
      if (p->use_regex) p->pattern.regex = std::make_unique<Regex>(kGpt2Pattern);
    } else if (t == "Split") {
      p->kind = kSplit;
      p->pattern = Pattern::from_json(j.at("pattern"), "Split pre-tokenizer");
      p->behavior = parse_behavior(j.at("behavior").get<std::string>());
      p->invert = j.value("invert", false);
    } else if (t == "Digits") {
      p->kind = kSplit;
      bool individual = j.value("individual_digits", false);
      p->pattern.regex = std::make_unique<Regex>(individual ? R"(\p{N})" : R"(\p{N}+)");
      p->behavior = Behavior::Isolated;
    } else if (t == "Whitespace") {
      p->kind = kSplit;
      p->pattern.regex = std::make_unique<Regex>(R"(\w+|[^\w\s]+)");
      p->behavior = Behavior::Removed;
      p->invert = true;
    } else if (t == "WhitespaceSplit") {
      p->kind = kSplit;
      p->pattern.regex = std::make_unique<Regex>(R"(\s+)");
      p->behavior = Behavior::Removed;
    } else if (t == "Metaspace") {
      p->kind = kMetaspace;
      p->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
      p->prepend_scheme = j.value("prepend_scheme", std::string());
      if (p->prepend_scheme.empty())
        p->prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
      p->split = j.value("split", true);
      p->pattern.literal = p->replacement;
    } else if (t == "Sequence") {
      p->kind = kSequence;
      for (auto& c : j.at("pretokenizers")) p->children.push_back(from_json(c));
    } else {
      throw TokenizerError("tokenizer.json: unsupported pre_tokenizer type '" + t + "'");
    }
    return p;
  }

  void apply(std::vector<Word>& words) const {
    if (kind == kSequence) {
      for (auto& c : children) c->apply(words);
      return;
    }
    std::vector<Word> out;
    out.reserve(words.size() * 2);
    std::vector<std::pair<size_t, size_t>> ranges;
    const ByteMap& bm = byte_map();
    for (auto& w : words) {
      switch (kind) {
        case kByteLevel: {
          std::string s = w.s;
          if (add_prefix_space && (s.empty() || s[0] != ' ')) s.insert(0, " ");
          if (use_regex) {
            split_pieces(s, pattern, Behavior::Isolated, false, ranges);
          } else {
            ranges.assign(1, {0, s.size()});
          }
          bool first = true;
          for (auto& r : ranges) {
            if (r.second == r.first) continue;
            Word nw{std::string(), w.at_start && first};
            first = false;
            for (size_t k = r.first; k < r.second; ++k) nw.s += bm.enc[static_cast<uint8_t>(s[k])];
            out.push_back(std::move(nw));
          }
          break;
        }
        case kSplit: {
          split_pieces(w.s, pattern, behavior, invert, ranges);
          bool first = true;
          for (auto& r : ranges) {
            if (r.second == r.first) continue;
            out.push_back(Word{w.s.substr(r.first, r.second - r.first), w.at_start && first});
            first = false;
          }
          break;
        }
        case kMetaspace: {
          std::string s;
          s.reserve(w.s.size() + 8);
          for (char ch : w.s) {
            if (ch == ' ') s += replacement;
            else s.push_back(ch);
          }
          bool starts = s.compare(0, replacement.size(), replacement) == 0;
          if (!starts && (prepend_scheme == "always" || (prepend_scheme == "first" && w.at_start)))
            s.insert(0, replacement);
          if (split) {
            split_pieces(s, pattern, Behavior::MergedWithNext, false, ranges);
          } else {
            ranges.assign(1, {0, s.size()});
          }
          bool first = true;
          for (auto& r : ranges) {
            if (r.second == r.first) continue;
            out.push_back(Word{s.substr(r.first, r.second - r.first), w.at_start && first});
            first = false;
          }
          break;
        }
        case kSequence:
          break;
      }
    }
    words.swap(out);
  }
};

// ---------------------------------------------------------------------------
// Decoders. Each works on a list of token strings (bytes).
struct Decoder {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kSequence } kind;
  std::string pattern, content;  // Replace; Strip content
  size_t start = 0, stop = 0;    // Strip
  std::string replacement;       // Metaspace
  bool strip_first = true;       // Metaspace
  std::vector<std::unique_ptr<Decoder>> children;

  static std::unique_ptr<Decoder> from_json(const json& j) {
    auto d = std::make_unique<Decoder>();
    std::string t = j.value("type", "");
    if (t == "ByteLevel") {
      d->kind = kByteLevel;
    } else if (t == "Replace") {
      d->kind = kReplace;
      const json& p = j.at("pattern");
      if (!p.contains("String"))
        throw TokenizerError("tokenizer.json: Replace decoder with a regex is not supported");
      d->pattern = p["String"].get<std::string>();
      d->content = j.at("content").get<std::string>();
    } else if (t == "ByteFallback") {
      d->kind = kByteFallback;
    } else if (t == "Fuse") {
      d->kind = kFuse;
    } else if (t == "Strip") {
      d->kind = kStrip;
      d->content = j.at("content").get<std::string>();
      d->start = j.value("start", 0);
      d->stop = j.value("stop", 0);
    } else if (t == "Metaspace") {
      d->kind = kMetaspace;
      d->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
      std::string scheme = j.value("prepend_scheme", std::string());
      if (scheme.empty()) scheme = j.value("add_prefix_space", true) ? "always" : "never";
      d->strip_first = scheme != "never";
    } else if (t == "Sequence") {
      d->kind = kSequence;
      for (auto& c : j.at("decoders")) d->children.push_back(from_json(c));
    } else {
      throw TokenizerError("tokenizer.json: unsupported decoder type '" + t + "'");
    }
    return d;
  }

  // at_start: toks[0] is the first token of the whole output.
  // stream: decoding one token of a stream (the end is not known).
  void apply(std::vector<std::string>& toks, bool at_start, bool stream, bool& fused) const {
    switch (kind) {
      case kSequence:
        for (auto& c : children) c->apply(toks, at_start, stream, fused);
        return;
      case kByteLevel: {
        const ByteMap& bm = byte_map();
        for (auto& t : toks) {
          std::string out;
          out.reserve(t.size());
          bool ok = true;
          for (size_t i = 0; i < t.size();) {
            uint32_t cp = utf8_next(t, i);
            auto it = bm.dec.find(cp);
            if (it == bm.dec.end()) {
              ok = false;
              break;
            }
            out.push_back(static_cast<char>(it->second));
          }
          if (ok) t.swap(out);
        }
        return;
      }
      case kReplace:
        for (auto& t : toks) {
          if (pattern.empty()) continue;
          std::string out;
          size_t prev = 0, pos;
          while ((pos = t.find(pattern, prev)) != std::string::npos) {
            out.append(t, prev, pos - prev);
            out += content;
            prev = pos + pattern.size();
          }
          out.append(t, prev, std::string::npos);
          t.swap(out);
        }
        return;
      case kByteFallback:
        for (auto& t : toks) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            t = std::string(1, static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16)));
          }
        }
        return;
      case kFuse: {
        if (toks.size() > 1) {
          std::string all;
          for (auto& t : toks) all += t;
          toks.assign(1, all);
        }
        fused = true;
        return;
      }
      case kStrip:
        for (size_t i = 0; i < toks.size(); ++i) {
          auto& t = toks[i];
          // After a Fuse the list is one string: in a stream, only its very
          // beginning (first token) may be stripped, never its end.
          bool may_start = !fused || (i == 0 && at_start);
          bool may_stop = !(fused && stream);
          if (may_start) {
            for (size_t k = 0; k < start && t.compare(0, content.size(), content) == 0; ++k)
              t.erase(0, content.size());
          }
          if (may_stop) {
            for (size_t k = 0; k < stop && t.size() >= content.size() &&
                               t.compare(t.size() - content.size(), content.size(), content) == 0;
                 ++k)
              t.erase(t.size() - content.size());
          }
        }
        return;
      case kMetaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          auto& t = toks[i];
          std::string out;
          size_t prev = 0, pos;
          while ((pos = t.find(replacement, prev)) != std::string::npos) {
            out.append(t, prev, pos - prev);
            out += ' ';
            prev = pos + replacement.size();
          }
          out.append(t, prev, std::string::npos);
          if (i == 0 && at_start && strip_first && !out.empty() && out[0] == ' ') out.erase(0, 1);
          t.swap(out);
        }
        return;
    }
  }
};

// ---------------------------------------------------------------------------
// Post-processors (ids only; offsets and type ids are not needed here).
struct PostProcessor {
  enum Kind { kTemplate, kNoop, kWrap, kSequence } kind;
  // kTemplate: items: id >= 0 special ids to insert, or -1 for the sequence
  std::vector<std::vector<int32_t>> items;  // each: ids, or empty vector = sequence marker
  std::vector<bool> is_seq;
  std::vector<int32_t> before, after;  // kWrap (Bert/Roberta)
  std::vector<std::unique_ptr<PostProcessor>> children;

  static std::unique_ptr<PostProcessor> from_json(const json& j) {
    auto p = std::make_unique<PostProcessor>();
    std::string t = j.value("type", "");
    if (t == "TemplateProcessing") {
      p->kind = kTemplate;
      const json& specials = j.value("special_tokens", json::object());
      for (auto& item : j.at("single")) {
        if (item.contains("Sequence")) {
          p->items.emplace_back();
          p->is_seq.push_back(true);
        } else if (item.contains("SpecialToken")) {
          std::string name = item["SpecialToken"].at("id").get<std::string>();
          if (!specials.contains(name))
            throw TokenizerError("tokenizer.json: TemplateProcessing refers to unknown special token '" +
                                 name + "'");
          p->items.push_back(specials[name].at("ids").get<std::vector<int32_t>>());
          p->is_seq.push_back(false);
        } else {
          throw TokenizerError("tokenizer.json: unsupported TemplateProcessing item");
        }
      }
    } else if (t == "ByteLevel") {
      p->kind = kNoop;
    } else if (t == "BertProcessing" || t == "RobertaProcessing") {
      p->kind = kWrap;
      p->before.push_back(j.at("cls").at(1).get<int32_t>());
      p->after.push_back(j.at("sep").at(1).get<int32_t>());
    } else if (t == "Sequence") {
      p->kind = kSequence;
      for (auto& c : j.at("processors")) p->children.push_back(from_json(c));
    } else {
      throw TokenizerError("tokenizer.json: unsupported post_processor type '" + t + "'");
    }
    return p;
  }

  void apply(std::vector<int32_t>& ids) const {
    switch (kind) {
      case kNoop:
        return;
      case kSequence:
        for (auto& c : children) c->apply(ids);
        return;
      case kWrap: {
        std::vector<int32_t> out(before);
        out.insert(out.end(), ids.begin(), ids.end());
        out.insert(out.end(), after.begin(), after.end());
        ids.swap(out);
        return;
      }
      case kTemplate: {
        std::vector<int32_t> out;
        out.reserve(ids.size() + 4);
        for (size_t i = 0; i < items.size(); ++i) {
          if (is_seq[i]) out.insert(out.end(), ids.begin(), ids.end());
          else out.insert(out.end(), items[i].begin(), items[i].end());
        }
        ids.swap(out);
        return;
      }
    }
  }

  int32_t leading_special() const {
    if (kind == kTemplate && !items.empty() && !is_seq[0] && !items[0].empty()) return items[0][0];
    if (kind == kWrap && !before.empty()) return before[0];
    if (kind == kSequence) {
      for (auto& c : children) {
        int32_t b = c->leading_special();
        if (b >= 0) return b;
      }
    }
    return -1;
  }
};

struct AddedToken {
  std::string content;
  std::string decoded;  // what id_to_token/decode give: the normalized content if normalized
  int32_t id;
  bool special, normalized, lstrip, rstrip, single_word;
};

// Byte trie over added-token contents, for leftmost-longest matching.
class AddedTrie {
 public:
  void add(const std::string& s, int token_index) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      uint64_t key = (static_cast<uint64_t>(node) << 8) | c;
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        terminal_.push_back(-1);
        int nn = static_cast<int>(terminal_.size()) - 1;
        edges_.emplace(key, nn);
        node = nn;
      } else {
        node = it->second;
      }
    }
    if (terminal_[node] < 0) terminal_[node] = token_index;
    first_[static_cast<unsigned char>(s[0])] = true;
    any_ = true;
  }
  bool empty() const { return !any_; }
  // Longest token starting at s[i]: returns (token index, length) or (-1, 0).
  std::pair<int, size_t> longest_at(std::string_view s, size_t i) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return {-1, 0};
    int node = 0, best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < s.size(); ++k) {
      auto it = edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[k]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] >= 0) {
        best = terminal_[node];
        best_len = k + 1 - i;
      }
    }
    return {best, best_len};
  }

 private:
  std::unordered_map<uint64_t, int> edges_;
  std::vector<int> terminal_{-1};
  bool first_[256] = {};
  bool any_ = false;
};

// Read-only view of a whole file (mmap).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY);
    if (fd_ < 0)
      throw TokenizerError("cannot open tokenizer file '" + path + "': " + std::strerror(errno));
    struct stat st;
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode))
      throw TokenizerError("'" + path + "' is not a regular file");
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) throw TokenizerError("tokenizer file '" + path + "' is empty");
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd_, 0);
    if (p == MAP_FAILED)
      throw TokenizerError("cannot map tokenizer file '" + path + "': " + std::strerror(errno));
    data_ = static_cast<const char*>(p);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<char*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  int fd_ = -1;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------

struct Tokenizer::Impl {
  // model
  std::vector<std::string> vocab_str;  // by id
  std::vector<uint8_t> vocab_present;
  VocabMap vocab;
  MergeMap merges;
  size_t n_merges = 0;
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_ids[256];
  // pipeline
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  // added tokens
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, int> added_by_id;  // id -> index in `added`
  AddedTrie trie_raw, trie_norm;
  int64_t size = 0;
  double load_s = 0;

  struct Piece {
    std::string text;
    int32_t id;  // >= 0: an added token
    bool at_start;
  };

  void split_added(const std::string& s, const AddedTrie& trie, bool at_start,
                   std::vector<Piece>& out) const {
    if (trie.empty() || s.empty()) {
      out.push_back(Piece{s, -1, at_start});
      return;
    }
    size_t start_offset = 0;
    size_t i = 0;
    while (i < s.size()) {
      auto [tok, len] = trie.longest_at(s, i);
      if (tok < 0) {
        ++i;
        continue;
      }
      const AddedToken& at = added[tok];
      size_t start = i, stop = i + len;
      if (at.single_word) {
        bool ok_left = true, ok_right = true;
        if (start > 0) {
          size_t k = start - 1;
          while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          size_t kk = k;
          ok_left = !is_word_cp(utf8_next(s, kk));
        }
        if (stop < s.size()) {
          size_t kk = stop;
          ok_right = !is_word_cp(utf8_next(s, kk));
        }
        if (!ok_left || !ok_right) {
          i += len;  // like HF: the search resumes after the rejected match
          continue;
        }
      }
      if (at.lstrip) {
        size_t ns = start;
        while (ns > start_offset) {
          size_t k = ns - 1;
          while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          size_t kk = k;
          if (!is_unicode_space(utf8_next(s, kk))) break;
          ns = k;
        }
        start = ns;
      }
      if (at.rstrip) {
        while (stop < s.size()) {
          size_t kk = stop;
          if (!is_unicode_space(utf8_next(s, kk))) break;
          stop = kk;
        }
      }
      if (start_offset < start)
        out.push_back(Piece{s.substr(start_offset, start - start_offset), -1,
                            at_start && start_offset == 0});
      out.push_back(Piece{std::string(), at.id, false});
      start_offset = stop;
      i = std::max(stop, i + len);
    }
    if (start_offset < s.size())
      out.push_back(Piece{s.substr(start_offset), -1, at_start && start_offset == 0});
  }

  void bpe_word(const std::string& w, std::vector<int32_t>& out) const {
    if (w.empty()) return;
    if (ignore_merges) {
      int32_t id = vocab.find(w);
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    struct Sym {
      int32_t id;
      int32_t prev, next;
      int32_t len;
    };
    std::vector<Sym> syms;
    syms.reserve(w.size());
    auto push = [&](int32_t id, int32_t len) {
      int32_t n = static_cast<int32_t>(syms.size());
      syms.push_back(Sym{id, n - 1, -1, len});
      if (n > 0) syms[n - 1].next = n;
    };
    int32_t pending_unk_len = 0;
    bool have_unk = false;
    for (size_t i = 0; i < w.size();) {
      size_t l = utf8_lead_len(static_cast<unsigned char>(w[i]));
      if (i + l > w.size()) l = w.size() - i;
      std::string_view ch(w.data() + i, l);
      int32_t id = vocab.find(ch);
      if (id >= 0) {
        if (have_unk) {
          push(unk_id, pending_unk_len);
          have_unk = false;
        }
        push(id, static_cast<int32_t>(l));
      } else {
        bool done = false;
        if (byte_fallback) {
          bool all = true;
          for (size_t k = 0; k < l; ++k)
            if (byte_ids[static_cast<unsigned char>(ch[k])] < 0) all = false;
          if (all) {
            for (size_t k = 0; k < l; ++k) push(byte_ids[static_cast<unsigned char>(ch[k])], 1);
            done = true;
          }
        }
        if (!done && unk_id >= 0) {
          if (have_unk && fuse_unk) {
            pending_unk_len += static_cast<int32_t>(l);
          } else {
            if (have_unk) push(unk_id, pending_unk_len);
            have_unk = true;
            pending_unk_len = static_cast<int32_t>(l);
          }
        }
      }
      i += l;
    }
    if (have_unk) push(unk_id, pending_unk_len);
    if (syms.empty()) return;

    struct Cand {
      int32_t rank, pos, new_id;
    };
    auto cmp = [](const Cand& a, const Cand& b) {
      if (a.rank != b.rank) return a.rank > b.rank;
      return a.pos > b.pos;
    };
    std::vector<Cand> heap;
    heap.reserve(syms.size());
    for (size_t i = 0; i + 1 < syms.size(); ++i) {
      if (auto m = merges.find(pair_key(syms[i].id, syms[i + 1].id)))
        heap.push_back(Cand{m->rank, static_cast<int32_t>(i), m->id});
    }
    std::make_heap(heap.begin(), heap.end(), cmp);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), cmp);
      Cand top = heap.back();
      heap.pop_back();
      Sym& left = syms[top.pos];
      if (left.len == 0 || left.next < 0) continue;
      int32_t rpos = left.next;
      Sym& right = syms[rpos];
      auto m = merges.find(pair_key(left.id, right.id));
      if (!m || m->id != top.new_id) continue;
      left.id = top.new_id;
      left.len += right.len;
      left.next = right.next;
      right.len = 0;
      if (left.next >= 0) syms[left.next].prev = top.pos;
      if (left.prev >= 0) {
        if (auto pm = merges.find(pair_key(syms[left.prev].id, left.id))) {
          heap.push_back(Cand{pm->rank, left.prev, pm->id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
      if (left.next >= 0) {
        if (auto nm = merges.find(pair_key(left.id, syms[left.next].id))) {
          heap.push_back(Cand{nm->rank, top.pos, nm->id});
          std::push_heap(heap.begin(), heap.end(), cmp);
        }
      }
    }
    for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
  }

  std::string token_str(int32_t id, bool* known) const {
    auto it = added_by_id.find(id);
    if (it != added_by_id.end()) {
      *known = true;
      return added[it->second].decoded;
    }
    if (id >= 0 && static_cast<size_t>(id) < vocab_str.size() && vocab_present[id]) {
      *known = true;
      return vocab_str[id];
    }
    *known = false;
    return std::string();
  }

  void load(const std::string& path);
};

void Tokenizer::Impl::load(const std::string& path) {
  const bool prof = std::getenv("LLMRT_TOKENIZER_PROFILE") != nullptr;
  auto tp = std::chrono::steady_clock::now();
  auto phase = [&](const char* what) {
    if (!prof) return;
    auto now = std::chrono::steady_clock::now();
    std::fprintf(stderr, "[tokenizer profile] %-10s %.1f ms\n", what,
                 std::chrono::duration<double, std::milli>(now - tp).count());
    tp = now;
  };
  MappedFile file(path);
  const char* data = file.data();
  const size_t data_size = file.size();
  phase("map");
  // One pass over the file: model.vocab and model.merges (by far the largest
  // parts) are parsed here directly; everything else is skipped and later
  // parsed by nlohmann::json with those two values cut out.
  fj::Cur c{data, data + data_size, data};
  const char *vb = nullptr, *ve = nullptr, *mb = nullptr, *me = nullptr;
  std::vector<std::pair<std::string, int64_t>> entries;
  std::string merge_text;            // "a" then "b" for every merge, back to back
  std::vector<uint32_t> merge_lens;  // len(a), len(b) for every merge
  auto parse_vocab = [&]() {
    fj::expect(c, '{');
    fj::ws(c);
    if (c.p < c.e && *c.p == '}') {
      ++c.p;
      return;
    }
    std::string s;
    for (;;) {
      fj::read_string(c, s);
      fj::expect(c, ':');
      int64_t id = fj::read_int(c);
      if (id < 0 || id > (int64_t(1) << 30)) fj::fail(c, "vocab id out of range");
      entries.emplace_back(s, id);
      if (!fj::next_or_close(c, '}')) break;
    }
  };
  auto parse_merges = [&]() {
    fj::expect(c, '[');
    fj::ws(c);
    if (c.p < c.e && *c.p == ']') {
      ++c.p;
      return;
    }
    std::string a, b;
    for (;;) {
      fj::ws(c);
      if (c.p < c.e && *c.p == '"') {
        fj::read_string(c, a);
        size_t sp = a.find(' ');
        if (sp == std::string::npos) fj::fail(c, "merge without a space");
        b.assign(a, sp + 1, std::string::npos);
        a.resize(sp);
      } else {
        fj::expect(c, '[');
        fj::read_string(c, a);
        fj::expect(c, ',');
        fj::read_string(c, b);
        fj::expect(c, ']');
      }
      merge_text += a;
      merge_text += b;
      merge_lens.push_back(static_cast<uint32_t>(a.size()));
      merge_lens.push_back(static_cast<uint32_t>(b.size()));
      if (!fj::next_or_close(c, ']')) break;
    }
  };
  std::string key;
  fj::expect(c, '{');
  fj::ws(c);
  if (c.p < c.e && *c.p == '}') {
    ++c.p;
  } else {
    for (;;) {
      fj::read_string(c, key);
      fj::expect(c, ':');
      fj::ws(c);
      if (key == "model" && c.p < c.e && *c.p == '{') {
        ++c.p;
        fj::ws(c);
        if (c.p < c.e && *c.p == '}') {
          ++c.p;
        } else {
          std::string mkey;
          for (;;) {
            fj::read_string(c, mkey);
            fj::expect(c, ':');
            fj::ws(c);
            const char* b = c.p;
            if (mkey == "vocab" && c.p < c.e && *c.p == '{') {
              parse_vocab();
              vb = b;
              ve = c.p;
            } else if (mkey == "merges" && c.p < c.e && *c.p == '[') {
              merge_text.reserve(static_cast<size_t>(data_size / 4));
              parse_merges();
              mb = b;
              me = c.p;
            } else {
              fj::skip_value(c);
            }
            if (!fj::next_or_close(c, '}')) break;
          }
        }
      } else {
        fj::skip_value(c);
      }
      if (!fj::next_or_close(c, '}')) break;
    }
  }
  phase("scan");
  // Everything but the two big values goes through nlohmann::json.
  std::string rest;
  {
    std::vector<std::pair<const char*, const char*>> cuts;
    if (vb) cuts.push_back({vb, ve});
    if (mb) cuts.push_back({mb, me});
    std::sort(cuts.begin(), cuts.end());
    size_t cut_bytes = 0;
    for (auto& cut : cuts) cut_bytes += cut.second - cut.first;
    rest.reserve(data_size - cut_bytes + 8);
    const char* p = data;
    for (auto& cut : cuts) {
      rest.append(p, cut.first - p);
      rest += (*cut.first == '{') ? "{}" : "[]";
      p = cut.second;
    }
    rest.append(p, data + data_size - p);
  }
  json j;
  try {
    j = json::parse(rest);
  } catch (const std::exception& e) {
    throw TokenizerError("tokenizer.json '" + path + "' is not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw TokenizerError("tokenizer.json '" + path + "' has no 'model' object");
  phase("json");
  const json& model = j["model"];
  std::string type = model.value("type", std::string(mb ? "BPE" : ""));
  if (type != "BPE")
    throw TokenizerError("tokenizer.json: model type '" + type +
                         "' is not supported (only BPE models are)");
  if (!vb) throw TokenizerError("tokenizer.json: model.vocab is missing");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0)
    throw TokenizerError("tokenizer.json: BPE dropout is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(k) && model[k].is_string() && !model[k].get<std::string>().empty())
      throw TokenizerError(std::string("tokenizer.json: BPE ") + k + " is not supported");
  }
  byte_fallback = model.value("byte_fallback", false);
  ignore_merges = model.value("ignore_merges", false);
  fuse_unk = model.value("fuse_unk", false);

  // vocab
  {
    int64_t max_id = -1;
    for (auto& e : entries) max_id = std::max(max_id, e.second);
    vocab_str.assign(static_cast<size_t>(max_id + 1), std::string());
    vocab_present.assign(static_cast<size_t>(max_id + 1), 0);
    for (auto& e : entries) {
      vocab_str[e.second] = std::move(e.first);
      vocab_present[e.second] = 1;
    }
    std::vector<std::pair<std::string, int64_t>>().swap(entries);
    vocab.build(&vocab_str, &vocab_present);
    size = max_id + 1;
  }
  phase("vocab");
  // merges: (id(a), id(b)) -> (rank, id(a+b)); a later duplicate overrides
  // an earlier one (as HF's HashMap collect does). Resolved in batches so the
  // hash-table lookups overlap.
  {
    n_merges = merge_lens.size() / 2;
    merges.reserve(n_merges);
    constexpr size_t kBatch = 256;
    std::vector<std::string> ab(kBatch);
    std::string_view keys[3 * kBatch];
    size_t hashes[3 * kBatch];
    int32_t ids[3 * kBatch];
    size_t off = 0;
    for (size_t base = 0; base < n_merges; base += kBatch) {
      size_t m = std::min(kBatch, n_merges - base);
      for (size_t k = 0; k < m; ++k) {
        size_t r = base + k;
        std::string_view a(merge_text.data() + off, merge_lens[2 * r]);
        off += a.size();
        std::string_view b(merge_text.data() + off, merge_lens[2 * r + 1]);
        off += b.size();
        // a and b are adjacent in merge_text, so a+b is a view too.
        std::string_view both(a.data(), a.size() + b.size());
        uint64_t ha = VocabMap::fnv_extend(VocabMap::kFnvBasis, a);
        keys[3 * k] = a;
        keys[3 * k + 1] = b;
        keys[3 * k + 2] = both;
        hashes[3 * k] = VocabMap::finalize(ha);
        hashes[3 * k + 1] = VocabMap::finalize(VocabMap::fnv_extend(VocabMap::kFnvBasis, b));
        hashes[3 * k + 2] = VocabMap::finalize(VocabMap::fnv_extend(ha, b));
      }
      vocab.find_batch(keys, hashes, 3 * m, ids);
      for (size_t k = 0; k < m; ++k) {
        int32_t ia = ids[3 * k], ib = ids[3 * k + 1], iab = ids[3 * k + 2];
        if (ia >= 0 && ib >= 0 && iab >= 0)
          merges.insert_or_assign(pair_key(ia, ib), MergeVal{static_cast<int32_t>(base + k), iab});
      }
    }
  }
  phase("merges");
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    byte_ids[b] = vocab.find(name);
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    unk_id = vocab.find(model["unk_token"].get<std::string>());
  }

  // added tokens
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (auto& t : j["added_tokens"]) {
      AddedToken at;
      at.content = t.at("content").get<std::string>();
      at.id = t.at("id").get<int32_t>();
      at.special = t.value("special", false);
      at.normalized = t.value("normalized", !at.special);
      at.lstrip = t.value("lstrip", false);
      at.rstrip = t.value("rstrip", false);
      at.single_word = t.value("single_word", false);
      if (at.id < 0) throw TokenizerError("tokenizer.json: negative added token id");
      size = std::max<int64_t>(size, int64_t(at.id) + 1);
      added_by_content.emplace(at.content, at.id);
      added_by_id[at.id] = static_cast<int>(added.size());
      added.push_back(std::move(at));
    }
  }

  if (j.contains("normalizer") && !j["normalizer"].is_null())
    normalizer = Normalizer::from_json(j["normalizer"]);
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null())
    pre_tokenizer = PreTokenizer::from_json(j["pre_tokenizer"]);
  if (j.contains("post_processor") && !j["post_processor"].is_null())
    post_processor = PostProcessor::from_json(j["post_processor"]);
  if (j.contains("decoder") && !j["decoder"].is_null()) decoder = Decoder::from_json(j["decoder"]);

  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& at = added[i];
    AddedToken& at_mut = added[i];
    at_mut.decoded = at.content;
    if (at.normalized) {
      std::string content = at.content;
      if (normalizer) normalizer->apply(content);
      trie_norm.add(content, static_cast<int>(i));
      at_mut.decoded = content;  // HF (0.2x) decodes a normalized added token as its normalized form
    } else {
      trie_raw.add(at.content, static_cast<int>(i));
    }
  }
  phase("rest");
}

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_file(const std::string& path) {
  auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  try {
    tok->impl_->load(path);
  } catch (const TokenizerError&) {
    throw;
  } catch (const std::exception& e) {
    throw TokenizerError("cannot load tokenizer '" + path + "': " + e.what());
  }
  tok->impl_->load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return tok;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text_in, bool add_special_tokens) const {
  const Impl& m = *impl_;
  std::string text = utf8_is_valid(text_in) ? std::string(text_in) : utf8_sanitize(text_in);
  std::vector<Impl::Piece> raw;
  m.split_added(text, m.trie_raw, true, raw);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<Impl::Piece> norm;
  std::vector<Word> words;
  for (auto& p : raw) {
    if (p.id >= 0) {
      ids.push_back(p.id);
      continue;
    }
    std::string s = std::move(p.text);
    if (m.normalizer) m.normalizer->apply(s);
    norm.clear();
    m.split_added(s, m.trie_norm, p.at_start, norm);
    for (auto& q : norm) {
      if (q.id >= 0) {
        ids.push_back(q.id);
        continue;
      }
      if (q.text.empty()) continue;
      words.clear();
      words.push_back(Word{std::move(q.text), q.at_start});
      if (m.pre_tokenizer) m.pre_tokenizer->apply(words);
      for (auto& w : words) m.bpe_word(w.s, ids);
    }
  }
  if (add_special_tokens && m.post_processor) m.post_processor->apply(ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bool known = false;
    std::string s = m.token_str(id, &known);
    if (known) toks.push_back(std::move(s));
  }
  if (!m.decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) {
      if (i) out += ' ';
      out += toks[i];
    }
    return out;
  }
  bool fused = false;
  m.decoder->apply(toks, true, false, fused);
  std::string out;
  for (auto& t : toks) out += t;
  return out;
}

std::string Tokenizer::decode_token(int32_t id, bool first) const {
  const Impl& m = *impl_;
  bool known = false;
  std::string s = m.token_str(id, &known);
  if (!known) return std::string();
  if (!m.decoder) return first ? s : " " + s;
  std::vector<std::string> toks{std::move(s)};
  bool fused = false;
  m.decoder->apply(toks, first, true, fused);
  std::string out;
  for (auto& t : toks) out += t;
  return out;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(std::string(token));
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->vocab.find(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  bool known = false;
  return impl_->token_str(id, &known);
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

int64_t Tokenizer::vocab_size() const { return impl_->size; }

int32_t Tokenizer::bos_id() const {
  return impl_->post_processor ? impl_->post_processor->leading_special() : -1;
}

double Tokenizer::load_seconds() const { return impl_->load_s; }
size_t Tokenizer::num_merges() const { return impl_->n_merges; }

}  // namespace llmrt
