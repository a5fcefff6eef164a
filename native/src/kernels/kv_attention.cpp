#include "kernels/kv_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/simd_math.h"

namespace llmrt::kv {

using executorch::aten::BFloat16;
using executorch::aten::Half;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;

const char* dtype_name(int code) {
  switch (code) {
    case kHalf: return "Half";
    case kFloat: return "Float";
    case kBFloat16: return "BFloat16";
    default: return "?";
  }
}

int element_size(int code) {
  switch (code) {
    case kHalf:
    case kBFloat16: return 2;
    case kFloat: return 4;
    default: return 0;
  }
}

int make_runs(int64_t start, int64_t count, int64_t ring, Run* runs) {
  if (count <= 0) return 0;
  if (ring == 0) {
    runs[0] = {start, count};
    return 1;
  }
  int64_t slot = start % ring;
  int64_t first = std::min(count, ring - slot);
  runs[0] = {slot, first};
  if (count > first) {
    runs[1] = {0, count - first};
    return 2;
  }
  return 1;
}

Plan plan_step(int layer, int64_t pos, int64_t T, int64_t window, int64_t ring) {
  Plan p;
  p.layer = layer;
  p.pos = pos;
  p.T = T;
  p.end = pos + T;
  p.base = ring == 0 ? 0 : std::max<int64_t>(0, pos - window + 1);
  p.n_write = make_runs(pos, T, ring, p.write);
  p.n_read = make_runs(p.base, p.end - p.base, ring, p.read);
  return p;
}

namespace {

inline float load(const void* p, ScalarType t, int64_t i) {
  switch (t) {
    case ScalarType::Float: return static_cast<const float*>(p)[i];
    case ScalarType::Half: return static_cast<float>(static_cast<const Half*>(p)[i]);
    case ScalarType::BFloat16: return static_cast<float>(static_cast<const BFloat16*>(p)[i]);
    default: return 0.f;
  }
}

inline void store(void* p, int code, int64_t i, float x) {
  switch (code) {
    case kFloat: static_cast<float*>(p)[i] = x; break;
    case kHalf: static_cast<Half*>(p)[i] = Half(x); break;
    case kBFloat16: static_cast<BFloat16*>(p)[i] = BFloat16(x); break;
    default: break;
  }
}

// One storage row (D elements of type code `dtype`) as fp32: the row itself when stored as fp32, else
// converted into buf.
inline const float* as_float(const uint8_t* row, int dtype, int64_t D, float* buf) {
  switch (dtype) {
    case kFloat: return reinterpret_cast<const float*>(row);
    case kHalf: simd::half_row(reinterpret_cast<const uint16_t*>(row), buf, D); return buf;
    default: simd::bf16_row(reinterpret_cast<const uint16_t*>(row), buf, D); return buf;
  }
}

constexpr int64_t kBlock = 32;  // keys per block of scores (online softmax)
constexpr int kMaxSplits = 64;  // key splits of one query row (attend_segments)

// What one work unit leaves for its rows: the running max and sum of its softmax and the unnormalized
// output, per query head of the group.
struct Partial {
  float* m;
  float* l;
  float* acc;  // [group][Dv]
};

// The attention of query row i of segment g, for the `group` query heads of KV head kh, over the visible keys
// of split `split` of `splits` (an equal share of the visible range), online softmax in blocks of keys.
// K and V rows are read (and converted from their storage type) once for the whole group.
void attend_unit(const Segment& g, const Tensor& q, int64_t Ttot, float scale, int64_t kh, int64_t i, int split,
                 int splits, Partial part, std::vector<float>& scratch) {
  const SlotView& s = g.view;
  const int64_t D = s.head_dim, Dv = s.v_dim, Hq = q.size(1), group = Hq / s.kv_heads;
  const int64_t kstride = s.slot_stride(D), vstride = s.slot_stride(Dv);
  const int64_t khead = s.head_stride(D), vhead = s.head_stride(Dv);
  const int es = element_size(s.dtype);
  const int64_t qpos = g.pos + i;
  int64_t lo = g.base;  // visible logical keys [lo, qpos]
  if (s.window > 0) lo = std::max(lo, qpos - s.window + 1);
  const int64_t n = qpos - lo + 1, per = (n + splits - 1) / splits;
  const int64_t k0 = lo + std::min<int64_t>(n, per * split), k1 = lo + std::min<int64_t>(n, per * (split + 1));
  // scratch: queries [group][D], scores [group][kBlock], K rows [kBlock][D], V rows [kBlock][Dv] (half storage
  // converted; fp32 rows are read in place)
  scratch.resize(static_cast<size_t>(group * D + group * kBlock + kBlock * D + kBlock * Dv));
  float* qs = scratch.data();
  float* sc = qs + group * D;
  float* kbuf = sc + group * kBlock;
  float* vbuf = kbuf + kBlock * D;
  const void* qd = q.const_data_ptr();
  const ScalarType qt = q.scalar_type();
  for (int64_t h = 0; h < group; ++h) {
    const int64_t row = (kh * group + h) * Ttot + g.row0 + i;
    for (int64_t d = 0; d < D; ++d) qs[h * D + d] = load(qd, qt, row * D + d) * scale;
    part.m[h] = -INFINITY;
    part.l[h] = 0.f;
    std::fill(part.acc + h * Dv, part.acc + (h + 1) * Dv, 0.f);
  }
  const float* krows[kBlock];
  const float* vrows[kBlock];
  for (int64_t b0 = k0; b0 < k1; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, k1 - b0);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t slot = g.read[b0 + j - g.base];
      krows[j] = as_float(s.k + (slot * kstride + kh * khead) * es, s.dtype, D, kbuf + j * D);
      vrows[j] = as_float(s.v + (slot * vstride + kh * vhead) * es, s.dtype, Dv, vbuf + j * Dv);
    }
    for (int64_t h = 0; h < group; ++h) {
      float* sh = sc + h * kBlock;
      int64_t j = 0;
      for (; j + 4 <= nb; j += 4) simd::dot4(qs + h * D, krows + j, D, sh + j);
      for (; j < nb; ++j) sh[j] = simd::dot(qs + h * D, krows[j], D);
      float mx = part.m[h];
      for (j = 0; j < nb; ++j) mx = std::max(mx, sh[j]);
      const float corr = part.m[h] == -INFINITY ? 0.f : std::exp(part.m[h] - mx);
      part.l[h] = part.l[h] * corr + simd::exp_sub_sum(sh, nb, mx);
      part.m[h] = mx;
      if (corr != 1.f)
        for (int64_t d = 0; d < Dv; ++d) part.acc[h * Dv + d] *= corr;
    }
    for (int64_t h = 0; h < group; ++h) simd::accumulate_rows(part.acc + h * Dv, sc + h * kBlock, vrows, nb, Dv);
  }
}

