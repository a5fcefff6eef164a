// Who owns the KV cache.
//
// Today every program keeps its cache inside the .pte as mutable buffers
// (InGraphCache): the runner only tracks the logical length so that turns can be
// admitted, rewound (/undo) and reset. An off-graph owner (future --kv-* flags)
// implements the same interface, holds the storage itself, and gets bind()
// before each forward so it can hand its buffers to the program.
#pragma once

#include <cstdint>
#include <string>

namespace llmrt {

class KvCacheOwner {
 public:
  virtual ~KvCacheOwner() = default;
  virtual const char* kind() const = 0;
  // Positions the cache can hold.
  virtual int64_t capacity() const = 0;
  // Positions currently holding valid entries.
  virtual int64_t length() const = 0;
  // Called before a forward that writes positions [pos, pos + n). Returns false
  // (with a reason) if the write cannot be done.
  virtual bool bind(int64_t pos, int64_t n, std::string* why) = 0;
  // Called after that forward succeeded.
  virtual void commit(int64_t pos, int64_t n) = 0;
  // Drop everything at or after `pos`. Returns false (with a reason) if not possible.
  virtual bool rewind(int64_t pos, std::string* why) = 0;
  virtual void reset() = 0;
  // One line for the report.
  virtual std::string describe() const = 0;
};

// The program owns the cache (mutable buffers); entries past the current
// position are masked by the program, so a rewind is only bookkeeping.
class InGraphCache final : public KvCacheOwner {
 public:
  explicit InGraphCache(int64_t capacity) : capacity_(capacity) {}
  const char* kind() const override { return "in-graph"; }
  int64_t capacity() const override { return capacity_; }
  int64_t length() const override { return length_; }
  bool bind(int64_t pos, int64_t n, std::string* why) override {
    if (pos < 0 || pos > length_ || pos + n > capacity_) {
      if (why)
        *why = "write of positions [" + std::to_string(pos) + ", " + std::to_string(pos + n) +
               ") does not fit the cache (length " + std::to_string(length_) + ", capacity " +
               std::to_string(capacity_) + ")";
      return false;
    }
    return true;
  }
  void commit(int64_t pos, int64_t n) override { length_ = pos + n; }
  bool rewind(int64_t pos, std::string* why) override {
    if (pos < 0 || pos > length_) {
      if (why)
        *why = "cannot rewind to " + std::to_string(pos) + " (length " + std::to_string(length_) +
               ")";
      return false;
    }
    length_ = pos;
    return true;
  }
  void reset() override { length_ = 0; }
  std::string describe() const override {
    return "[cache] in-graph (program-owned) | capacity=" + std::to_string(capacity_);
  }

 private:
  int64_t capacity_;
  int64_t length_ = 0;
};

}  // namespace llmrt
