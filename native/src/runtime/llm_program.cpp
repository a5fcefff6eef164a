#include <algorithm>
#include "runtime/llm_program.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <unordered_set>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/evalue.h>

#include "kernels/offgraph_cache.h"
#include "runtime/pte_check.h"

namespace llmrt {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::module::Module;
using executorch::runtime::Error;
using executorch::runtime::EValue;

const char* scalar_type_name(int64_t code) {
  switch (code) {
    case 0: return "Byte";
    case 1: return "Char";
    case 2: return "Short";
    case 3: return "Int";
    case 4: return "Long";
    case 5: return "Half";
    case 6: return "Float";
    case 7: return "Double";
    case 11: return "Bool";
    case 15: return "BFloat16";
    default: return "?";
  }
}

const char* logits_mode_name(int64_t mode) {
  switch (mode) {
    case 0: return "full";
    case 1: return "last";
    case 2: return "selected";
    case 3: return "tail";
    default: return "?";
  }
}

namespace {

std::string err_text(Error e) {
  return std::string(executorch::runtime::to_string(e)) + " (code " +
         std::to_string(static_cast<int>(e)) + ")";
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Renders any EValue as text (for get_recipe_hash, whatever its type).
std::string evalue_text(const EValue& v) {
  if (v.isString()) return std::string(v.toString());
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isDouble()) return std::to_string(v.toDouble());
  if (v.isBool()) return v.toBool() ? "true" : "false";
  if (v.isNone()) return "None";
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    std::string s = "tensor(";
    if (t.scalar_type() == ScalarType::Byte || t.scalar_type() == ScalarType::Char) {
      // A byte tensor is most likely text or a digest: show it as hex.
      static const char* hex = "0123456789abcdef";
      const auto* p = static_cast<const uint8_t*>(t.const_data_ptr());
      for (ssize_t i = 0; i < t.numel(); ++i) {
        s += hex[p[i] >> 4];
        s += hex[p[i] & 15];
      }
    } else if (t.scalar_type() == ScalarType::Long || t.scalar_type() == ScalarType::Int) {
      for (ssize_t i = 0; i < t.numel(); ++i) {
        if (i) s += ",";
        s += std::to_string(t.scalar_type() == ScalarType::Long
                                ? t.const_data_ptr<int64_t>()[i]
                                : t.const_data_ptr<int32_t>()[i]);
      }
    } else {
      s += std::string(scalar_type_name(static_cast<int64_t>(t.scalar_type()))) + "[" +
           std::to_string(t.numel()) + "]";
    }
    return s + ")";
  }
  if (v.isIntList()) {
    std::string s = "[";
    auto l = v.toIntList();
    for (size_t i = 0; i < l.size(); ++i) s += (i ? "," : "") + std::to_string(l[i]);
    return s + "]";
  }
  return "<" + std::to_string(static_cast<int>(v.tag)) + ">";
}

// Why load_method may have failed: a missing kernel or backend names itself; anything else in a file that
// passed the verifier is most likely damage inside it (delegate blobs and segments are not verified).
std::string load_hint(Error e) {
  if (e == Error::OperatorMissing || e == Error::NotFound)
    return " (an operator or backend missing from this runner, or a damaged program?)";
  return " (a damaged program? --verify-pte checks it against its recorded digest)";
}

bool evalue_int(const EValue& v, int64_t* out) {
  if (v.isInt()) {
    *out = v.toInt();
    return true;
  }
  if (v.isBool()) {
    *out = v.toBool();
    return true;
  }
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (t.numel() != 1) return false;
    switch (t.scalar_type()) {
      case ScalarType::Long: *out = t.const_data_ptr<int64_t>()[0]; return true;
      case ScalarType::Int: *out = t.const_data_ptr<int32_t>()[0]; return true;
      default: return false;
    }
  }
  return false;
}

}  // namespace

LlmProgram::~LlmProgram() = default;

