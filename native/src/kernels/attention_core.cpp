// The attention core: every query row of a step's segments, every head, over its visible keys (kv_attention.h's
// attend_segments). Compiled once per ISA path (native/CMakeLists.txt, kernels/isa.h) in namespace LLMPIPE_ISA_NS,
// each copy with its path's simd_math.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/cores.h"
#include "kernels/kv_attention.h"
#include "kernels/kv_rows.h"
#include "kernels/simd_math.h"

namespace llmrt::kv::LLMPIPE_ISA_NS {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;

// One storage row (D elements of type code `dtype`) as fp32: the row itself when stored as fp32, else
// converted into buf (a quantized row: its values times their group's scale, as the Python twin dequantizes; an
// int4 row stays in its rotated basis).
inline const float* as_float(const uint8_t* row, int dtype, int64_t D, float* buf) {
  switch (dtype) {
    case kFloat: return reinterpret_cast<const float*>(row);
    case kChar:
      simd::to_float_row<simd::I8Rows>(reinterpret_cast<const int8_t*>(row + scale_bytes(kChar, D)), buf, D);
      return buf;
    case kByte: simd::to_float_row<simd::I4Rows>(row + scale_bytes(kByte, D), buf, D); return buf;
    case kHalf: simd::to_float_row<simd::F16Rows>(reinterpret_cast<const uint16_t*>(row), buf, D); return buf;
    default: simd::to_float_row<simd::BF16Rows>(reinterpret_cast<const uint16_t*>(row), buf, D); return buf;
  }
}

constexpr int64_t kBlock = 32;  // keys per block of scores (online softmax)
constexpr int kMaxSplits = 64;  // key splits of one query row (attend_segments)
// Keys per split for a query row of a few-row step (a decode step, a speculative verify): its keys are shared out
// so every thread has work, and the splits merged after. A row's splits depend only on its own visible keys, never on
// the thread count, the other rows of its step or the other segments: a row computes the same bits alone, in a verify
// step of up to kSplitRows rows, batched, on any pool (speculation's greedy tokens equal plain decoding's).
constexpr int64_t kSplitKeys = 128;
constexpr int64_t kSplitRows = 4;  // query rows up to which a segment splits its keys

// sc[h * kBlock + j] = q_h . k[j] for the group's heads and four keys (rows of storage type R), a few heads per pass
template <class R = simd::F32Rows>
void scores(const float* qs, int64_t group, int64_t D, const typename R::E* const* k, float* sc) {
  int64_t h = 0;
  for (; h + 3 <= group; h += 3) simd::dot4_heads<3, R>(qs + h * D, D, k, sc + h * kBlock, kBlock);
  if (group - h == 2) simd::dot4_heads<2, R>(qs + h * D, D, k, sc + h * kBlock, kBlock);
  if (group - h == 1) simd::dot4_heads<1, R>(qs + h * D, D, k, sc + h * kBlock, kBlock);
}

// acc[h][:] += sum_j w[h][j] v[j] for the group's heads over nb rows, a few heads per pass
template <class R = simd::F32Rows>
void weighted_sum(float* acc, int64_t Dv, const float* w, int64_t group, const typename R::E* const* v, int64_t nb) {
  int64_t h = 0;
  for (; h + 4 <= group; h += 4)
    simd::accumulate_rows_heads<4, 2, R>(acc + h * Dv, Dv, w + h * kBlock, kBlock, v, nb, Dv);
  if (group - h == 3) simd::accumulate_rows_heads<3, 2, R>(acc + h * Dv, Dv, w + h * kBlock, kBlock, v, nb, Dv);
  if (group - h == 2) simd::accumulate_rows_heads<2, 4, R>(acc + h * Dv, Dv, w + h * kBlock, kBlock, v, nb, Dv);
  if (group - h == 1) simd::accumulate_rows_heads<1, 4, R>(acc + h * Dv, Dv, w + h * kBlock, kBlock, v, nb, Dv);
}

// What one work unit leaves for its row: the running max and sum of its softmax and the unnormalized output,
// per query head.
struct Partial {
  float* m;    // [Hq]
  float* l;    // [Hq]
  float* acc;  // [Hq][Dv]
};

// Asks for the cache lines of `bytes` bytes at p, to be read soon.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o, 0, 3);
}

// The attention of query row i of segment g, every query head, over the visible keys of split `split` of
// `splits` (an equal share of the visible range), online softmax in blocks of keys. A block is read slot by slot
// for every KV head in turn; each K/V row is read in its storage type R, converted in registers, once for the
// query heads of its group.
//
// A decode step reads each K/V row once, from memory: the rows are asked for a block ahead, a few while each
// group of four keys is scored, so the loads overlap the arithmetic (attention_bench --cold, SmolLM2 at depth 447,
// fp16 K/V, one thread: ~1.2x faster than reading the whole split first, which waits for memory, then computes).
template <class R>
void attend_unit(const Segment& g, const Tensor& q, int64_t Ttot, float scale, int64_t i, int split, int splits,
                 Partial part, std::vector<float>& scratch) {
  using E = typename R::E;
  const SlotView& s = g.view;
  const int64_t D = s.head_dim, Dv = s.v_dim, Hq = q.size(1), Hkv = s.kv_heads, group = Hq / Hkv;
  const int64_t kstride = s.slot_stride(D), vstride = s.slot_stride(Dv);  // bytes
  const int64_t khead = s.head_stride(D), vhead = s.head_stride(Dv);
  const int64_t kbytes = s.row(D), vbytes = s.row(Dv);
  const int64_t kvals = s.values_offset(D), vvals = s.values_offset(Dv);  // a quantized row's scales come first
  const int64_t qpos = g.pos + i;
  int64_t lo = g.base;  // visible logical keys [lo, qpos]
  if (s.window > 0) lo = std::max(lo, qpos - s.window + 1);
  const int64_t n = qpos - lo + 1, per = (n + splits - 1) / splits;
  const int64_t k0 = lo + std::min<int64_t>(n, per * split), k1 = lo + std::min<int64_t>(n, per * (split + 1));
  // scratch: queries [Hq][D], scores [group][kBlock]
  scratch.resize(static_cast<size_t>(Hq * D + group * kBlock));
  float* qs = scratch.data();
  float* sc = qs + Hq * D;
  const void* qd = q.const_data_ptr();
  const ScalarType qt = q.scalar_type();
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t row = h * Ttot + g.row0 + i;
    if (qt == ScalarType::Float) {
      const float* qf = static_cast<const float*>(qd) + row * D;
      for (int64_t d = 0; d < D; ++d) qs[h * D + d] = qf[d] * scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qs[h * D + d] = load(qd, qt, row * D + d) * scale;
    }
    if (rotated(s.dtype)) hadamard_rows(qs + h * D, D);  // into the keys' basis
    part.m[h] = -INFINITY;
    part.l[h] = 0.f;
  }
  std::fill(part.acc, part.acc + Hq * Dv, 0.f);
  const int64_t* slots = g.read;  // slots[key - base]: the key's physical slot
  auto krow = [&](int64_t key, int64_t kh) {
    return reinterpret_cast<const E*>(s.k + slots[key - g.base] * kstride + kh * khead + kvals);
  };
  auto vrow = [&](int64_t key, int64_t kh) {
    return reinterpret_cast<const E*>(s.v + slots[key - g.base] * vstride + kh * vhead + vvals);
  };
  auto ask = [&](int64_t key, int64_t kh) {  // the key's K and V rows of KV head kh, to be read soon
    prefetch(reinterpret_cast<const uint8_t*>(krow(key, kh)) - kvals, kbytes);
    prefetch(reinterpret_cast<const uint8_t*>(vrow(key, kh)) - vvals, vbytes);
  };
  for (int64_t key = k0; key < std::min(k1, k0 + kBlock); ++key)  // the first block
    for (int64_t kh = 0; kh < Hkv; ++kh) ask(key, kh);
  const E* krows[kBlock];
  const E* vrows[kBlock];
  for (int64_t b0 = k0; b0 < k1; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, k1 - b0), next = b0 + kBlock;
    const int64_t n_next = std::clamp<int64_t>(k1 - next, 0, kBlock);  // keys of the next block
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      const int64_t h0 = kh * group;  // the group's first query head
      for (int64_t j = 0; j < nb; ++j) {
        krows[j] = krow(b0 + j, kh);
        vrows[j] = vrow(b0 + j, kh);
      }
      const float* qg = qs + h0 * D;
      int64_t j = 0;
      for (; j + 4 <= nb; j += 4) {
        for (int64_t t = j; t < std::min(j + 4, n_next); ++t) ask(next + t, kh);
        scores<R>(qg, group, D, krows + j, sc + j);
      }
      for (; j < nb; ++j)
        for (int64_t h = 0; h < group; ++h) sc[h * kBlock + j] = simd::dot<R>(qg + h * D, krows[j], D);
      for (int64_t h = 0; h < group; ++h) {
        float* sh = sc + h * kBlock;
        float& m = part.m[h0 + h];
        const float mx = simd::max_of(sh, nb, m);
        const float corr = m == -INFINITY ? 0.f : std::exp(m - mx);
        part.l[h0 + h] = part.l[h0 + h] * corr + simd::exp_sub_sum(sh, nb, mx);
        m = mx;
        if (corr != 1.f) simd::scale_row(part.acc + (h0 + h) * Dv, Dv, corr);
      }
      weighted_sum<R>(part.acc + h0 * Dv, Dv, sc, group, vrows, nb);
    }
  }
}

// out rows of query row i, every head = acc / l, or the merge of the row's splits (each with its own max):
// m, l [splits][Hq], acc [splits][Hq][Dv].
void write_rows(const Segment& g, int64_t Ttot, int64_t i, int splits, const float* m, const float* l,
                const float* acc, int64_t Hq, void* out, int out_code) {
  const int64_t Dv = g.view.v_dim;
  std::vector<float> row_out(static_cast<size_t>(Dv));  // one output row before its store
  float* x = row_out.data();
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t row = h * Ttot + g.row0 + i;
    // a sink joins the softmax's max and sum (without sinks: -inf, so the max and the sum are the keys' alone)
    const float sink = g.view.sinks ? g.view.sinks[h] : -INFINITY;
    float mx = sink;
    for (int sp = 0; sp < splits; ++sp) mx = std::max(mx, m[sp * Hq + h]);
    float total = g.view.sinks ? std::exp(sink - mx) : 0.f;
    float w[kMaxSplits];
    for (int sp = 0; sp < splits; ++sp) {
      const float ms = m[sp * Hq + h];
      w[sp] = ms == -INFINITY ? 0.f : std::exp(ms - mx);
      total += w[sp] * l[sp * Hq + h];
    }
    const float inv = 1.f / total;
    std::fill(x, x + Dv, 0.f);
    for (int sp = 0; sp < splits; ++sp) {
      const float* a = acc + (sp * Hq + h) * Dv;
      for (int64_t d = 0; d < Dv; ++d) x[d] += w[sp] * a[d];
    }
    for (int64_t d = 0; d < Dv; ++d) x[d] *= inv;
    if (rotated(g.view.dtype)) hadamard_rows(x, Dv);  // out of the values' basis
    store_row(out, out_code, row * Dv, x, Dv);
  }
}

constexpr int64_t kTileRows = 4;  // query rows of a row group's work unit (attend_tile)

// Rows [i0, i0 + R) of segment g (a row group: a prefill chunk), every head, written to out. The rows share each
// block of K/V rows read (in the caches from the first row to the last) and score it as one group of R x group
// query vectors per KV head. Blocks sit at key positions that are multiples of kBlock and every row is masked to
// its own visible keys (a masked key adds an exact 0 to the sums), so a row's bits do not depend on its tile.
void attend_tile(const Segment& g, const Tensor& q, int64_t Ttot, float scale, int64_t i0, int64_t R, void* out,
                 int out_code, std::vector<float>& scratch) {
  const SlotView& s = g.view;
  const int64_t D = s.head_dim, Dv = s.v_dim, Hq = q.size(1), Hkv = s.kv_heads, group = Hq / Hkv, nv = R * group;
  const int64_t kstride = s.slot_stride(D), vstride = s.slot_stride(Dv);  // bytes
  const int64_t khead = s.head_stride(D), vhead = s.head_stride(Dv);
  // visible keys of row r: [lo[r], hi[r]); the first row sees the lowest, the last the highest
  int64_t lo[kTileRows], hi[kTileRows];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qpos = g.pos + i0 + r;
    lo[r] = s.window > 0 ? std::max(g.base, qpos - s.window + 1) : g.base;
    hi[r] = qpos + 1;
  }
  // scratch: queries, m, l and acc [Hkv][R][group][...]; scores [R x group][kBlock]; K rows, V rows [kBlock][...]
  scratch.resize(static_cast<size_t>(Hq * R * (D + 2 + Dv) + nv * kBlock + kBlock * (D + Dv)));
  float* qs = scratch.data();
  float* m = qs + Hq * R * D;
  float* l = m + Hq * R;
  float* acc = l + Hq * R;
  float* sc = acc + Hq * R * Dv;
  float* kbuf = sc + nv * kBlock;
  float* vbuf = kbuf + kBlock * D;
  const void* qd = q.const_data_ptr();
  const ScalarType qt = q.scalar_type();
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < group; ++h) {
        const int64_t row = (kh * group + h) * Ttot + g.row0 + i0 + r, v = (kh * R + r) * group + h;
        for (int64_t d = 0; d < D; ++d) qs[v * D + d] = load(qd, qt, row * D + d) * scale;
        if (rotated(s.dtype)) hadamard_rows(qs + v * D, D);  // into the keys' basis
      }
  std::fill(m, m + Hq * R, -INFINITY);
  std::fill(l, l + Hq * R, 0.f);
  std::fill(acc, acc + Hq * R * Dv, 0.f);
  const float* krows[kBlock];
  const float* vrows[kBlock];
  for (int64_t b0 = lo[0] - lo[0] % kBlock; b0 < hi[R - 1]; b0 += kBlock) {
    const int64_t first = std::max(b0, g.base), end = std::min(b0 + kBlock, hi[R - 1]);
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      // block slots [first, end) at rows [first - b0, end - b0); the others point at a read row, masked below, so
      // every key is scored by the same four-key code wherever the block starts and ends
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t key = std::clamp(b0 + j, first, end - 1), slot = g.read[key - g.base];
        krows[j] = as_float(s.k + slot * kstride + kh * khead, s.dtype, D, kbuf + j * D);
        vrows[j] = as_float(s.v + slot * vstride + kh * vhead, s.dtype, Dv, vbuf + j * Dv);
      }
      const int64_t nb = (end - b0 + 3) / 4 * 4;  // rows of the block in use, in fours
      const float* qg = qs + kh * nv * D;
      for (int64_t j = 0; j < nb; j += 4) scores(qg, nv, D, krows + j, sc + j);
      for (int64_t r = 0; r < R; ++r) {
        // this row's visible part of the block
        const int64_t a = std::clamp(lo[r], b0, b0 + nb) - b0, e = std::clamp(hi[r], b0, b0 + nb) - b0;
        for (int64_t h = 0; h < group; ++h) {
          const int64_t v = (kh * R + r) * group + h;
          float* sh = sc + (r * group + h) * kBlock;
          if (a >= e) {  // nothing of this block is visible to the row
            std::fill(sh, sh + nb, 0.f);
            continue;
          }
          const float mx = simd::max_of(sh + a, e - a, m[v]);
          const float corr = m[v] == -INFINITY ? 0.f : std::exp(m[v] - mx);
          l[v] = l[v] * corr + simd::exp_sub_sum(sh + a, e - a, mx);
          m[v] = mx;
          std::fill(sh, sh + a, 0.f);
          std::fill(sh + e, sh + nb, 0.f);
          if (corr != 1.f) simd::scale_row(acc + v * Dv, Dv, corr);
        }
      }
      weighted_sum(acc + kh * nv * Dv, Dv, sc, nv, vrows, nb);
    }
  }
  std::vector<float> row_out(static_cast<size_t>(Dv));
  for (int64_t kh = 0; kh < Hkv; ++kh)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < group; ++h) {
        const int64_t v = (kh * R + r) * group + h, row = (kh * group + h) * Ttot + g.row0 + i0 + r;
        float inv = 1.f / l[v];
        if (s.sinks) {  // the sink's share of the softmax: its exp joins the sum, its value row is zero
          const float sink = s.sinks[kh * group + h], top = std::max(m[v], sink), f = std::exp(m[v] - top);
          inv = f / (l[v] * f + std::exp(sink - top));
        }
        for (int64_t d = 0; d < Dv; ++d) row_out[d] = acc[v * Dv + d] * inv;
        if (rotated(s.dtype)) hadamard_rows(row_out.data(), Dv);  // out of the values' basis
        store_row(out, out_code, row * Dv, row_out.data(), Dv);
      }
}

}  // namespace

// Key splits of query row i of a few-row segment: from the keys visible to it.
static int row_splits(const Segment& g, int64_t i) {
  const int64_t qpos = g.pos + i;
  const int64_t lo = g.view.window > 0 ? std::max(g.base, qpos - g.view.window + 1) : g.base;
  return static_cast<int>(std::clamp<int64_t>((qpos - lo + kSplitKeys) / kSplitKeys, 1, kMaxSplits));
}

