// Shared by the command-line runners (llm_runner, llm_batched_runner): usage errors, number
// parsing, the ExecuTorch log filter and the thread-pool hook.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include <executorch/runtime/platform/platform.h>

// The wheel ships the thread pool library but not its header; these two
// members are all the runners need (for --threads).
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace llmrt::cli {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Bad usage: the runners exit 2 with the message.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline int64_t parse_int(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    long long x = std::stoll(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return x;
  } catch (const std::exception&) {
    throw UsageError(flag + " expects an integer, got '" + v + "'");
  }
}

inline double parse_double(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    double x = std::stod(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return x;
  } catch (const std::exception&) {
    throw UsageError(flag + " expects a number, got '" + v + "'");
  }
}

// ExecuTorch logs Info lines to stderr; keep only errors.
inline void pal_log(et_timestamp_t, et_pal_log_level_t level, const char* filename, const char*, size_t line,
                    const char* message, size_t length) {
  if (level != kError && level != kFatal) return;
  while (length > 0 && (message[length - 1] == '\n' || message[length - 1] == '\r')) --length;
  const char* base = filename ? std::strrchr(filename, '/') : nullptr;
  std::fprintf(stderr, "[executorch %c %s:%zu] %.*s\n", static_cast<char>(level),
               base ? base + 1 : (filename ? filename : "?"), line, static_cast<int>(length), message);
}

// --threads N (0 = the runtime default); returns the pool's thread count.
inline int set_threads(int64_t n) {
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool && n > 0) pool->_unsafe_reset_threadpool(static_cast<uint32_t>(n));
  return pool ? static_cast<int>(pool->get_thread_count()) : 0;
}

}  // namespace llmrt::cli
