// The wheel ships the thread pool library but not its header: the members of ExecuTorch's ThreadPool that the
// runners (--threads), attention_test and attention_bench call.
#pragma once

#include <cstddef>
#include <cstdint>

namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool
