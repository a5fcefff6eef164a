// HF tokenizer.json reader: see tokenizer.h for what is supported, tokenizer_impl.h for the files.
#include "tokenizer/tokenizer.h"

#include <chrono>
#include <memory>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"

namespace llmrt {

using namespace tokenizer_detail;

std::string Tokenizer::Impl::token_str(int32_t id, bool* known) const {
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
  std::vector<Piece> raw;
  split_added(text, m.trie_raw, m.added, true, raw);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<Piece> norm;
  std::vector<Word> words;
  for (auto& p : raw) {
    if (p.id >= 0) {
      ids.push_back(p.id);
      continue;
    }
    std::string s = std::move(p.text);
    if (m.normalizer) m.normalizer->apply(s);
    norm.clear();
    split_added(s, m.trie_norm, m.added, p.at_start, norm);
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