// out row = acc / l, or the merge of a row's splits (each with its own max).
void write_rows(const Segment& g, int64_t Ttot, int64_t kh, int64_t i, int splits, const float* m,
                const float* l, const float* acc, int64_t group, void* out, int out_code) {
  const int64_t Dv = g.view.v_dim;
  for (int64_t h = 0; h < group; ++h) {
    const int64_t row = (kh * group + h) * Ttot + g.row0 + i;
    float mx = -INFINITY;
    for (int sp = 0; sp < splits; ++sp) mx = std::max(mx, m[sp * group + h]);
    float total = 0.f;
    float w[kMaxSplits];
    for (int sp = 0; sp < splits; ++sp) {
      const float ms = m[sp * group + h];
      w[sp] = ms == -INFINITY ? 0.f : std::exp(ms - mx);
      total += w[sp] * l[sp * group + h];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < Dv; ++d) {
      float x = 0.f;
      for (int sp = 0; sp < splits; ++sp) x += w[sp] * acc[(sp * group + h) * Dv + d];
      store(out, out_code, row * Dv + d, x * inv);
    }
  }
}

bool float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

}  // namespace

int64_t position_at(const Tensor& position, int64_t i) {
  return position.scalar_type() == ScalarType::Long ? position.const_data_ptr<int64_t>()[i]
                                                    : position.const_data_ptr<int32_t>()[i];
}

