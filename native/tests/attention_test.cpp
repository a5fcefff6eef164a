// attention_test: the attention core's promises, without a program. A row's output does not depend on how the
// step that holds it was cut (one prefill chunk or two), nor on the thread count; every row is close to attention
// computed in double precision. Prints "ok <name>" or "FAIL <name>: <what>" per case; exit 1 if any failed. Run
// by tests/native/test_attention_core.py.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <executorch/runtime/core/portable_type/tensor_impl.h>
#include <executorch/runtime/platform/runtime.h>

#include "kernels/kv_attention.h"
#include "kernels/kv_rows.h"
#include "kernels/simd_math.h"
#include "runtime/threadpool.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::etensor::TensorImpl;
using namespace llmrt::kv;

struct Case {
  const char* name;
  int64_t hq, hkv, d, positions, window;
  int dtype = kFloat;  // K/V storage
};

// fp32 to a half type's bits, round to nearest even (normal values: these are N(0, 1) draws)
uint16_t to_storage(float f, int dtype) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (dtype == kBFloat16) return static_cast<uint16_t>((x + 0x7fff + ((x >> 16) & 1)) >> 16);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // below half's normals: not drawn here
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float from_storage(uint16_t h, int dtype) {
  return dtype == kHalf ? llmrt::kv::simd::F16Rows::one(&h, 0) : llmrt::kv::simd::BF16Rows::one(&h, 0);
}

// One layer's K/V for `positions` positions (slot = position) and every position's queries [hq][positions][d].
// k and v hold the values the cache stores (rounded to its type); kv_bytes, those values in the storage type.
struct Layer {
  Case c;
  std::vector<float> k, v, q;
  std::vector<uint8_t> kbytes, vbytes;
  explicit Layer(const Case& c_) : c(c_) {
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    k.resize(static_cast<size_t>(c.positions * c.hkv * c.d));
    v.resize(k.size());
    q.resize(static_cast<size_t>(c.hq * c.positions * c.d));
    for (auto* x : {&k, &v, &q})
      for (float& f : *x) f = nd(rng);
    const int64_t row = row_bytes(c.dtype, c.d), rows = static_cast<int64_t>(k.size()) / c.d;
    kbytes.resize(static_cast<size_t>(rows * row));
    vbytes.resize(kbytes.size());
    for (auto [x, bytes] : {std::pair{&k, &kbytes}, std::pair{&v, &vbytes}})
      for (int64_t r = 0; r < rows; ++r) {
        float* xs = x->data() + r * c.d;
        uint8_t* out = bytes->data() + r * row;
        if (c.dtype == kChar) {  // int8 rows: the reference attends over the values they hold
          quantize_row(kChar, xs, c.d, out);
          const auto* vals = reinterpret_cast<const int8_t*>(out + scale_bytes(kChar, c.d));
          for (int64_t i = 0; i < c.d; ++i) xs[i] = llmrt::kv::simd::I8Rows::one(vals, i);
          continue;
        }
        if (c.dtype == kByte) {  // int4 rows hold rotated values: the reference attends over them rotated back
          quantize_row(kByte, xs, c.d, out);
          const uint8_t* vals = out + scale_bytes(kByte, c.d);
          for (int64_t i = 0; i < c.d; ++i) xs[i] = llmrt::kv::simd::I4Rows::one(vals, i);
          hadamard_rows(xs, c.d);
          continue;
        }
        for (int64_t i = 0; i < c.d; ++i) {
          if (c.dtype == kFloat) {
            std::memcpy(out + 4 * i, &xs[i], 4);
          } else {
            const uint16_t h = to_storage(xs[i], c.dtype);
            std::memcpy(out + 2 * i, &h, 2);
            xs[i] = from_storage(h, c.dtype);
          }
        }
      }
  }

  // out [hq][T][d] of the step of rows [pos, pos + T)
  std::vector<float> step(int64_t pos, int64_t T) {
    std::vector<float> qs(static_cast<size_t>(c.hq * T * c.d)), out(qs.size());
    for (int64_t h = 0; h < c.hq; ++h)
      std::memcpy(&qs[(h * T) * c.d], &q[(h * c.positions + pos) * c.d], sizeof(float) * T * c.d);
    TensorImpl::SizesType sizes[4] = {1, static_cast<int>(c.hq), static_cast<int>(T), static_cast<int>(c.d)};
    TensorImpl::DimOrderType order[4] = {0, 1, 2, 3};
    TensorImpl::StridesType strides[4] = {static_cast<int>(c.hq * T * c.d), static_cast<int>(T * c.d),
                                          static_cast<int>(c.d), 1};
    TensorImpl qi(ScalarType::Float, 4, sizes, qs.data(), order, strides);
    const SlotView view{kbytes.data(), vbytes.data(), c.hkv, c.d, c.d, c.dtype, c.window};
    attend(view, plan_step(0, pos, T, c.window, 0), Tensor(&qi), 1.f / std::sqrt(float(c.d)), out.data(), kFloat);
    return out;
  }

  // the output of row `pos` (position pos), head h, in double precision
  double reference(int64_t pos, int64_t h, int64_t dim) const {
    const int64_t kh = h / (c.hq / c.hkv), lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
    std::vector<double> w;
    double mx = -1e300, sum = 0.0, o = 0.0;
    for (int64_t j = lo; j <= pos; ++j) {
      double dot = 0.0;
      for (int64_t e = 0; e < c.d; ++e) dot += double(q[(h * c.positions + pos) * c.d + e]) * k[(j * c.hkv + kh) * c.d + e];
      w.push_back(dot / std::sqrt(double(c.d)));
      mx = std::max(mx, w.back());
    }
    for (int64_t j = lo; j <= pos; ++j) {
      const double e = std::exp(w[j - lo] - mx);
      sum += e;
      o += e * v[(j * c.hkv + kh) * c.d + dim];
    }
    return o / sum;
  }
};

