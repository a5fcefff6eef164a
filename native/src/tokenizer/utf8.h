// Small UTF-8 helpers shared by the tokenizer and the runner.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace llmrt {

// Length of the sequence announced by a lead byte (1 for ASCII and for invalid
// lead bytes, so that a caller always makes progress).
inline size_t utf8_lead_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is invalid
// (bad lead byte, truncated, bad continuation, overlong, surrogate, > U+10FFFF).
inline size_t utf8_valid_len(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size();
  unsigned char c = p[i];
  if (c < 0x80) return 1;
  if (c < 0xC2) return 0;
  if (c < 0xE0) {
    if (i + 1 >= n || (p[i + 1] & 0xC0) != 0x80) return 0;
    return 2;
  }
  if (c < 0xF0) {
    if (i + 2 >= n) return 0;
    unsigned char c1 = p[i + 1], c2 = p[i + 2];
    if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80) return 0;
    if (c == 0xE0 && c1 < 0xA0) return 0;   // overlong
    if (c == 0xED && c1 >= 0xA0) return 0;  // surrogates
    return 3;
  }
  if (c < 0xF5) {
    if (i + 3 >= n) return 0;
    unsigned char c1 = p[i + 1], c2 = p[i + 2], c3 = p[i + 3];
    if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80) return 0;
    if (c == 0xF0 && c1 < 0x90) return 0;   // overlong
    if (c == 0xF4 && c1 >= 0x90) return 0;  // > U+10FFFF
    return 4;
  }
  return 0;
}

inline bool utf8_is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t l = utf8_valid_len(s, i);
    if (l == 0) return false;
    i += l;
  }
  return true;
}

// Replaces every invalid byte with U+FFFD (like Python's errors="replace").
inline std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t l = utf8_valid_len(s, i);
    if (l == 0) {
      out += "\xEF\xBF\xBD";
      i += 1;
    } else {
      out.append(s.data() + i, l);
      i += l;
    }
  }
  return out;
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes the code point at s[i] (which must be valid), advancing i.
inline uint32_t utf8_next(std::string_view s, size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  unsigned char c = p[i];
  size_t l = utf8_lead_len(c);
  if (i + l > s.size()) l = 1;
  uint32_t cp;
  switch (l) {
    case 1: cp = c; break;
    case 2: cp = ((c & 0x1F) << 6) | (p[i + 1] & 0x3F); break;
    case 3: cp = ((c & 0x0F) << 12) | ((p[i + 1] & 0x3F) << 6) | (p[i + 2] & 0x3F); break;
    default:
      cp = ((c & 0x07) << 18) | ((p[i + 1] & 0x3F) << 12) | ((p[i + 2] & 0x3F) << 6) |
           (p[i + 3] & 0x3F);
  }
  i += l;
  return cp;
}

// Streaming printer: feed raw bytes (possibly splitting a multibyte character
// across calls); take() returns the longest complete, printable prefix and
// keeps an incomplete trailing sequence for the next call. Bytes that can never
// become valid UTF-8 are replaced with U+FFFD.
class Utf8Stream {
 public:
  std::string push(std::string_view bytes) {
    pending_.append(bytes.data(), bytes.size());
    std::string out;
    size_t i = 0;
    while (i < pending_.size()) {
      size_t l = utf8_valid_len(pending_, i);
      if (l > 0) {
        out.append(pending_, i, l);
        i += l;
        continue;
      }
      // Invalid here: is it a valid but incomplete prefix at the end?
      size_t need = utf8_lead_len(static_cast<unsigned char>(pending_[i]));
      if (need > 1 && i + need > pending_.size() && prefix_ok(i)) break;
      out += "\xEF\xBF\xBD";
      i += 1;
    }
    pending_.erase(0, i);
    return out;
  }
  // Flush whatever is left (an incomplete sequence becomes U+FFFD).
  std::string finish() {
    std::string out;
    for (size_t k = 0; k < pending_.size(); ++k) out += "\xEF\xBF\xBD";
    pending_.clear();
    return out;
  }
  void reset() { pending_.clear(); }

 private:
  bool prefix_ok(size_t i) const {
    const auto* p = reinterpret_cast<const unsigned char*>(pending_.data());
    unsigned char c = p[i];
    if (c < 0xC2 || c > 0xF4) return false;
    for (size_t k = i + 1; k < pending_.size(); ++k) {
      if ((p[k] & 0xC0) != 0x80) return false;
    }
    if (i + 1 < pending_.size()) {
      unsigned char c1 = p[i + 1];
      if (c == 0xE0 && c1 < 0xA0) return false;
      if (c == 0xED && c1 >= 0xA0) return false;
      if (c == 0xF0 && c1 < 0x90) return false;
      if (c == 0xF4 && c1 >= 0x90) return false;
    }
    return true;
  }
  std::string pending_;
};

}  // namespace llmrt