bool check_step_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& position,
                     ScalarType out_dtype, const Tensor& out, StepArgs* a, std::string* why, bool consecutive) {
  auto fail = [&](const std::string& m) {
    *why = m;
    return false;
  };
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return fail("q, k, v must be 4-d [B,H,T,D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Dv = v.size(3);
  if (B != 1) return fail("batch must be 1, got " + std::to_string(B));
  if (k.size(0) != 1 || v.size(0) != 1 || k.size(2) != T || v.size(2) != T || k.size(3) != D ||
      v.size(1) != Hkv || Hkv < 1 || Hq % Hkv != 0)
    return fail("inconsistent q/k/v shapes (or Hq % Hkv != 0)");
  if (!float_like(q.scalar_type()) || !float_like(k.scalar_type()) || !float_like(v.scalar_type()))
    return fail("q, k, v must be Float, Half or BFloat16");
  if (element_size(static_cast<int>(out_dtype)) == 0) return fail("out_dtype must be Float, Half or BFloat16");
  if (out.scalar_type() != out_dtype) return fail("out tensor dtype differs from out_dtype");
  if (position.numel() != T ||
      (position.scalar_type() != ScalarType::Long && position.scalar_type() != ScalarType::Int))
    return fail("position must hold T Long/Int entries");
  const int64_t pos = position_at(position, 0);
  if (pos < 0) return fail("negative position " + std::to_string(pos));
  if (consecutive)
    for (int64_t i = 1; i < T; ++i)
      if (position_at(position, i) != pos + i) return fail("positions must be consecutive");
  *a = {Hq, T, D, Hkv, Dv, pos};
  return true;
}

bool resize_out(Tensor& out, const StepArgs& a) {
  using executorch::aten::SizesType;
  SizesType sizes[4] = {1, static_cast<SizesType>(a.Hq), static_cast<SizesType>(a.T),
                        static_cast<SizesType>(a.Dv)};
  return executorch::runtime::resize_tensor(out, {sizes, 4}) == executorch::runtime::Error::Ok;
}

void plan_slots(const Plan& p, std::vector<int64_t>* write, std::vector<int64_t>* read) {
  write->clear();
  read->clear();
  for (int r = 0; r < p.n_write; ++r)
    for (int64_t c = 0; c < p.write[r].count; ++c) write->push_back(p.write[r].slot + c);
  for (int r = 0; r < p.n_read; ++r)
    for (int64_t c = 0; c < p.read[r].count; ++c) read->push_back(p.read[r].slot + c);
}

void write_segment(const Segment& g, const Tensor& k, const Tensor& v) {
  const SlotView& s = g.view;
  const int64_t Ttot = k.size(2), Hkv = s.kv_heads, D = s.head_dim, Dv = s.v_dim;
  const int es = element_size(s.dtype);
  const bool k_same = static_cast<int>(k.scalar_type()) == s.dtype;
  const bool v_same = static_cast<int>(v.scalar_type()) == s.dtype;
  const auto* kd = static_cast<const uint8_t*>(k.const_data_ptr());
  const auto* vd = static_cast<const uint8_t*>(v.const_data_ptr());
  for (int64_t t = 0; t < g.T; ++t) {
    const int64_t slot = g.write[t], row = g.row0 + t;
    uint8_t* ks = s.k + slot * s.slot_stride(D) * es;
    uint8_t* vs = s.v + slot * s.slot_stride(Dv) * es;
    for (int64_t h = 0; h < Hkv; ++h) {
      // input [1,Hkv,Ttot,D] -> storage [slot][Hkv][D] (or [Hkv][slot][D], head-major)
      const int64_t ki = (h * Ttot + row) * D, vi = (h * Ttot + row) * Dv;
      const int64_t ko = h * s.head_stride(D), vo = h * s.head_stride(Dv);
      if (k_same) {
        std::copy_n(kd + ki * es, D * es, ks + ko * es);
      } else {
        for (int64_t d = 0; d < D; ++d) store(ks, s.dtype, ko + d, load(kd, k.scalar_type(), ki + d));
      }
      if (v_same) {
        std::copy_n(vd + vi * es, Dv * es, vs + vo * es);
      } else {
        for (int64_t d = 0; d < Dv; ++d) store(vs, s.dtype, vo + d, load(vd, v.scalar_type(), vi + d));
      }
    }
  }
}

// Keys per split for a segment of few query rows (a decode step): its keys are shared out so every thread has
// work, and the splits merged after. The split depends only on the segment (its rows and span), never on the
// thread count or the other segments of the step: a session computes the same bits alone, batched, on any pool.
constexpr int64_t kSplitKeys = 128;
constexpr int64_t kSplitRows = 4;  // query rows up to which a segment splits its keys

int splits_of(const Segment& g) {
  if (g.T > kSplitRows) return 1;
  return static_cast<int>(std::clamp<int64_t>((g.span() + kSplitKeys - 1) / kSplitKeys, 1, kMaxSplits));
}

void attend_segments(const Segment* segs, int n, const Tensor& q, float scale, void* out, int out_code) {
  const int64_t Hq = q.size(1), Ttot = q.size(2);
  // work units: (segment, KV head, query row, key split); the query heads of a KV head share each K/V row read
  std::vector<int64_t> first(static_cast<size_t>(n) + 1, 0);
  std::vector<int> splits(static_cast<size_t>(n));
  int64_t group_max = 1, dv_max = 1;
  bool any_split = false;
  for (int g = 0; g < n; ++g) {
    splits[g] = splits_of(segs[g]);
    any_split |= splits[g] > 1;
    first[g + 1] = first[g] + segs[g].view.kv_heads * segs[g].T * splits[g];
    group_max = std::max(group_max, Hq / segs[g].view.kv_heads);
    dv_max = std::max(dv_max, segs[g].view.v_dim);
  }
  const int64_t units = first[n], stride = group_max * (2 + dv_max);  // a unit's m, l, acc
  // split units keep their partials for the merge; the others write their rows at once from a local buffer
  std::vector<float> partials(any_split ? static_cast<size_t>(units * stride) : 0);
  auto body = [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch, local(static_cast<size_t>(stride));
    int g = static_cast<int>(std::upper_bound(first.begin(), first.end(), u0) - first.begin()) - 1;
    for (int64_t u = u0; u < u1; ++u) {
      while (u >= first[g + 1]) ++g;
      const Segment& s = segs[g];
      const int64_t local_u = u - first[g], r = local_u / splits[g], i = r % s.T, kh = r / s.T;
      const int sp = static_cast<int>(local_u % splits[g]);
      float* base = splits[g] > 1 ? partials.data() + u * stride : local.data();
      const Partial part{base, base + group_max, base + 2 * group_max};
      attend_unit(s, q, Ttot, scale, kh, i, sp, splits[g], part, scratch);
      if (splits[g] == 1)
        write_rows(s, Ttot, kh, i, 1, part.m, part.l, part.acc, Hq / s.view.kv_heads, out, out_code);
    }
  };
  executorch::extension::parallel_for(0, units, 1, body);
  if (!any_split) return;
  // merge: unit (g, kh, i, sp) sits at first[g] + (kh * T + i) * splits + sp
  std::vector<float> mm, ll, aa;
  for (int g = 0; g < n; ++g) {
    if (splits[g] == 1) continue;
    const int64_t group = Hq / segs[g].view.kv_heads, Dv = segs[g].view.v_dim;
    const int sn = splits[g];
    mm.resize(static_cast<size_t>(sn * group));
    ll.resize(mm.size());
    aa.resize(static_cast<size_t>(sn * group * Dv));
    for (int64_t r = 0; r < segs[g].view.kv_heads * segs[g].T; ++r) {
      for (int sp = 0; sp < sn; ++sp) {
        const float* base = partials.data() + (first[g] + r * sn + sp) * stride;
        for (int64_t h = 0; h < group; ++h) {
          mm[sp * group + h] = base[h];
          ll[sp * group + h] = base[group_max + h];
          std::copy_n(base + 2 * group_max + h * Dv, Dv, aa.data() + (sp * group + h) * Dv);
        }
      }
      write_rows(segs[g], Ttot, r / segs[g].T, r % segs[g].T, sn, mm.data(), ll.data(), aa.data(), group, out,
                 out_code);
    }
  }
}

void write_step(const SlotView& s, const Plan& p, const Tensor& k, const Tensor& v) {
  std::vector<int64_t> write, read;
  plan_slots(p, &write, &read);
  Segment g{s, p.pos, p.T, 0, p.base, write.data(), read.data()};
  write_segment(g, k, v);
}

void attend(const SlotView& s, const Plan& p, const Tensor& q, float scale, void* out, int out_code) {
  std::vector<int64_t> write, read;
  plan_slots(p, &write, &read);
  Segment g{s, p.pos, p.T, 0, p.base, write.data(), read.data()};
  attend_segments(&g, 1, q, scale, out, out_code);
}

}  // namespace llmrt::kv