int failures = 0;

void report(const std::string& name, const std::string& failure) {
  if (failure.empty()) {
    std::printf("ok %s\n", name.c_str());
  } else {
    std::printf("FAIL %s: %s\n", name.c_str(), failure.c_str());
    ++failures;
  }
}

// rows [pos, pos + T) of `a` (a step from pos0 of Ta rows) against `b` (from pos1, Tb rows), bit for bit
std::string same_rows(const Case& c, const std::vector<float>& a, int64_t pos0, int64_t Ta, const std::vector<float>& b,
                      int64_t pos1, int64_t Tb, int64_t pos, int64_t T) {
  for (int64_t h = 0; h < c.hq; ++h)
    for (int64_t r = pos; r < pos + T; ++r)
      if (std::memcmp(&a[(h * Ta + r - pos0) * c.d], &b[(h * Tb + r - pos1) * c.d], sizeof(float) * c.d) != 0)
        return "head " + std::to_string(h) + ", position " + std::to_string(r) + " differs";
  return "";
}

void run_case(const Case& c) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  Layer layer(c);
  const int64_t P = c.positions;
  // a prefill of the first 5 positions, then the rest in one chunk, or in chunks of 13 and the remainder
  pool->_unsafe_reset_threadpool(2);
  const auto whole = layer.step(5, P - 5);
  const auto first = layer.step(5, 13), second = layer.step(18, P - 18);
  report(std::string(c.name) + ": a row group's rows do not depend on where the chunk is cut",
         same_rows(c, whole, 5, P - 5, first, 5, 13, 5, 13) + same_rows(c, whole, 5, P - 5, second, 18, P - 18, 18, P - 18));
  // decode steps (one row, keys split among the threads) and a chunk, on 1 and on 2 threads
  const auto decode2 = layer.step(P - 1, 1);
  pool->_unsafe_reset_threadpool(1);
  const auto decode1 = layer.step(P - 1, 1), whole1 = layer.step(5, P - 5);
  report(std::string(c.name) + ": the same bits on 1 and 2 threads",
         same_rows(c, decode1, P - 1, 1, decode2, P - 1, 1, P - 1, 1) + same_rows(c, whole, 5, P - 5, whole1, 5, P - 5, 5, P - 5));
  // speculation's verify steps: each row of a step of up to 4 rows equals its own decode step (a row's key splits
  // come from its own keys), also where the step's rows straddle a split boundary (128 and 256 keys)
  pool->_unsafe_reset_threadpool(2);
  std::string verify_rows;
  for (int64_t pos : {int64_t(125), int64_t(126), int64_t(254), P - 4})
    for (int64_t T = 2; T <= 4 && pos + T <= P; ++T) {
      const auto step = layer.step(pos, T);
      for (int64_t r = pos; r < pos + T; ++r) verify_rows += same_rows(c, step, pos, T, layer.step(r, 1), r, 1, r, 1);
    }
  report(std::string(c.name) + ": a verify step's rows equal decode steps'", verify_rows);
  double err = 0.0;
  for (int64_t h = 0; h < c.hq; ++h)
    for (int64_t e = 0; e < c.d; ++e) {
      err = std::max(err, std::abs(layer.reference(P - 1, h, e) - decode1[h * c.d + e]));
      for (int64_t r : {int64_t(5), int64_t(40), P - 1})
        err = std::max(err, std::abs(layer.reference(r, h, e) - whole[(h * (P - 5) + r - 5) * c.d + e]));
    }
  report(std::string(c.name) + ": within 1e-5 of attention in double precision",
         err < 1e-5 ? "" : "max error " + std::to_string(err));
}

}  // namespace

int main() {
  executorch::runtime::runtime_init();
  // GQA groups of 3 and 4 (SmolLM2's and gemma3's), full and banded attention; 300 positions: a decode step splits
  // its keys in three. K/V stored as fp32, fp16 and bf16 (read in their type, converted in registers); head dims
  // of 16, 64, 256 and 40 (not a multiple of 16: the loops that take 16 columns a pass end in their tails).
  for (const Case& c : {Case{"gqa3 full", 9, 3, 64, 300, 0}, Case{"gqa4 window 37", 4, 1, 256, 300, 37},
                        Case{"mha full", 2, 2, 16, 300, 0}, Case{"gqa3 fp16", 9, 3, 64, 300, 0, kHalf},
                        Case{"gqa4 window 37 bf16", 4, 1, 256, 300, 37, kBFloat16},
                        Case{"gqa2 d40 fp16", 4, 2, 40, 300, 0, kHalf}, Case{"gqa2 d40", 4, 2, 40, 300, 0},
                        Case{"gqa3 int8", 9, 3, 64, 300, 0, kChar}, Case{"gqa2 d40 int8", 4, 2, 40, 300, 0, kChar},
                        Case{"gqa4 window 37 int8", 4, 1, 256, 300, 37, kChar},
                        Case{"gqa3 int4", 9, 3, 64, 300, 0, kByte}, Case{"gqa2 d40 int4", 4, 2, 40, 300, 0, kByte},
                        Case{"gqa4 window 37 int4", 4, 1, 256, 300, 37, kByte}})
    run_case(c);
  return failures ? 1 : 0;
}
