#include "runtime/pte_check.h"

#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/flatbuffer_view.h"
#include "runtime/llm_program.h"
#include "runtime/sha256.h"
#include "platform/sysmem.h"

namespace llmrt {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string dir_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

std::string base_of(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The digest manifest.json records for `path` (keyed by the file's name), or a ProgramError that
// says what is missing; `actual` goes into the message so a user can compare by hand.
std::string manifest_digest(const std::string& path, const std::string& actual) {
  const std::string manifest = dir_of(path) + "/manifest.json";
  const std::string key = base_of(path);
  auto missing = [&](const std::string& why) {
    return ProgramError("--verify-pte: " + why + "; cannot verify '" + path + "' (expected: no record, actual " +
                        actual + ")");
  };
  std::ifstream in(manifest, std::ios::binary);
  if (!in) throw missing("no manifest.json beside it (" + manifest + ")");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw missing(manifest + " is not a JSON object");
  auto outputs = j.find("outputs");
  if (outputs == j.end() || !outputs->is_object()) throw missing(manifest + " has no \"outputs\" object");
  auto entry = outputs->find(key);
  if (entry == outputs->end() || !entry->is_object())
    throw missing(manifest + " has no record of \"" + key + "\" in \"outputs\"");
  auto sha = entry->find("sha256");
  if (sha == entry->end() || !sha->is_string() || !is_sha256_hex(sha->get<std::string>()))
    throw missing(manifest + " records no valid \"sha256\" for \"" + key + "\"");
  return lower(sha->get<std::string>());
}

}  // namespace

bool is_sha256_hex(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

std::string verify_pte_digest(const std::string& path, const std::string& spec) {
  std::string actual;
  try {
    actual = sha256_file_hex(path);
  } catch (const std::runtime_error& e) {
    throw ProgramError(std::string("--verify-pte: ") + e.what());
  }
  const bool from_manifest = spec == "auto";
  const std::string expected = from_manifest ? manifest_digest(path, actual) : lower(spec);
  if (expected != actual)
    throw ProgramError("--verify-pte: '" + path + "' does not match its recorded digest: expected sha256 " +
                       expected + (from_manifest ? " (" + dir_of(path) + "/manifest.json)" : std::string()) +
                       ", actual " + actual + " (damaged or a different file)");
  return actual;
}

}  // namespace llmrt

// ---------------------------------------------------------------------------------------------------------
// check_program_plans: the execution plans, read with the field numbers of ExecuTorch's program.fbs and
// the XNNPACK delegate's runtime_schema.fbs (a union field takes two numbers: its type, then its value).

namespace llmrt {

namespace {

namespace program_f { enum { execution_plan = 1, backend_delegate_data = 3, segments = 4, named_data = 7 }; }
namespace named_data_f { enum { key = 0, segment_index = 1 }; }
namespace plan_f { enum { name = 0, values = 2, chains = 5, operators = 6, delegates = 7, buffer_sizes = 8 }; }
namespace evalue_f { enum { val_type = 0, val = 1 }; }
enum KernelType : uint8_t { kTensor = 5 };
namespace tensor_f { enum { data_buffer_idx = 5, allocation_info = 6, extra_tensor_info = 9 }; }
namespace extra_info_f { enum { location = 2 }; }
namespace op_f { enum { name = 0, overload = 1 }; }
namespace chain_f { enum { instructions = 2 }; }
namespace instr_f { enum { args_type = 0, args = 1 }; }
enum InstrKind : uint8_t { kKernelCall = 1, kDelegateCall = 2, kJumpFalseCall = 4 };
namespace call_f { enum { index = 0, args = 1, destination = 1 }; }  // op / delegate / cond index first
namespace delegate_f { enum { id = 0, processed = 1, compile_specs = 2 }; }
namespace data_ref_f { enum { location = 0, index = 1 }; }
namespace spec_f { enum { key = 0, value = 1 }; }
namespace segment_f { enum { offset = 0, size = 1 }; }
namespace xnn_graph_f { enum { xnodes = 1, xvalues = 2, num_externs = 3, constant_data = 8 }; }
namespace xnn_tensor_f { enum { datatype = 0, dims = 2, constant_buffer_idx = 3 }; }
namespace xnn_constant_f { enum { offset = 0, size = 1, named_key = 2 }; }
namespace xnn_union_f { enum { type = 0, value = 1 }; }  // XValue.xvalue_union, XNode.xnode_union
enum XnnValueKind : uint8_t { kXnnQuantizedTensor = 2 };
namespace xnn_qtensor_f { enum { tensor = 0, params_type = 1, params = 2 }; }
enum XnnQuantKind : uint8_t { kPerChannelGroupQuant = 4 };
namespace xnn_group_quant_f { enum { group_size = 2 }; }
enum XnnNodeKind : uint8_t { kXnnDepthwiseConv2d = 13 };
namespace xnn_conv_f { enum { group_input_channels = 10 }; }

// The whole file, mapped read-only.
class MappedPte {
 public:
  explicit MappedPte(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY);
    struct stat st;
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      if (fd >= 0) ::close(fd);
      throw ProgramError("cannot open .pte file '" + path + "': " + std::strerror(errno));
    }
    size_ = static_cast<size_t>(st.st_size);
    void* p = size_ ? ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    ::close(fd);
    if (p != MAP_FAILED) data_ = static_cast<const uint8_t*>(p);
  }
  ~MappedPte() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedPte(const MappedPte&) = delete;
  MappedPte& operator=(const MappedPte&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return data_ ? size_ : 0; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The extended header ("eh00" at byte 8): where the flatbuffer ends and the segments start.
struct PteLayout {
  size_t program_size = 0, segment_base = 0;
  bool has_segments = false;
};

PteLayout pte_layout(const fb::View& file) {
  PteLayout l;
  l.program_size = file.size();
  auto magic = file.read<uint32_t>(8);
  auto program_size = file.read<uint64_t>(16);
  auto segment_base = file.read<uint64_t>(24);
  if (magic && std::memcmp(file.bytes(8), "eh00", 4) == 0 && program_size && segment_base &&
      *program_size <= file.size() && *segment_base <= file.size()) {
    l.program_size = static_cast<size_t>(*program_size);
    l.segment_base = static_cast<size_t>(*segment_base);
    l.has_segments = true;
  }
  return l;
}

// The bytes of a delegate's data (inline in the flatbuffer or in a segment), if they can be found.
std::optional<fb::View> delegate_data(const fb::Table& program, const fb::Table& delegate, const fb::View& file,
                                      const PteLayout& layout) {
  fb::Table ref = delegate.table(delegate_f::processed);
  const auto index = ref.scalar<uint32_t>(data_ref_f::index, 0);
  if (ref.scalar<uint8_t>(data_ref_f::location, 0) == 0) {  // INLINE: backend_delegate_data[index].data
    auto list = program.vec(program_f::backend_delegate_data, 4);
    if (!list || index >= list->len) return std::nullopt;
    auto bytes = program.elem(*list, index).vec(0, 1);
    if (!bytes) return std::nullopt;
    return fb::View(program.view().bytes(bytes->start), bytes->len);
  }
  auto segments = program.vec(program_f::segments, 4);
  if (!layout.has_segments || !segments || index >= segments->len) return std::nullopt;
  fb::Table seg = program.elem(*segments, index);
  const uint64_t off = seg.scalar<uint64_t>(segment_f::offset, 0), n = seg.scalar<uint64_t>(segment_f::size, 0);
  if (off > file.size() || !file.has(layout.segment_base + off, n)) return std::nullopt;  // the loader refuses it
  return fb::View(file.bytes(layout.segment_base + off), n);
}

// An XNNPACK delegate's graph (its flatbuffer after the "XH00" header), or an empty Table.
fb::Table xnnpack_graph(const fb::View& blob, fb::View* graph_buf) {
  // XNNHeader: "XH00" at byte 4, then u16 header length, u32 flatbuffer offset, u32 flatbuffer size
  size_t fb_off = 0, fb_size = blob.size();
  if (blob.has(4, 4) && std::memcmp(blob.bytes(4), "XH00", 4) == 0) {
    auto off = blob.read<uint32_t>(10);
    auto n = blob.read<uint32_t>(14);
    if (!off || !n || !blob.has(*off, *n)) return fb::Table();
    fb_off = *off;
    fb_size = *n;
  }
  *graph_buf = fb::View(blob.bytes(fb_off), fb_size);
  return fb::Table::root(*graph_buf);
}

// Bits per element of an XNNPACK datatype (XNNDatatype), 0 if unknown.
int xnn_bits(int16_t datatype) {
  switch (datatype) {
    case 8: case 10: return 4;                                // qcint4, qbint4
    case 3: case 4: case 6: case 9: case 11: return 8;        // the 8-bit integer kinds
    case 2: case 14: return 16;                               // fp16, bf16
    case 1: case 5: case 7: case 12: case 13: return 32;      // fp32, qint32, qcint32, int32, pfp32
    default: return 0;
  }
}

// Bytes the dims of an XNNPACK tensor describe (saturating), or nullopt without dims or a known datatype.
std::optional<uint64_t> xnn_tensor_bytes(const fb::Table& tensor) {
  const int bits = xnn_bits(tensor.scalar<int16_t>(xnn_tensor_f::datatype, 0));
  auto dims = tensor.vec(xnn_tensor_f::dims, 4);
  if (!bits || !dims) return std::nullopt;
  unsigned __int128 n = 1;
  for (size_t k = 0; k < dims->len; ++k) {
    n *= *tensor.view().read<uint32_t>(dims->start + 4 * k);
    if (n > (unsigned __int128)UINT64_MAX) return UINT64_MAX;
  }
  n = (n * static_cast<unsigned>(bits) + 7) / 8;
  return n > (unsigned __int128)UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(n);
}

// The divisors XNNCompiler (ExecuTorch 1.5) uses unchecked: a quantization group size, a depthwise
// convolution's input channels per group (a damaged union type can turn another node into one). "" = fine.
std::string xnnpack_divisor_problem(const fb::Table& item, bool is_value) {
  const auto type = item.scalar<uint8_t>(xnn_union_f::type, 0);
  fb::Table value = item.table(xnn_union_f::value);
  if (is_value && type == kXnnQuantizedTensor &&
      value.scalar<uint8_t>(xnn_qtensor_f::params_type, 0) == kPerChannelGroupQuant &&
      value.table(xnn_qtensor_f::params).scalar<int32_t>(xnn_group_quant_f::group_size, 0) == 0)
    return "has a quantization group size of 0";
  if (!is_value && type == kXnnDepthwiseConv2d && value.scalar<uint32_t>(xnn_conv_f::group_input_channels, 0) == 0)
    return "(depthwise convolution) has 0 input channels per group";
  return "";
}

// What XNNCompiler (ExecuTorch 1.5) follows unchecked in a graph its flatbuffer verifier accepted: the value
// of every value and node union (a union may carry its type without its value) and the divisors above.
// "" = fine.
std::string xnnpack_graph_problem(const fb::Table& graph) {
  for (bool is_value : {true, false}) {
    const char* what = is_value ? "value" : "node";
    auto list = graph.vec(is_value ? xnn_graph_f::xvalues : xnn_graph_f::xnodes, 4);
    for (size_t k = 0; list && k < list->len; ++k) {
      fb::Table item = graph.elem(*list, k);
      fb::Table value = item ? item.table(xnn_union_f::value) : fb::Table();
      const std::string at = std::string(what) + " " + std::to_string(k);
      if (!value) return at + " has no value";
      if (is_value && item.scalar<uint8_t>(xnn_union_f::type, 0) == kXnnQuantizedTensor &&
          !value.table(xnn_qtensor_f::tensor))
        return at + " (quantized) has no tensor";
      const std::string divisor = xnnpack_divisor_problem(item, is_value);
      if (!divisor.empty()) return at + " " + divisor;
    }
  }
  return "";
}

// A constant tensor: its data lives in the program (mapped read-only), not in planned memory.
bool is_constant_tensor(const fb::Table& value) {
  if (value.scalar<uint8_t>(evalue_f::val_type, 0) != kTensor) return false;
  fb::Table t = value.table(evalue_f::val);
  if (!t || t.table(tensor_f::allocation_info)) return false;
  fb::Table extra = t.table(tensor_f::extra_tensor_info);
  const bool external = extra && extra.scalar<uint8_t>(extra_info_f::location, 0) == 1;
  return t.scalar<uint32_t>(tensor_f::data_buffer_idx, 0) > 0 || external;
}

// The argument a kernel writes by the operator naming convention: the last one of an out variant
// ("out", "Scalar_out", ...), the first one of an in-place op ("copy_"); -1 if neither.
int written_arg(std::string_view name, std::string_view overload, size_t n_args) {
  auto ends_with = [](std::string_view s, std::string_view tail) {
    return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
  };
  if (n_args == 0) return -1;
  if (overload == "out" || ends_with(overload, "_out")) return static_cast<int>(n_args) - 1;
  if (ends_with(name, "_") && !ends_with(name, "__")) return 0;
  return -1;
}

class PlanChecker {
 public:
  PlanChecker(const std::string& path, const fb::Table& program, const fb::View& file, const PteLayout& layout)
      : path_(path), program_(program), file_(file), layout_(layout) {}

  void check(const fb::Table& plan, size_t plan_index) {
    auto name = plan.string(plan_f::name);
    where_ = "execution plan " + std::to_string(plan_index);
    if (!name) fail("has no name");
    where_ = "method '" + std::string(*name) + "'";
    check_memory(plan);
    check_operators(plan);
    check_delegates(plan);
    values_ = plan.vec(plan_f::values, 4);
    plan_ = plan;
    auto chains = plan.vec(plan_f::chains, 4);
    for (size_t c = 0; chains && c < chains->len; ++c) check_chain(plan.elem(*chains, c), c);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ProgramError("'" + path_ + "' is damaged: " + where_ + " " + what +
                       " (refused before ExecuTorch would follow it; --verify-pte compares a file with its "
                       "recorded digest)");
  }

  // Module allocates every planned buffer up front: a damaged size would be a huge (or negative) request.
  void check_memory(const fb::Table& plan) {
    auto sizes = plan.vec(plan_f::buffer_sizes, 8);
    const uint64_t limit = physical_memory_bytes();  // a plan that asks for more cannot run here anyway
    uint64_t total = 0;
    for (size_t k = 0; sizes && k < sizes->len; ++k) {
      const int64_t n = *plan.view().read<int64_t>(sizes->start + 8 * k);
      if (n < 0) fail("plans " + std::to_string(n) + " bytes for buffer " + std::to_string(k));
      // too much may also be a valid program too large for this machine: say both
      if (static_cast<uint64_t>(n) > limit - total)
        throw ProgramError("'" + path_ + "' cannot run here: " + where_ + " plans " + std::to_string(n) +
                           " bytes for buffer " + std::to_string(k) + " (" + std::to_string(total) +
                           " before it), more than this machine's " + std::to_string(limit) +
                           " bytes of memory (a damaged file, or a program too large for this machine)");
      total += static_cast<uint64_t>(n);
    }
  }

  void check_operators(const fb::Table& plan) {
    auto ops = plan.vec(plan_f::operators, 4);
    n_ops_ = ops ? ops->len : 0;
    for (size_t k = 0; k < n_ops_; ++k)
      if (!plan.elem(*ops, k).string(0)) fail("has operator " + std::to_string(k) + " without a name");
  }

  void check_delegates(const fb::Table& plan) {
    auto delegates = plan.vec(plan_f::delegates, 4);
    n_delegates_ = delegates ? delegates->len : 0;
    xnn_args_.assign(n_delegates_, 0);
    for (size_t k = 0; k < n_delegates_; ++k) {
      fb::Table d = plan.elem(*delegates, k);
      const std::string what = "has delegate " + std::to_string(k);
      auto id = d.string(delegate_f::id);
      if (!id) fail(what + " without a backend id");
      if (!d.table(delegate_f::processed)) fail(what + " without a data reference");
      check_compile_specs(d, what);
      if (*id == "XnnpackBackend") check_xnnpack(d, k, what);
    }
  }

  // The executor indexes the call's arguments by the graph's external ids (below num_externs), unchecked.
  void check_xnnpack(const fb::Table& d, size_t k, const std::string& what) {
    auto blob = delegate_data(program_, d, file_, layout_);
    fb::View graph_buf(nullptr, 0);
    fb::Table graph = blob ? xnnpack_graph(*blob, &graph_buf) : fb::Table();
    if (!graph) return;  // not found or not readable: XNNPACK's own checks refuse it
    std::string problem = xnnpack_graph_problem(graph);
    if (problem.empty()) problem = xnnpack_constant_problem(graph);
    if (!problem.empty()) fail(what + " (XNNPACK): graph " + problem);
    xnn_args_[k] = graph.scalar<uint32_t>(xnn_graph_f::num_externs, 0);
  }

  // XNNPACK reads as many bytes of a constant as its dims say (packing weights): they must be there.
  std::string xnnpack_constant_problem(const fb::Table& graph) const {
    auto constants = graph.vec(xnn_graph_f::constant_data, 4);
    auto values = graph.vec(xnn_graph_f::xvalues, 4);
    for (size_t k = 0; constants && values && k < values->len; ++k) {
      fb::Table item = graph.elem(*values, k), value = item.table(xnn_union_f::value);
      fb::Table tensor = item.scalar<uint8_t>(xnn_union_f::type, 0) == kXnnQuantizedTensor
                             ? value.table(xnn_qtensor_f::tensor) : value;
      const auto idx = tensor.scalar<uint32_t>(xnn_tensor_f::constant_buffer_idx, 0);
      if (idx == 0 || idx >= constants->len) continue;  // not a constant, or XNNCompiler refuses the index
      auto have = constant_size(graph.elem(*constants, idx));
      auto need = xnn_tensor_bytes(tensor);
      if (have && need && *need > *have)
        return "value " + std::to_string(k) + " has dims of " + std::to_string(*need) + " bytes for " +
               std::to_string(*have) + " bytes of constant data";
    }
    return "";
  }

  // The bytes behind an XNNPACK constant: its own size, or the segment of its named data.
  std::optional<uint64_t> constant_size(const fb::Table& constant) const {
    auto key = constant.string(xnn_constant_f::named_key);
    if (!key) return constant.scalar<uint64_t>(xnn_constant_f::size, 0);
    auto named = program_.vec(program_f::named_data, 4);
    auto segments = program_.vec(program_f::segments, 4);
    for (size_t k = 0; named && segments && k < named->len; ++k) {
      fb::Table entry = program_.elem(*named, k);
      if (entry.string(named_data_f::key) != key) continue;
      const auto seg = entry.scalar<uint32_t>(named_data_f::segment_index, 0);
      if (seg >= segments->len) return std::nullopt;
      return program_.elem(*segments, seg).scalar<uint64_t>(segment_f::size, 0);
    }
    return std::nullopt;  // the data map refuses an unknown key itself
  }

  void check_compile_specs(const fb::Table& d, const std::string& what) {
    auto specs = d.vec(delegate_f::compile_specs, 4);
    for (size_t s = 0; specs && s < specs->len; ++s) {
      fb::Table spec = d.elem(*specs, s);
      if (!spec || !spec.string(spec_f::key) || !spec.vec(spec_f::value, 1))
        fail(what + " with compile spec " + std::to_string(s) + " missing its key or value");
    }
  }

  void check_chain(const fb::Table& chain, size_t c) {
    auto instrs = chain.vec(chain_f::instructions, 4);
    if (!instrs) fail("has chain " + std::to_string(c) + " without instructions");
    for (size_t i = 0; i < instrs->len; ++i) {
      fb::Table ins = chain.elem(*instrs, i);
      fb::Table args = ins.table(instr_f::args);
      if (!args) continue;  // the loader refuses a null instruction itself
      const std::string at = "instruction " + std::to_string(i) + " of chain " + std::to_string(c);
      const auto index = args.scalar<int32_t>(call_f::index, 0);
      switch (ins.scalar<uint8_t>(instr_f::args_type, 0)) {
        case kKernelCall:
          if (index < 0 || static_cast<size_t>(index) >= n_ops_)
            fail(at + " calls operator " + std::to_string(index) + " of " + std::to_string(n_ops_));
          check_written_arg(args, static_cast<size_t>(index), at);
          break;
        case kDelegateCall: check_delegate_call(args, index, at); break;
        case kJumpFalseCall: {
          const auto dest = args.scalar<int32_t>(call_f::destination, 0);
          if (dest < 0 || static_cast<size_t>(dest) > instrs->len)
            fail(at + " jumps to instruction " + std::to_string(dest) + " of " + std::to_string(instrs->len));
          break;
        }
        default: break;  // the other kinds the loader checks itself
      }
    }
  }

  // A kernel writing into a constant would write into the read-only mapped file (SIGSEGV).
  void check_written_arg(const fb::Table& args, size_t op_index, const std::string& at) {
    auto list = args.vec(call_f::args, 4);
    auto ops = plan_.vec(plan_f::operators, 4);
    if (!list || !ops || !values_) return;  // the loader refuses missing args itself
    fb::Table op = plan_.elem(*ops, op_index);
    const int w = written_arg(op.string(op_f::name).value_or(""), op.string(op_f::overload).value_or(""), list->len);
    if (w < 0) return;
    const int32_t v = *args.view().read<int32_t>(list->start + 4 * static_cast<size_t>(w));
    if (v < 0 || static_cast<size_t>(v) >= values_->len) return;  // the loader refuses a bad index itself
    if (is_constant_tensor(plan_.elem(*values_, static_cast<size_t>(v))))
      fail(at + " (" + std::string(op.string(op_f::name).value_or("?")) + ") writes its output into constant value " +
           std::to_string(v));
  }

  void check_delegate_call(const fb::Table& args, int32_t index, const std::string& at) {
    if (index < 0 || static_cast<size_t>(index) >= n_delegates_)
      fail(at + " calls delegate " + std::to_string(index) + " of " + std::to_string(n_delegates_));
    auto list = args.vec(call_f::args, 4);
    const size_t given = list ? list->len : 0, needed = xnn_args_[static_cast<size_t>(index)];
    if (given < needed)
      fail(at + " passes " + std::to_string(given) + " arguments to XNNPACK delegate " + std::to_string(index) +
           ", whose graph has " + std::to_string(needed) + " external values");
  }

  const std::string& path_;
  const fb::Table& program_;
  const fb::View& file_;
  const PteLayout& layout_;
  std::string where_;
  fb::Table plan_;
  std::optional<fb::Table::Vec> values_;
  size_t n_ops_ = 0, n_delegates_ = 0;
  std::vector<size_t> xnn_args_;  // per delegate: arguments its XNNPACK graph needs (0 = not XNNPACK)
};

}  // namespace

void check_program_plans(const std::string& path) {
  MappedPte mapped(path);
  fb::View file(mapped.data(), mapped.size());
  const PteLayout layout = pte_layout(file);
  fb::View flatbuffer(mapped.data(), layout.program_size);
  fb::Table program = fb::Table::root(flatbuffer);
  auto plans = program ? program.vec(program_f::execution_plan, 4) : std::nullopt;
  if (!plans) return;  // nothing to walk: the loader has already refused such a file
  PlanChecker checker(path, program, file, layout);
  for (size_t p = 0; p < plans->len; ++p) {
    fb::Table plan = program.elem(*plans, p);
    if (plan) checker.check(plan, p);
  }
}

}  // namespace llmrt