void attend_segments_core(const Segment* segs, int n, const Tensor& q, float scale, void* out, int out_code) {
  const int64_t Hq = q.size(1), Ttot = q.size(2);
  // work units, each over every head: (segment, query row, key split) for a few rows (a decode step), (segment,
  // tile of kTileRows rows) for a row group; row_first[g][i]: the first unit of row i (few-row segments)
  std::vector<int64_t> first(static_cast<size_t>(n) + 1, 0);
  std::vector<std::vector<int64_t>> row_first(static_cast<size_t>(n));
  int64_t dv_max = 1;
  bool any_split = false;
  for (int g = 0; g < n; ++g) {
    const int64_t T = segs[g].T;
    if (T > kSplitRows) {
      first[g + 1] = first[g] + (T + kTileRows - 1) / kTileRows;
    } else {
      std::vector<int64_t>& rf = row_first[g];
      rf.assign(static_cast<size_t>(T) + 1, first[g]);
      for (int64_t i = 0; i < T; ++i) {
        const int sp = row_splits(segs[g], i);
        any_split |= sp > 1;
        rf[i + 1] = rf[i] + sp;
      }
      first[g + 1] = rf[T];
    }
    dv_max = std::max(dv_max, segs[g].view.v_dim);
  }
  const int64_t units = first[n], stride = Hq * (2 + dv_max);  // a unit's m, l, acc
  // split units keep their partials for the merge; the others write their rows at once from a local buffer
  std::vector<float> partials(any_split ? static_cast<size_t>(units * stride) : 0);
  auto body = [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch, local(static_cast<size_t>(stride));
    int g = static_cast<int>(std::upper_bound(first.begin(), first.end(), u0) - first.begin()) - 1;
    for (int64_t u = u0; u < u1; ++u) {
      while (u >= first[g + 1]) ++g;
      const Segment& s = segs[g];
      if (s.T > kSplitRows) {
        const int64_t i0 = (u - first[g]) * kTileRows;
        attend_tile(s, q, Ttot, scale, i0, std::min(kTileRows, s.T - i0), out, out_code, scratch);
        continue;
      }
      const std::vector<int64_t>& rf = row_first[g];
      const int64_t i = std::upper_bound(rf.begin(), rf.end(), u) - rf.begin() - 1;
      const int sn = static_cast<int>(rf[i + 1] - rf[i]), sp = static_cast<int>(u - rf[i]);
      float* base = sn > 1 ? partials.data() + u * stride : local.data();
      const Partial part{base, base + Hq, base + 2 * Hq};
      switch (s.view.dtype) {
        case kFloat: attend_unit<simd::F32Rows>(s, q, Ttot, scale, i, sp, sn, part, scratch); break;
        case kHalf: attend_unit<simd::F16Rows>(s, q, Ttot, scale, i, sp, sn, part, scratch); break;
        case kChar: attend_unit<simd::I8Rows>(s, q, Ttot, scale, i, sp, sn, part, scratch); break;
        case kByte: attend_unit<simd::I4Rows>(s, q, Ttot, scale, i, sp, sn, part, scratch); break;
        default: attend_unit<simd::BF16Rows>(s, q, Ttot, scale, i, sp, sn, part, scratch); break;
      }
      if (sn == 1) write_rows(s, Ttot, i, 1, part.m, part.l, part.acc, Hq, out, out_code);
    }
  };
  executorch::extension::parallel_for(0, units, 1, body);
  if (!any_split) return;
  // merge the rows that split: unit (g, i, sp) sits at row_first[g][i] + sp
  std::vector<float> mm, ll, aa;
  for (int g = 0; g < n; ++g) {
    if (segs[g].T > kSplitRows) continue;
    const int64_t Dv = segs[g].view.v_dim;
    for (int64_t i = 0; i < segs[g].T; ++i) {
      const int sn = static_cast<int>(row_first[g][i + 1] - row_first[g][i]);
      if (sn == 1) continue;
      mm.resize(static_cast<size_t>(sn * Hq));
      ll.resize(mm.size());
      aa.resize(static_cast<size_t>(sn * Hq * Dv));
      for (int sp = 0; sp < sn; ++sp) {
        const float* base = partials.data() + (row_first[g][i] + sp) * stride;
        std::copy_n(base, Hq, mm.data() + sp * Hq);
        std::copy_n(base + Hq, Hq, ll.data() + sp * Hq);
        std::copy_n(base + 2 * Hq, Hq * Dv, aa.data() + sp * Hq * Dv);
      }
      write_rows(segs[g], Ttot, i, sn, mm.data(), ll.data(), aa.data(), Hq, out, out_code);
    }
  }
}

}  // namespace llmrt::kv::LLMPIPE_ISA_NS
