// The recurrent layers' two computations, over state the caller owns: a program's buffer (custom and static modes:
// gated_delta_kernel.cpp, causal_conv_kernel.cpp) or the runtime's off-graph cache (state_kernels.cpp). Python twins:
// pipeline/model/layers/gated_delta.py, pipeline/model/layers/recurrent.py.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <executorch/runtime/kernel/kernel_includes.h>

namespace llmrt::recurrent {

inline bool is_float(const executorch::aten::Tensor& t, int64_t dim) {
  return t.scalar_type() == executorch::aten::ScalarType::Float && t.dim() == dim;
}

// position Long [T], consecutive from >= 0 (all_rows: every row; else the caller checks each session's rows of a
// batched step): its first entry in *pos
inline bool consecutive(const executorch::aten::Tensor& position, int64_t T, int64_t* pos, std::string* why,
                        bool all_rows = true) {
  if (position.dim() != 1 || position.size(0) != T || position.scalar_type() != executorch::aten::ScalarType::Long) {
    *why = "position must be Long [T]";
    return false;
  }
  const int64_t* p = position.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < (all_rows ? T : 0); ++t)
    if (p[t] != p[0] + t || p[0] < 0) {
      *why = "positions must be consecutive from >= 0";
      return false;
    }
  *pos = T > 0 ? p[0] : 0;
  return true;
}

// The gated delta rule: q, k [1,T,Hk,Dk], v [1,T,Hv,Dv], a, b [1,T,Hv], A_log, dt_bias [Hv], out [1,T,Hv,Dv], all
// Float; state [Hv,Dk,Dv] fp32.
struct DeltaStep {
  const float *q = nullptr, *k = nullptr, *v = nullptr, *a = nullptr, *b = nullptr, *A_log = nullptr,
              *dt_bias = nullptr;
  float* out = nullptr;
  int64_t pos = 0, T = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  float scale = 1.f;
};

// Checks the step's tensors and resizes out; false with a reason.
bool delta_step(const executorch::aten::Tensor& q, const executorch::aten::Tensor& k,
                const executorch::aten::Tensor& v, const executorch::aten::Tensor& a,
                const executorch::aten::Tensor& b, const executorch::aten::Tensor& A_log,
                const executorch::aten::Tensor& dt_bias, const executorch::aten::Tensor& position, double scale,
                executorch::aten::Tensor& out, DeltaStep* step, std::string* why, bool consecutive_rows = true);
// The rows [row, row + T) of a step, as a step of their own at position pos (a batched step's session).
DeltaStep delta_rows(const DeltaStep& step, int64_t row, int64_t T, int64_t pos);
// Advances state (zeroed first at position 0) over the step, in the chunked form, a value head a task.
void run_delta(const DeltaStep& step, float* state);

// Mamba-2's scan: x [1,T,H,P], dt [1,T,H], A_log, dt_bias, D [H], B, C [1,T,G,N], out [1,T,H,P], all Float;
// state [H,N,P] fp32 (ssd_kernel.cpp; Python twin pipeline/model/layers/ssd.py).
struct SsdStep {
  const float *x = nullptr, *dt = nullptr, *A_log = nullptr, *dt_bias = nullptr, *B = nullptr, *C = nullptr,
              *D = nullptr;
  float* out = nullptr;
  int64_t pos = 0, T = 0, H = 0, P = 0, G = 0, N = 0;
  float dt_min = 0.f, dt_max = 0.f;
};

bool ssd_step(const executorch::aten::Tensor& x, const executorch::aten::Tensor& dt,
              const executorch::aten::Tensor& A_log, const executorch::aten::Tensor& dt_bias,
              const executorch::aten::Tensor& B, const executorch::aten::Tensor& C, const executorch::aten::Tensor& D,
              const executorch::aten::Tensor& position, double dt_min, double dt_max, executorch::aten::Tensor& out,
              SsdStep* step, std::string* why, bool consecutive_rows = true);
SsdStep ssd_rows(const SsdStep& step, int64_t row, int64_t T, int64_t pos);
// Advances state (zeroed first at position 0) over the step, in the chunked form, a head a task.
void run_ssd(const SsdStep& step, float* state);

// The causal conv: x [1,T,C], weight [C,K], bias [C] or none, out [1,T,C], all Float; state [K-1,C] Float.
struct ConvStep {
  const float *x = nullptr, *w = nullptr, *bias = nullptr;
  float* out = nullptr;
  int64_t pos = 0, T = 0, C = 0, K = 0;
  bool silu = false;
};

bool conv_step(const executorch::aten::Tensor& x, const executorch::aten::Tensor& weight,
               const std::optional<executorch::aten::Tensor>& bias, const executorch::aten::Tensor& position,
               int64_t activation, executorch::aten::Tensor& out, ConvStep* step, std::string* why,
               bool consecutive_rows = true);
ConvStep conv_rows(const ConvStep& step, int64_t row, int64_t T, int64_t pos);
// Convolves the step over state (zeroed first at position 0), then keeps its last K-1 inputs there.
void run_conv(const ConvStep& step, float* state);

}  // namespace llmrt::recurrent