int64_t LlmProgram::read_int(const std::string& method, bool required, int64_t fallback) {
  auto names = module_->method_names();
  if (!names.ok() || names->count(method) == 0) {
    if (required)
      throw ProgramError("the program has no constant method '" + method +
                         "' (required by this runner; re-export with the pipeline)");
    return fallback;
  }
  auto r = module_->execute(method);
  if (!r.ok()) throw ProgramError("running constant method '" + method + "' failed: " + err_text(r.error()));
  if (r->empty()) throw ProgramError("constant method '" + method + "' returned nothing");
  int64_t v = 0;
  if (!evalue_int((*r)[0], &v))
    throw ProgramError("constant method '" + method + "' does not return an integer (got " +
                       evalue_text((*r)[0]) + ")");
  return v;
}

std::vector<int64_t> LlmProgram::read_int_list(const std::string& method) {
  auto names = module_->method_names();
  if (!names.ok() || names->count(method) == 0)
    throw ProgramError("the program has no constant method '" + method + "'" +
                       (method.rfind("get_ring", 0) == 0 ? std::string()
                                                         : " (required for the off-graph KV cache; re-export "
                                                           "with cache.mode=offgraph)"));
  auto r = module_->execute(method);
  if (!r.ok()) throw ProgramError("running constant method '" + method + "' failed: " + err_text(r.error()));
  std::vector<int64_t> out;
  for (const EValue& v : *r) {
    if (v.isTensor() && v.toTensor().scalar_type() == ScalarType::Long) {
      const auto& t = v.toTensor();
      for (ssize_t i = 0; i < t.numel(); ++i) out.push_back(t.const_data_ptr<int64_t>()[i]);
    } else if (v.isTensor() && v.toTensor().scalar_type() == ScalarType::Int) {
      const auto& t = v.toTensor();
      for (ssize_t i = 0; i < t.numel(); ++i) out.push_back(t.const_data_ptr<int32_t>()[i]);
    } else if (v.isIntList()) {
      for (int64_t x : v.toIntList()) out.push_back(x);
    } else {
      int64_t x;
      if (!evalue_int(v, &x))
        throw ProgramError("constant method '" + method + "' returned a non-integer value (" +
                           evalue_text(v) + ")");
      out.push_back(x);
    }
  }
  return out;
}

bool LlmProgram::has_method(const std::string& name) const {
  auto names = module_->method_names();
  return names.ok() && names->count(name) > 0;
}

LlmProgram::CacheGeometry LlmProgram::cache_geometry() {
  CacheGeometry g;
  g.n_caches = read_int("get_n_caches", true, 0);
  if (g.n_caches <= 0)
    throw ProgramError("constant method 'get_n_caches' returned " + std::to_string(g.n_caches) +
                       " (must be positive)");
  // The cache is sized from these: a damaged value must not reach its size arithmetic. Real models have
  // at most a few hundred heads of a few hundred dims; windows are positions.
  auto list = [&](const char* m, int64_t lo, int64_t hi) {
    std::vector<int64_t> v = read_int_list(m);
    if (static_cast<int64_t>(v.size()) != g.n_caches)
      throw ProgramError(std::string("constant method '") + m + "' has " + std::to_string(v.size()) +
                         " entries for " + std::to_string(g.n_caches) + " caches");
    for (int64_t x : v)
      if (x < lo || x > hi)
        throw ProgramError(std::string("constant method '") + m + "' returned " + std::to_string(x) +
                           " (must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "])");
    return v;
  };
  constexpr int64_t kMaxDim = 1 << 16, kMaxWindow = INT32_MAX;
  g.kv_heads = list("get_kv_heads", 1, kMaxDim);
  g.head_dims = list("get_head_dims", 1, kMaxDim);
  auto names = module_->method_names();
  g.v_dims = names.ok() && names->count("get_v_head_dims") ? list("get_v_head_dims", 1, kMaxDim) : g.head_dims;
  g.windows = list("get_windows", 0, kMaxWindow);
  if (names.ok() && names->count("get_n_shared_layers")) {
    g.n_shared = read_int("get_n_shared_layers", true, 0);
    if (g.n_shared < 0 || g.n_shared > kMaxDim)
      throw ProgramError("constant method 'get_n_shared_layers' returned " + std::to_string(g.n_shared) +
                         " (must be in [0, " + std::to_string(kMaxDim) + "])");
  }
  return g;
}

