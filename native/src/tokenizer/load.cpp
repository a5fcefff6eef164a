// Tokenizer::Impl::load: tokenizer.json -> the model, its steps and the added tokens.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "tokenizer/json_scan.h"
#include "tokenizer/tokenizer_impl.h"

namespace llmrt {

using namespace tokenizer_detail;

namespace {

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
    // The tables below are indexed by id: a damaged id (say 2^30 among 100 entries) would ask for
    // gigabytes. Real vocabularies are dense (ids 0..N-1), so allow gaps but not that.
    const int64_t id_limit = 2 * static_cast<int64_t>(entries.size()) + 1024;
    if (max_id >= id_limit)
      throw TokenizerError("tokenizer.json: model.vocab has id " + std::to_string(max_id) + " for " +
                           std::to_string(entries.size()) + " entries (ids must be below " +
                           std::to_string(id_limit) + "; damaged file?)");
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
      at.id = static_cast<int32_t>(json_int(t.at("id"), "added token id", 0, INT32_MAX));
      at.special = t.value("special", false);
      at.normalized = t.value("normalized", !at.special);
      at.lstrip = t.value("lstrip", false);
      at.rstrip = t.value("rstrip", false);
      at.single_word = t.value("single_word", false);
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
  // the ids a template inserts go into the prompt: they must be ids of this tokenizer
  if (post_processor && post_processor->largest_id() >= size)
    throw TokenizerError("tokenizer.json: post_processor inserts id " + std::to_string(post_processor->largest_id()) +
                         ", outside the vocabulary of " + std::to_string(size) + " ids");

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

}  // namespace llmrt
