#include "kernels/kv_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernels/cores.h"
#include "kernels/kv_rows.h"

namespace llmrt::kv {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;

const char* dtype_name(int code) {
  switch (code) {
    case kByte: return "Int4";
    case kChar: return "Int8";
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

int64_t row_bytes(int code, int64_t dim) {
  return quantized(code) ? row_elements(code, dim) : element_size(code) * dim;
}

int64_t row_values(int code, int64_t elements) {
  if (!quantized(code)) return elements;
  for (int64_t dim = 1; dim <= 2 * elements; ++dim)
    if (row_elements(code, dim) == elements && (code != kByte || dim % 2 == 0)) return dim;
  return -1;
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

bool float_like(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Half || t == ScalarType::BFloat16;
}

}  // namespace

bool check_sinks(const std::optional<Tensor>& sinks, int64_t Hq, const float** out, std::string* why) {
  *out = nullptr;
  if (!sinks.has_value()) return true;
  if (sinks->scalar_type() != ScalarType::Float || sinks->numel() != Hq) {
    *why = "sinks must be Float with one entry per query head (" + std::to_string(Hq) + ")";
    return false;
  }
  *out = sinks->const_data_ptr<float>();
  return true;
}

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
  const auto* kd = static_cast<const uint8_t*>(k.const_data_ptr());
  const auto* vd = static_cast<const uint8_t*>(v.const_data_ptr());
  std::vector<float> buf(static_cast<size_t>(std::max(D, Dv)));
  // one input row (n elements at element index i of a step tensor) into a storage row
  auto put = [&](uint8_t* dst, const uint8_t* src, ScalarType t, int64_t i, int64_t n) {
    if (static_cast<int>(t) == s.dtype) {
      std::copy_n(src + i * element_size(s.dtype), n * element_size(s.dtype), dst);
      return;
    }
    if (quantized(s.dtype)) {
      for (int64_t d = 0; d < n; ++d) buf[d] = load(src, t, i + d);
      quantize_row(s.dtype, buf.data(), n, dst);
      return;
    }
    for (int64_t d = 0; d < n; ++d) store(dst, s.dtype, d, load(src, t, i + d));
  };
  for (int64_t t = 0; t < g.T; ++t) {
    const int64_t slot = g.write[t], row = g.row0 + t;
    uint8_t* ks = s.k + slot * s.slot_stride(D);
    uint8_t* vs = s.v + slot * s.slot_stride(Dv);
    for (int64_t h = 0; h < Hkv; ++h) {
      // input [1,Hkv,Ttot,D] -> storage [slot][Hkv][row] (or [Hkv][slot][D], head-major)
      put(ks + h * s.head_stride(D), kd, k.scalar_type(), (h * Ttot + row) * D, D);
      put(vs + h * s.head_stride(Dv), vd, v.scalar_type(), (h * Ttot + row) * Dv, Dv);
    }
  }
}

void attend_segments(const Segment* segs, int n, const Tensor& q, float scale, void* out, int out_code) {
  cores().attend_segments(segs, n, q, scale, out, out_code);  // the ISA path's copy (kernels/isa.h)
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