// The runner sizes its token and logits buffers from get_max_seq_len and get_vocab_size: they must agree
// with forward's own tensors (their upper bounds), so a damaged constant cannot ask for gigabytes.
void LlmProgram::check_buffer_sizes(const executorch::runtime::MethodMeta& meta) const {
  // the last dim of a tensor's (upper-bound) sizes, or -1
  auto last_dim = [](const auto& info) -> int64_t {
    return info.ok() && !info->sizes().empty() ? info->sizes()[info->sizes().size() - 1] : -1;
  };
  const int64_t chunk = last_dim(meta.input_tensor_meta(0));
  if (chunk >= 0 && info_.max_seq_len > chunk)
    throw ProgramError("get_max_seq_len (" + std::to_string(info_.max_seq_len) +
                       ") is larger than forward's tokens input (" + std::to_string(chunk) + ")");
  const int64_t width = meta.num_outputs() > 0 ? last_dim(meta.output_tensor_meta(0)) : -1;
  if (width >= 0 && info_.vocab_size != width)
    throw ProgramError("get_vocab_size (" + std::to_string(info_.vocab_size) + ") differs from forward's logits width (" +
                       std::to_string(width) + ")");
}

namespace {

void check_regular_file(const std::string& path, const char* what) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw ProgramError(std::string("cannot open ") + what + " '" + path + "': " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw ProgramError("'" + path + "' is not a regular file");
}

// The data files a program names in get_data_files (comma-separated file names), each where --data gave it or
// else beside the .pte.
std::vector<std::string> resolve_data_files(const std::string& pte, const std::string& listed,
                                            const std::vector<std::string>& given) {
  std::vector<std::string> out;
  const auto slash = pte.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : pte.substr(0, slash + 1);
  size_t start = 0;
  while (start <= listed.size()) {
    size_t end = listed.find(',', start);
    if (end == std::string::npos) end = listed.size();
    const std::string name = listed.substr(start, end - start);
    start = end + 1;
    if (name.empty()) continue;
    std::string found;
    for (const auto& g : given) {
      const auto s = g.find_last_of('/');
      if ((s == std::string::npos ? g : g.substr(s + 1)) == name) found = g;
    }
    if (found.empty() && given.size() == 1 && listed.find(',') == std::string::npos) found = given[0];  // renamed
    if (found.empty()) {
      found = dir + name;
      struct stat st;
      if (::stat(found.c_str(), &st) != 0)
        throw ProgramError("the program reads its weights from " + name + " (an adapter program over a shared "
                           "foundation), which is not beside it: --data PATH/" + name);
    }
    check_regular_file(found, "data file");
    out.push_back(found);
  }
  return out;
}

}  // namespace

void LlmProgram::open_module(const std::string& path, const std::vector<std::string>& data) {
  module_ = data.empty() ? std::make_unique<Module>(path, Module::LoadMode::Mmap)
                         : std::make_unique<Module>(path, data, Module::LoadMode::Mmap);
  // InternalConsistency: the flatbuffer verifier checks every offset and length before the loader
  // follows them (Minimal, the default, only checks the header: a damaged file could crash the load).
  Error e = module_->load(executorch::runtime::Program::Verification::InternalConsistency);
  if (e != Error::Ok)
    throw ProgramError("cannot load .pte file '" + path + "': " + err_text(e) +
                       " (damaged or not an ExecuTorch program?)");
}

