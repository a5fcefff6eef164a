// Decoders: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence.
#include <cctype>

#include <nlohmann/json.hpp>

#include "tokenizer/components.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace llmrt::tokenizer_detail {

std::unique_ptr<Decoder> Decoder::from_json(const json& j, int depth) {
  check_nesting(depth, "decoder");
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
    // HF strips at most this many copies; a huge count of an empty content would spin for ever
    d->start = static_cast<size_t>(json_int(j, "start", 0, "Strip decoder start", 0, 1 << 16));
    d->stop = static_cast<size_t>(json_int(j, "stop", 0, "Strip decoder stop", 0, 1 << 16));
  } else if (t == "Metaspace") {
    d->kind = kMetaspace;
    d->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    if (d->replacement.empty()) throw TokenizerError("tokenizer.json: Metaspace decoder with an empty replacement");
    std::string scheme = j.value("prepend_scheme", std::string());
    if (scheme.empty()) scheme = j.value("add_prefix_space", true) ? "always" : "never";
    d->strip_first = scheme != "never";
  } else if (t == "Sequence") {
    d->kind = kSequence;
    for (auto& c : j.at("decoders")) d->children.push_back(from_json(c, depth + 1));
  } else {
    throw TokenizerError("tokenizer.json: unsupported decoder type '" + t + "'");
  }
  return d;
}

void Decoder::apply(std::vector<std::string>& toks, bool at_start, bool stream, bool& fused) const {
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
      if (content.empty()) return;  // nothing to strip (and no progress to make)
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

}  // namespace llmrt::tokenizer_detail
