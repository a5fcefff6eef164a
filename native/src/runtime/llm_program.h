// An exported LLM program (.pte) with the pipeline's ABI:
//   forward(tokens Long[1,T], positions Long[T] [, rows Long[R]]) -> logits [1,R,V]
// (R = T `full`, 1 `last`, min(T, get_tail_rows) `tail`: the step's last rows; `selected`: the rows asked)
// plus constant methods describing it (see ProgramInfo).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace executorch::extension::module {
class Module;
}
namespace executorch::runtime {
class MethodMeta;
}

namespace llmrt {

class ProgramError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ProgramInfo {
  int64_t max_context_len = 0;  // get_max_context_len
  int64_t max_seq_len = 0;      // get_max_seq_len (prefill chunk)
  int64_t vocab_size = 0;       // get_vocab_size
  int64_t activation_dtype = 0; // get_activation_dtype (ScalarType code)
  int64_t logits_mode = 0;      // get_logits_to_keep_mode: 0 full, 1 last, 2 selected, 3 tail
  int64_t tail_rows = 0;        // get_tail_rows (logits mode tail): the most rows a forward returns
  int64_t bos_id = -1;          // get_bos_id
  std::vector<int64_t> eos_ids; // get_eos_ids
  bool has_recipe_hash = false;
  std::string recipe_hash;      // get_recipe_hash, rendered as text
  std::string chat_template;    // get_chat_template (optional): the model's template, "" if not recorded
  int forward_inputs = 2;
  bool offgraph = false;        // has get_n_caches: the KV cache lives outside the program
  std::string logits_dtype;     // of the first forward output, once seen
};

const char* scalar_type_name(int64_t code);
const char* logits_mode_name(int64_t mode);

class LlmProgram {
 public:
  // Loads the program, reads the constant methods and loads `forward`.
  // Throws ProgramError with a message naming the problem.
  // `data`: the program's data files (get_data_files names them; by default they are looked for beside the .pte).
  explicit LlmProgram(const std::string& path, const std::vector<std::string>& data = {});
  ~LlmProgram();

  const ProgramInfo& info() const { return info_; }
  const std::vector<std::string>& data_files() const { return data_files_; }

  // Off-graph cache geometry (get_n_caches, get_kv_heads, get_head_dims,
  // optional get_v_head_dims, get_windows). Throws ProgramError naming a
  // missing or invalid method.
  struct CacheGeometry {
    int64_t n_caches = 0;
    int64_t n_shared = 0;  // get_n_shared_layers (optional): attention layers reading another layer's cache
    std::vector<int64_t> kv_heads, head_dims, v_dims, windows;
  };
  CacheGeometry cache_geometry();

  bool has_method(const std::string& name) const;
  // An int (or int tensor / list) constant method as a list. Throws ProgramError if missing or not ints.
  std::vector<int64_t> read_int_list(const std::string& method);

  // Positions forward accepts: [0, limit). Defaults to get_max_context_len; an
  // off-graph run sets it to its cache capacity.
  void set_position_limit(int64_t limit) { position_limit_ = limit; }

  // Runs forward over n tokens at positions [pos, pos + n), 1 <= n <= max_seq_len,
  // and returns the logits of the last row as floats (vocab_size entries).
  const std::vector<float>& forward(const int64_t* tokens, int64_t n, int64_t pos);

  // A batched step: row i is token tokens[i] at position positions[i] (rows of several sessions,
  // see batched_engine.h). Returns the logits of `rows` (indices into the step, ascending),
  // rows.size() x vocab_size floats. A `full` program has logits for every row and a `selected` one
  // computes just the rows asked (its third input); a `last` one has row n - 1 only (asking for another
  // row is an error).
  const std::vector<float>& forward_rows(const int64_t* tokens, const int64_t* positions, int64_t n,
                                         const std::vector<int64_t>& rows);
  // Any row's logits can be had in one forward (logits mode `full` or `selected`).
  bool all_rows_logits() const { return info_.logits_mode == 0 || info_.logits_mode == 2; }
  // The most trailing rows of a step whose logits one forward returns (speculation's verify width): the chunk,
  // a `tail` program's get_tail_rows, or 1 (`last`).
  int64_t verify_rows() const {
    if (all_rows_logits()) return info_.max_seq_len;
    return info_.logits_mode == 3 ? info_.tail_rows : 1;
  }

 private:
  int64_t read_int(const std::string& method, bool required, int64_t fallback);
  void check_buffer_sizes(const executorch::runtime::MethodMeta& meta) const;
  // Executes forward on the first n entries of tok_buf_ / pos_buf_; writes the logits of `rows` to dst.
  void execute(int64_t n, const std::vector<int64_t>& rows, std::vector<float>* dst);
  int64_t position_limit_ = 0;
  std::unique_ptr<executorch::extension::module::Module> module_;
  std::vector<std::string> data_files_;  // the data files module_ reads (an adapter program's foundation.ptd)
  void open_module(const std::string& path, const std::vector<std::string>& data);
  ProgramInfo info_;
  std::vector<int64_t> tok_buf_, pos_buf_, rows_buf_;
  std::vector<float> logits_, rows_logits_;
  std::vector<int64_t> last_row_;
};

}  // namespace llmrt
