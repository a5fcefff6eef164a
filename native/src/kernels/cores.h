// The kernels' numeric cores, one table per ISA path (kernels/isa.h): the op wrappers check their arguments once, in
// baseline code, and call the active path's core through cores(). A core file is compiled once per path with that
// path's flags and LLMPIPE_ISA_NS (isa_scalar, isa_avx2, isa_avx512, isa_neon, isa_dotprod); isa_table.cpp gathers
// each copy's functions into its kCores.
#pragma once

#include <cstdint>
#include <vector>

#include <executorch/runtime/core/exec_aten/exec_aten.h>

namespace llmrt {

namespace kv {
struct Segment;
}
namespace recurrent {
struct DeltaStep;
struct ConvStep;
struct SsdStep;
}
namespace experts {
struct Proj;
}

struct Cores {
  // kv_attention.h attend_segments
  void (*attend_segments)(const kv::Segment* segs, int n, const executorch::aten::Tensor& q, float scale, void* out,
                          int out_code);
  // llmpipe::tied_head: out [T][V] = rows of x [T][D] times the int8 table [V][D], times its row scales
  void (*tied_head)(const float* x, int64_t T, const int8_t* w, const float* scales, int64_t V, int64_t D, float* out);
  // llmpipe::experts: one projection of expert e over n rows (experts_core.h)
  void (*experts_project)(const experts::Proj& p, int64_t e, const float* x, int64_t n, float* y,
                          std::vector<int16_t>& qz, std::vector<float>& rs);
  // recurrent_core.h run_delta / run_conv / run_ssd
  void (*run_delta)(const recurrent::DeltaStep& step, float* state);
  void (*run_conv)(const recurrent::ConvStep& step, float* state);
  void (*run_ssd)(const recurrent::SsdStep& step, float* state);
};

// The active path's cores (kernels/isa.cpp).
const Cores& cores();

namespace isa {
enum class Isa : int;
}
// A path's cores, or nullptr where this build lacks the path or this CPU cannot take it (tests run every path).
const Cores* cores_of(isa::Isa path);

#ifdef LLMPIPE_ISA_NS
// inside one path's copy: its own functions, and its table
namespace kv::LLMPIPE_ISA_NS {
void attend_segments_core(const Segment* segs, int n, const executorch::aten::Tensor& q, float scale, void* out,
                          int out_code);
}
namespace tied_head::LLMPIPE_ISA_NS {
void run(const float* x, int64_t T, const int8_t* w, const float* scales, int64_t V, int64_t D, float* out);
}
namespace experts::LLMPIPE_ISA_NS {
void project(const Proj& p, int64_t e, const float* x, int64_t n, float* y, std::vector<int16_t>& qz,
             std::vector<float>& rs);
}
namespace recurrent::LLMPIPE_ISA_NS {
void run_delta(const DeltaStep& step, float* state);
void run_conv(const ConvStep& step, float* state);
void run_ssd(const SsdStep& step, float* state);
}
namespace LLMPIPE_ISA_NS {
extern const Cores kCores;
}
#endif

}  // namespace llmrt
