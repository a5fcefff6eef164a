// The BPE model over one pre-tokenized word: characters (byte fallback / unk for the unknown ones),
// then the lowest-ranked merge first until none applies.
#include <algorithm>
#include <string_view>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/utf8.h"

namespace llmrt {

using tokenizer_detail::pair_key;

void Tokenizer::Impl::bpe_word(const std::string& w, std::vector<int32_t>& out) const {
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

}  // namespace llmrt
