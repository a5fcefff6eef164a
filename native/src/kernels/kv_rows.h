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

// x[d], d < n, rotated in place: a Walsh-Hadamard transform over each block of the largest power of two dividing n
// (all of a power-of-two head dim), scaled by 1 / sqrt(block) so it is orthonormal and its own inverse. It spreads an
// outlier channel over the block, so a 4-bit group's scale is not set by one value. The Python twin
// (pipeline/model/kv/quant.py) runs the same butterflies in the same order, bit for bit.
inline void hadamard_rows(float* x, int64_t n) {
  const int64_t block = n & -n;
  if (block < 2) return;
  for (int64_t o = 0; o < n; o += block)
    for (int64_t h = 1; h < block; h *= 2)
      for (int64_t i = o; i < o + block; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
  const float s = 1.f / std::sqrt(static_cast<float>(block));
  for (int64_t d = 0; d < n; ++d) x[d] *= s;
}

// A quantized storage row (kv_attention.h) of x[d], d < n, at out: each group's scale (the last group's first),
// then the values. The Python twin (pipeline/model/kv/quant.py) rounds the same way, value = round half to even of
// x / scale, with scale over each group:
//   int8: max |x| / 127 (fp32), values in [-127, 127];
//   int4: the row rotated first (x is overwritten), then the group's value of largest magnitude / -8, rounded to fp16
//     (as llama.cpp's q4_0: that value lands on -8 exactly and the 16 levels are all used, where max |x| / 7 leaves
//     -8 unused; 0.041 against 0.053 KLD on SmolLM2, eagerly over three held-out domains), values in [-8, 7].
inline void quantize_row(int code, float* x, int64_t n, uint8_t* out) {
  const bool four = code == kByte;
  const int64_t head = scale_bytes(code, n);
  uint8_t* values = out + head;
  if (four) {
    hadamard_rows(x, n);
    std::fill(values, values + (n + 1) / 2, uint8_t{0x88});  // an odd row's last high nibble: zero
  }
  for (int64_t g0 = 0; g0 < n; g0 += kQuantGroup) {
    const int64_t g1 = std::min(n, g0 + kQuantGroup), slot = g0 / kQuantGroup + 1;
    float top = 0.f;  // the group's value of largest magnitude (the first of equals)
    for (int64_t d = g0; d < g1; ++d)
      if (std::fabs(x[d]) > std::fabs(top)) top = x[d];
    float scale;
    if (four) {  // fp16 scales (saturating: a K/V value past 524k is no real model's)
      const Half h(std::clamp(top / -8.f, -65504.f, 65504.f));
      scale = static_cast<float>(h);
      std::memcpy(out + head - 2 * slot, &h, 2);
    } else {
      scale = std::fabs(top) / 127.f;
      std::memcpy(out + head - 4 * slot, &scale, 4);
    }
    for (int64_t d = g0; d < g1; ++d) {
      const float q = scale != 0.f ? std::clamp(std::nearbyint(x[d] / scale), four ? -8.f : -127.f, four ? 7.f : 127.f)
                                   : 0.f;
      if (!four) {
        reinterpret_cast<int8_t*>(values)[d] = static_cast<int8_t>(q);
        continue;
      }
      const auto nib = static_cast<uint8_t>(static_cast<int>(q) + 8);
      uint8_t& byte = values[d / 2];
      byte = d % 2 ? static_cast<uint8_t>((byte & 0x0F) | (nib << 4)) : static_cast<uint8_t>((byte & 0xF0) | nib);
    }
  }
}

}  // namespace
}  // namespace llmrt::kv