LlmProgram::LlmProgram(const std::string& path, const std::vector<std::string>& data) {
  check_regular_file(path, ".pte file");
  for (const auto& d : data) check_regular_file(d, "data file");
  open_module(path, {});
  auto listed = module_->method_names();
  if (listed.ok() && listed->count("get_data_files")) {
    auto r = module_->execute("get_data_files");
    if (!r.ok() || r->size() != 1 || !(*r)[0].isString())
      throw ProgramError("constant method 'get_data_files' must return one string (file names)");
    data_files_ = resolve_data_files(path, std::string((*r)[0].toString()), data);
    open_module(path, data_files_);
  } else if (!data.empty()) {
    throw ProgramError("--data: the program '" + path + "' reads no data files (it holds its own weights)");
  }
  // before any method loads: what the verifier does not cover and the loader would follow blindly
  check_program_plans(path);
  auto names = module_->method_names();
  if (!names.ok()) throw ProgramError("cannot list the methods of '" + path + "'");
  if (names->count("forward") == 0) throw ProgramError("the program has no 'forward' method");

  auto positive = [&](const char* m) {
    int64_t v = read_int(m, true, 0);
    if (v <= 0)
      throw ProgramError(std::string("constant method '") + m + "' returned " + std::to_string(v) +
                         " (must be positive)");
    return v;
  };
  info_.max_context_len = positive("get_max_context_len");
  info_.max_seq_len = positive("get_max_seq_len");
  info_.vocab_size = positive("get_vocab_size");
  info_.activation_dtype = positive("get_activation_dtype");
  if (info_.activation_dtype != 5 && info_.activation_dtype != 6 && info_.activation_dtype != 15)
    throw ProgramError("constant method 'get_activation_dtype' returned " +
                       std::to_string(info_.activation_dtype) +
                       " (expected 5 Half, 6 Float or 15 BFloat16)");
  info_.logits_mode = read_int("get_logits_to_keep_mode", true, 0);
  if (info_.logits_mode < 0 || info_.logits_mode > 3)
    throw ProgramError("constant method 'get_logits_to_keep_mode' returned " +
                       std::to_string(info_.logits_mode) + " (expected 0 full, 1 last, 2 selected, 3 tail)");
  if (info_.logits_mode == 3) {
    info_.tail_rows = read_int("get_tail_rows", true, 0);
    if (info_.tail_rows < 1)
      throw ProgramError("constant method 'get_tail_rows' returned " + std::to_string(info_.tail_rows) +
                         " (a `tail` program returns at least one row)");
  }
  info_.bos_id = read_int("get_bos_id", true, -1);
  if (info_.bos_id < 0 || info_.bos_id >= info_.vocab_size)
    throw ProgramError("constant method 'get_bos_id' returned " + std::to_string(info_.bos_id) +
                       " (must be a token id in [0, vocab size))");
  if (info_.max_seq_len > info_.max_context_len)
    throw ProgramError("get_max_seq_len (" + std::to_string(info_.max_seq_len) +
                       ") is larger than get_max_context_len (" +
                       std::to_string(info_.max_context_len) + ")");

  if (names->count("get_eos_ids") == 0)
    throw ProgramError("the program has no constant method 'get_eos_ids' (required by this runner)");
  {
    auto r = module_->execute("get_eos_ids");
    if (!r.ok()) throw ProgramError("running constant method 'get_eos_ids' failed: " + err_text(r.error()));
    for (const EValue& v : *r) {
      int64_t id;
      if (evalue_int(v, &id)) {
        info_.eos_ids.push_back(id);
      } else if (v.isTensor() && (v.toTensor().scalar_type() == ScalarType::Long)) {
        const auto& t = v.toTensor();
        for (ssize_t i = 0; i < t.numel(); ++i) info_.eos_ids.push_back(t.const_data_ptr<int64_t>()[i]);
      } else if (v.isIntList()) {
        for (int64_t x : v.toIntList()) info_.eos_ids.push_back(x);
      } else {
        throw ProgramError("constant method 'get_eos_ids' returned a non-integer value (" +
                           evalue_text(v) + ")");
      }
    }
    if (info_.eos_ids.empty()) throw ProgramError("constant method 'get_eos_ids' returned no ids");
    for (int64_t id : info_.eos_ids)
      if (id < 0 || id >= info_.vocab_size)
        throw ProgramError("constant method 'get_eos_ids' returned " + std::to_string(id) +
                           " (must be a token id in [0, vocab size))");
  }
  if (names->count("get_recipe_hash")) {
    auto r = module_->execute("get_recipe_hash");
    if (r.ok() && !r->empty()) {
      info_.has_recipe_hash = true;
      for (size_t i = 0; i < r->size(); ++i) {
        if (i) info_.recipe_hash += ",";
        info_.recipe_hash += evalue_text((*r)[i]);
      }
    }
  }

  if (names->count("get_chat_template")) {
    auto r = module_->execute("get_chat_template");
    if (!r.ok() || r->size() != 1 || !(*r)[0].isString() || (*r)[0].toString().empty())
      throw ProgramError("constant method 'get_chat_template' must return one non-empty string (a template name)");
    info_.chat_template = std::string((*r)[0].toString());
  }

  auto meta = module_->method_meta("forward");
  if (!meta.ok()) throw ProgramError("cannot read the metadata of 'forward': " + err_text(meta.error()));
  info_.forward_inputs = static_cast<int>(meta->num_inputs());
  int want = info_.logits_mode == 2 ? 3 : 2;
  if (info_.forward_inputs != want)
    throw ProgramError("'forward' takes " + std::to_string(info_.forward_inputs) + " inputs; this runner expects " +
                       std::to_string(want) + " (tokens, positions" + (want == 3 ? ", rows" : "") + ")");
  for (int i = 0; i < info_.forward_inputs; ++i) {
    auto tm = meta->input_tensor_meta(i);
    if (!tm.ok() || tm->scalar_type() != ScalarType::Long)
      throw ProgramError("'forward' input " + std::to_string(i) + " is not a Long tensor");
  }
  check_buffer_sizes(*meta);
  info_.offgraph = names->count("get_n_caches") > 0;
  position_limit_ = info_.max_context_len;
  Error e = module_->load_method("forward");
  if (e != Error::Ok)
    throw ProgramError("cannot load method 'forward': " + err_text(e) + load_hint(e));
  tok_buf_.resize(info_.max_seq_len);
  pos_buf_.resize(info_.max_seq_len);
  rows_buf_.resize(info_.max_seq_len);
  logits_.resize(info_.vocab_size);
}

