// How a K/V or activation element loads and stores as fp32, by its ExecuTorch dtype: what the attention core and the
// cache writes share. Internal linkage: each file (and each ISA copy of the core) gets its own.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <executorch/runtime/core/exec_aten/exec_aten.h>

#include "kernels/kv_attention.h"

namespace llmrt::kv {
namespace {

using executorch::aten::BFloat16;
using executorch::aten::Half;
using executorch::aten::ScalarType;

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

// out[o + d] = x[d], d < n, in the output's type
inline void store_row(void* out, int code, int64_t o, const float* x, int64_t n) {
  switch (code) {
    case kFloat: std::copy_n(x, n, static_cast<float*>(out) + o); break;
    case kHalf:
      for (int64_t d = 0; d < n; ++d) static_cast<Half*>(out)[o + d] = Half(x[d]);
      break;
    case kBFloat16:
      for (int64_t d = 0; d < n; ++d) static_cast<BFloat16*>(out)[o + d] = BFloat16(x[d]);
      break;
    default: break;
  }
}

// An int8 storage row (kv_attention.h) of x[d], d < n, at out: each group's scale (fp32, the last group's first),
// then the values. The Python twin (pipeline/model/kv/quant.py) rounds the same way: scale = max|x| / 127 over the
// group, value = round half to even of x / scale.
inline void quantize_row(const float* x, int64_t n, uint8_t* out) {
  const int64_t head = int8_scale_bytes(n);
  auto* q = reinterpret_cast<int8_t*>(out + head);
  for (int64_t g0 = 0; g0 < n; g0 += kInt8Group) {
    const int64_t g1 = std::min(n, g0 + kInt8Group);
    float amax = 0.f;
    for (int64_t d = g0; d < g1; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = amax / 127.f;
    for (int64_t d = g0; d < g1; ++d)
      q[d] = scale > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / scale), -127.f, 127.f)) : 0;
    std::memcpy(out + head - 4 * (g0 / kInt8Group + 1), &scale, sizeof scale);
  }
}

}  // namespace
}  // namespace llmrt::kv
