// llmpipe::experts' weights as its core reads them (experts_kernel.cpp checks and loads them, experts_core.cpp runs
// a projection, once per ISA path).
#pragma once

#include <cstdint>

namespace llmrt::experts {

// One projection of every expert: expert e's weight rows start at w + e * out * in.
struct Proj {
  const float* wf = nullptr;   // Float weights
  const int8_t* wq = nullptr;   // or int8 values with group scales
  const uint8_t* w4 = nullptr;  // or 4-bit values two a byte (w + 8: element 2i low nibble, 2i + 1 high)
  const float* s = nullptr;
  const float* b = nullptr;
  int64_t out = 0, in = 0, groups = 1;
  bool act_quant = false;
};

}  // namespace llmrt::experts