const std::vector<float>& LlmProgram::forward(const int64_t* tokens, int64_t n, int64_t pos) {
  if (n < 1 || n > info_.max_seq_len)
    throw ProgramError("forward called with " + std::to_string(n) + " tokens (must be 1.." +
                       std::to_string(info_.max_seq_len) + ")");
  if (pos < 0 || pos + n > position_limit_)
    throw ProgramError("positions [" + std::to_string(pos) + ", " + std::to_string(pos + n) +
                       ") exceed the context of " + std::to_string(position_limit_));
  for (int64_t i = 0; i < n; ++i) {
    tok_buf_[i] = tokens[i];
    pos_buf_[i] = pos + i;
  }
  last_row_.assign(1, n - 1);
  execute(n, last_row_, &logits_);
  return logits_;
}

const std::vector<float>& LlmProgram::forward_rows(const int64_t* tokens, const int64_t* positions, int64_t n,
                                                   const std::vector<int64_t>& rows) {
  if (n < 1 || n > info_.max_seq_len)
    throw ProgramError("forward called with " + std::to_string(n) + " tokens (must be 1.." +
                       std::to_string(info_.max_seq_len) + ")");
  for (int64_t i = 0; i < n; ++i) {
    if (positions[i] < 0 || positions[i] >= position_limit_)
      throw ProgramError("row " + std::to_string(i) + " at position " + std::to_string(positions[i]) +
                         " exceeds the context of " + std::to_string(position_limit_));
    tok_buf_[i] = tokens[i];
    pos_buf_[i] = positions[i];
  }
  for (int64_t r : rows)
    if (r < 0 || r >= n || (!all_rows_logits() && r < n - verify_rows()))
      throw ProgramError("logits of row " + std::to_string(r) + " of a " + std::to_string(n) +
                         "-row step asked from a program with logits mode '" +
                         logits_mode_name(info_.logits_mode) + "' (it returns the last " +
                         std::to_string(verify_rows()) + "; 'full' and 'selected' have every row)");
  execute(n, rows, &rows_logits_);
  return rows_logits_;
}

