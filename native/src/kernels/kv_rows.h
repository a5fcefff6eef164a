// How a K/V or activation element loads and stores as fp32, by its ExecuTorch dtype: what the attention core and the
// cache writes share. Internal linkage: each file (and each ISA copy of the core) gets its own.
#pragma once

#include <algorithm>
#include <cstdint>

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

}  // namespace
}  // namespace llmrt::kv
