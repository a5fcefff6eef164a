// A read-only, bounds-checked view of a FlatBuffers buffer: just enough to walk a .pte's execution plan
// by field number (the wheel ships neither the flatbuffers headers nor the generated schema code).
// Every accessor checks its bytes against the buffer and returns "absent" instead of reading outside,
// so a damaged buffer can be walked safely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace llmrt::fb {

class View {
 public:
  View(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t size() const { return size_; }

  bool has(size_t pos, size_t n) const { return pos <= size_ && n <= size_ - pos; }

  template <class T>
  std::optional<T> read(size_t pos) const {
    if (!has(pos, sizeof(T))) return std::nullopt;
    T v;
    std::memcpy(&v, data_ + pos, sizeof(T));  // unaligned, little-endian like the format
    return v;
  }

  // The position an offset field at `pos` points to (uoffset: forward, relative to itself).
  std::optional<size_t> follow(size_t pos) const {
    auto off = read<uint32_t>(pos);
    if (!off || !has(pos + *off, 4)) return std::nullopt;
    return pos + *off;
  }

  const uint8_t* bytes(size_t pos) const { return data_ + pos; }

 private:
  const uint8_t* data_;
  size_t size_;
};

// A table: fields are found through its vtable; a field the vtable does not list is absent, and so is
// every field of an empty Table (a sub-table that was absent), so accessors chain safely.
class Table {
 public:
  Table() = default;
  Table(const View* v, size_t pos) : v_(v), pos_(pos) {}
  explicit operator bool() const { return v_ != nullptr; }

  // The root table of a buffer (offset at byte 0).
  static Table root(const View& v) {
    auto p = v.follow(0);
    return p ? Table(&v, *p).checked() : Table();
  }

  // The byte position of field `id`, if present.
  std::optional<size_t> field(int id) const {
    if (!v_) return std::nullopt;  // an empty Table: every field is absent
    auto soff = v_->read<int32_t>(pos_);
    if (!soff) return std::nullopt;
    const int64_t vt = static_cast<int64_t>(pos_) - *soff;
    if (vt < 0) return std::nullopt;
    auto vsize = v_->read<uint16_t>(static_cast<size_t>(vt));
    const size_t slot = 4 + 2 * static_cast<size_t>(id);
    if (!vsize || slot + 2 > *vsize) return std::nullopt;
    auto off = v_->read<uint16_t>(static_cast<size_t>(vt) + slot);
    if (!off || *off == 0 || !v_->has(pos_ + *off, 1)) return std::nullopt;
    return pos_ + *off;
  }

  template <class T>
  T scalar(int id, T fallback) const {
    auto p = field(id);
    auto v = p ? v_->read<T>(*p) : std::nullopt;
    return v ? *v : fallback;
  }

  // A sub-table field, or an empty Table if absent or out of bounds.
  Table table(int id) const {
    auto p = field(id);
    auto t = p ? v_->follow(*p) : std::nullopt;
    return t ? Table(v_, *t).checked() : Table();
  }

  // A vector field: its element count and the position of element 0 (absent: nullopt).
  struct Vec {
    size_t len = 0, start = 0;
  };
  std::optional<Vec> vec(int id, size_t elem_size) const {
    auto p = field(id);
    auto t = p ? v_->follow(*p) : std::nullopt;
    if (!t) return std::nullopt;
    auto len = v_->read<uint32_t>(*t);
    if (!len || !v_->has(*t + 4, static_cast<size_t>(*len) * elem_size)) return std::nullopt;
    return Vec{*len, *t + 4};
  }

  // Element k of a vector of tables.
  Table elem(const Vec& vec, size_t k) const {
    if (!v_ || k >= vec.len) return Table();
    auto t = v_->follow(vec.start + 4 * k);
    return t ? Table(v_, *t).checked() : Table();
  }

  std::optional<std::string_view> string(int id) const {
    auto v = vec(id, 1);
    if (!v) return std::nullopt;
    return std::string_view(reinterpret_cast<const char*>(v_->bytes(v->start)), v->len);
  }

  // The buffer of a non-empty Table (one a vec() or field() came from).
  const View& view() const { return *v_; }

 private:
  // A table whose first word (its vtable offset) is readable; else empty.
  Table checked() const { return v_->read<int32_t>(pos_) ? *this : Table(); }

  const View* v_ = nullptr;
  size_t pos_ = 0;
};

}  // namespace llmrt::fb