void LlmProgram::execute(int64_t n, const std::vector<int64_t>& rows, std::vector<float>* dst) {
  auto t_tok = from_blob(tok_buf_.data(), {1, static_cast<int>(n)}, ScalarType::Long);
  auto t_pos = from_blob(pos_buf_.data(), {static_cast<int>(n)}, ScalarType::Long);
  std::vector<EValue> inputs{EValue(*t_tok), EValue(*t_pos)};
  executorch::extension::TensorPtr t_rows;
  const bool selected = info_.forward_inputs == 3;  // the program computes just these rows, in this order
  if (selected) {
    if (rows.size() > rows_buf_.size())
      throw ProgramError("a 'selected' forward takes at most " + std::to_string(rows_buf_.size()) + " rows, got " +
                         std::to_string(rows.size()));
    // a step that needs no logits (prompt pieces only) still asks one row: the input cannot be empty
    const size_t r = std::max<size_t>(rows.size(), 1);
    if (rows.empty()) rows_buf_[0] = n - 1;
    else std::copy(rows.begin(), rows.end(), rows_buf_.begin());
    t_rows = from_blob(rows_buf_.data(), {static_cast<int>(r)}, ScalarType::Long);
    inputs.emplace_back(*t_rows);
  }
  auto r = module_->execute("forward", inputs);
  if (!r.ok()) {
    std::string detail = info_.offgraph ? offgraph::last_error() : std::string();
    throw ProgramError("forward failed: " + err_text(r.error()) + (detail.empty() ? "" : ": " + detail));
  }
  if (r->empty() || !(*r)[0].isTensor()) throw ProgramError("forward did not return a logits tensor");
  const auto& out = (*r)[0].toTensor();
  if (out.dim() < 1) throw ProgramError("forward returned a 0-d tensor");
  int64_t V = out.size(out.dim() - 1);
  if (V != info_.vocab_size)
    throw ProgramError("forward returned logits of width " + std::to_string(V) +
                       " but get_vocab_size says " + std::to_string(info_.vocab_size));
  const int64_t out_rows = out.numel() / V;
  dst->resize(rows.size() * V);
  if (selected && out_rows != std::max<int64_t>(static_cast<int64_t>(rows.size()), 1))
    throw ProgramError("forward returned " + std::to_string(out_rows) + " logits rows for " +
                       std::to_string(rows.size()) + " selected rows");
  if (!selected && out_rows > n)
    throw ProgramError("forward returned " + std::to_string(out_rows) + " logits rows for a " + std::to_string(n) +
                       "-row step");
  for (size_t k = 0; k < rows.size(); ++k) {
    // selected: output row k is rows[k]; otherwise the program kept the step's last out_rows rows (all of them,
    // the last few, or the last one)
    const int64_t src = selected ? static_cast<int64_t>(k) : rows[k] - (n - out_rows);
    if (src < 0)
      throw ProgramError("forward returned " + std::to_string(out_rows) + " logits rows for a " +
                         std::to_string(n) + "-row step; row " + std::to_string(rows[k]) + " is not among them");
    const int64_t off = src * V;
    float* d = dst->data() + k * V;
    switch (out.scalar_type()) {
      case ScalarType::Float:
        std::memcpy(d, out.const_data_ptr<float>() + off, V * sizeof(float));
        info_.logits_dtype = "Float";
        break;
      case ScalarType::Half: {
        const auto* p = static_cast<const uint16_t*>(out.const_data_ptr()) + off;
        for (int64_t i = 0; i < V; ++i) d[i] = half_to_float(p[i]);
        info_.logits_dtype = "Half";
        break;
      }
      case ScalarType::BFloat16: {
        const auto* p = static_cast<const uint16_t*>(out.const_data_ptr()) + off;
        for (int64_t i = 0; i < V; ++i) d[i] = bf16_to_float(p[i]);
        info_.logits_dtype = "BFloat16";
        break;
      }
      default:
        throw ProgramError(std::string("forward returned logits of dtype ") +
                           scalar_type_name(static_cast<int64_t>(out.scalar_type())) +
                           " (expected Float, Half or BFloat16)");
    }
  }
}

}  // namespace llmrt
