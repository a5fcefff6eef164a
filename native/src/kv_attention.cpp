#include "kv_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

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

// The physical slot of every key read, oldest first.
std::vector<int64_t> read_slots(const Plan& p) {
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(p.span()));
  for (int r = 0; r < p.n_read; ++r)
    for (int64_t s = 0; s < p.read[r].count; ++s) slots.push_back(p.read[r].slot + s);
  return slots;
}

// Rows [r0, r1) of the (head, query) grid; S is the storage type.
template <typename S>
void attend_rows(const SlotView& s, const Plan& p, const std::vector<int64_t>& slots, const Tensor& q,
                 float scale, void* out, int out_code, int64_t r0, int64_t r1) {
  const int64_t T = p.T, D = s.head_dim, Dv = s.v_dim, Hq = q.size(1), group = Hq / s.kv_heads;
  const int64_t kstride = s.kv_heads * D, vstride = s.kv_heads * Dv;
  const S* K = reinterpret_cast<const S*>(s.k);
  const S* V = reinterpret_cast<const S*>(s.v);
  const void* qd = q.const_data_ptr();
  const ScalarType qt = q.scalar_type();
  std::vector<float> qrow(static_cast<size_t>(D)), scores(static_cast<size_t>(p.span())),
      acc(static_cast<size_t>(Dv));
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t h = r / T, i = r % T, kh = h / group, qpos = p.pos + i;
    int64_t lo = p.base;  // visible logical keys [lo, qpos]
    if (s.window > 0) lo = std::max(lo, qpos - s.window + 1);
    for (int64_t d = 0; d < D; ++d) qrow[d] = load(qd, qt, r * D + d) * scale;
    const float* qr = qrow.data();
    float mx = -INFINITY;
    for (int64_t key = lo; key <= qpos; ++key) {
      const S* kr = K + slots[key - p.base] * kstride + kh * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * static_cast<float>(kr[d]);
      scores[key - lo] = dot;
      mx = std::max(mx, dot);
    }
    float sum = 0.f;
    float* a = acc.data();
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t key = lo; key <= qpos; ++key) {
      const float e = std::exp(scores[key - lo] - mx);
      sum += e;
      const S* vr = V + slots[key - p.base] * vstride + kh * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] += e * static_cast<float>(vr[d]);
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < Dv; ++d) store(out, out_code, r * Dv + d, a[d] * inv);
  }
}

bool float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

}  // namespace

bool check_step_args(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& position,
                     ScalarType out_dtype, const Tensor& out, StepArgs* a, std::string* why) {
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
  auto pos_at = [&](int64_t i) -> int64_t {
    return position.scalar_type() == ScalarType::Long ? position.const_data_ptr<int64_t>()[i]
                                                      : position.const_data_ptr<int32_t>()[i];
  };
  const int64_t pos = pos_at(0);
  if (pos < 0) return fail("negative position " + std::to_string(pos));
  for (int64_t i = 1; i < T; ++i)
    if (pos_at(i) != pos + i) return fail("positions must be consecutive");
  *a = {Hq, T, D, Hkv, Dv, pos};
  return true;
}

bool resize_out(Tensor& out, const StepArgs& a) {
  using executorch::aten::SizesType;
  SizesType sizes[4] = {1, static_cast<SizesType>(a.Hq), static_cast<SizesType>(a.T),
                        static_cast<SizesType>(a.Dv)};
  return executorch::runtime::resize_tensor(out, {sizes, 4}) == executorch::runtime::Error::Ok;
}

void write_step(const SlotView& s, const Plan& p, const Tensor& k, const Tensor& v) {
  const int64_t T = p.T, Hkv = s.kv_heads, D = s.head_dim, Dv = s.v_dim;
  const int es = element_size(s.dtype);
  const bool k_same = static_cast<int>(k.scalar_type()) == s.dtype;
  const bool v_same = static_cast<int>(v.scalar_type()) == s.dtype;
  int64_t t = 0;
  for (int r = 0; r < p.n_write; ++r)
    for (int64_t c = 0; c < p.write[r].count; ++c, ++t) {
      const int64_t slot = p.write[r].slot + c;
      uint8_t* ks = s.k + slot * Hkv * D * es;
      uint8_t* vs = s.v + slot * Hkv * Dv * es;
      for (int64_t h = 0; h < Hkv; ++h) {
        // input [1,Hkv,T,D] -> storage [slot][Hkv][D]
        const int64_t ki = (h * T + t) * D, vi = (h * T + t) * Dv;
        if (k_same) {
          std::copy_n(static_cast<const uint8_t*>(k.const_data_ptr()) + ki * es, D * es, ks + h * D * es);
        } else {
          for (int64_t d = 0; d < D; ++d) store(ks, s.dtype, h * D + d, load(k.const_data_ptr(), k.scalar_type(), ki + d));
        }
        if (v_same) {
          std::copy_n(static_cast<const uint8_t*>(v.const_data_ptr()) + vi * es, Dv * es, vs + h * Dv * es);
        } else {
          for (int64_t d = 0; d < Dv; ++d) store(vs, s.dtype, h * Dv + d, load(v.const_data_ptr(), v.scalar_type(), vi + d));
        }
      }
    }
}

void attend(const SlotView& s, const Plan& p, const Tensor& q, float scale, void* out, int out_code) {
  const std::vector<int64_t> slots = read_slots(p);
  const int64_t rows = q.size(1) * p.T;
  // enough keys x dims per task that the threadpool's dispatch is paid for
  const int64_t per_row = std::max<int64_t>(1, p.span() * (s.head_dim + s.v_dim));
  const int64_t grain = std::max<int64_t>(1, 32768 / per_row);
  auto body = [&](int64_t r0, int64_t r1) {
    switch (s.dtype) {
      case kFloat: attend_rows<float>(s, p, slots, q, scale, out, out_code, r0, r1); break;
      case kHalf: attend_rows<Half>(s, p, slots, q, scale, out, out_code, r0, r1); break;
      case kBFloat16: attend_rows<BFloat16>(s, p, slots, q, scale, out, out_code, r0, r1); break;
      default: break;
    }
  };
  executorch::extension::parallel_for(0, rows, grain, body);
}

}  // namespace llmrt::kv
