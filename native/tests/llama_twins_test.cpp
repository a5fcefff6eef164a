// llama_twins_test DIR [THREADS]: runs our twins of ExecuTorch's LLM ops (llama::update_cache.out,
// llama::custom_sdpa.out, kernels/llama_twins.cpp) through the kernel registry, as a program calls them, on the cases
// tests/model/test_stock.py writes: DIR/cases.json lists them, each tensor a raw little-endian file in DIR. Writes each
// case's result to DIR/<name>.out (custom_sdpa: its output; update_cache: the cache after the write) for the test to
// hold against ExecuTorch's own kernels (torch.ops.llama). Prints "ok <name>" or "FAIL <name>: <what>"; exit 1 if any
// case failed.
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/portable_type/tensor_impl.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/runtime.h>
#include <nlohmann/json.hpp>

#include "runtime/threadpool.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::etensor::TensorImpl;

// A tensor read from a file, contiguous, owning its bytes and metadata.
struct Owned {
  std::vector<uint8_t> bytes;
  std::vector<SizesType> sizes;
  std::vector<executorch::aten::DimOrderType> order;
  std::vector<executorch::aten::StridesType> strides;
  std::unique_ptr<TensorImpl> impl;

  Owned(const std::string& path, const std::vector<int64_t>& shape, ScalarType dtype)
      : Owned(read(path), shape, dtype) {}
  Owned(std::vector<uint8_t> data, const std::vector<int64_t>& shape, ScalarType dtype) : bytes(std::move(data)) {
    for (int64_t s : shape) sizes.push_back(static_cast<SizesType>(s));
    strides.assign(shape.size(), 1);
    for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * sizes[i + 1];
    for (size_t i = 0; i < shape.size(); ++i) order.push_back(static_cast<executorch::aten::DimOrderType>(i));
    impl = std::make_unique<TensorImpl>(dtype, static_cast<ssize_t>(shape.size()), sizes.data(), bytes.data(),
                                        order.data(), strides.data(),
                                        executorch::aten::TensorShapeDynamism::DYNAMIC_BOUND);
  }
  Tensor tensor() { return Tensor(impl.get()); }
  static std::vector<uint8_t> read(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), {}};
  }
};

ScalarType dtype_of(const std::string& name) {
  return name == "float16" ? ScalarType::Half : name == "bfloat16" ? ScalarType::BFloat16 : ScalarType::Float;
}

bool call(const char* op, std::vector<EValue>& args, std::string* why) {
  auto fn = executorch::runtime::get_op_function_from_registry(op);
  if (!fn.ok()) {
    *why = std::string(op) + " is not registered";
    return false;
  }
  std::vector<EValue*> stack;
  for (auto& a : args) stack.push_back(&a);
  KernelRuntimeContext ctx;
  (*fn)(ctx, {stack.data(), stack.size()});
  if (ctx.failure_state() != executorch::runtime::Error::Ok) {
    *why = std::string(op) + " failed";
    return false;
  }
  return true;
}

bool run_case(const std::string& dir, const nlohmann::json& c, std::string* why) {
  const std::string name = c["name"];
  const ScalarType dtype = dtype_of(c["dtype"]);
  auto load = [&](const char* key) {
    return std::make_unique<Owned>(dir + "/" + name + "." + key, c[std::string(key) + "_shape"], dtype);
  };
  const int64_t start = c["start_pos"];
  std::unique_ptr<Owned> result;
  if (c["op"] == "update_cache") {
    auto value = load("value");
    result = load("cache");
    Owned out(std::vector<uint8_t>(8), {1}, dtype);  // the op's placeholder output
    std::vector<EValue> args{EValue(value->tensor()), EValue(result->tensor()), EValue(start), EValue(out.tensor())};
    if (!call("llama::update_cache.out", args, why)) return false;
  } else {
    auto q = load("q"), k = load("k"), v = load("v");
    result = load("q");  // out: q's shape and dtype
    std::unique_ptr<Owned> mask;
    if (c["mask"]) mask = std::make_unique<Owned>(dir + "/" + name + ".mask", c["mask_shape"], ScalarType::Float);
    std::vector<EValue> args{EValue(q->tensor()), EValue(k->tensor()), EValue(v->tensor()), EValue(start),
                             mask ? EValue(mask->tensor()) : EValue(), EValue(0.0), EValue(bool(c["is_causal"])),
                             c["scale"].is_null() ? EValue() : EValue(double(c["scale"])), EValue(result->tensor())};
    if (!call("llama::custom_sdpa.out", args, why)) return false;
  }
  std::ofstream(dir + "/" + name + ".out", std::ios::binary)
      .write(reinterpret_cast<const char*>(result->bytes.data()), static_cast<std::streamsize>(result->bytes.size()));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: llama_twins_test DIR [THREADS]\n");
    return 2;
  }
  executorch::runtime::runtime_init();
  if (argc > 2) executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(std::stoi(argv[2]));
  const std::string dir = argv[1];
  std::ifstream f(dir + "/cases.json");
  const nlohmann::json cases = nlohmann::json::parse(f);
  int failures = 0;
  for (const auto& c : cases) {
    std::string why;
    if (run_case(dir, c, &why)) {
      std::printf("ok %s\n", c["name"].get<std::string>().c_str());
    } else {
      std::printf("FAIL %s: %s\n", c["name"].get<std::string>().c_str(), why.c_str());
      ++failures;
    }
  }
  return failures ? 1 : 0;
}
