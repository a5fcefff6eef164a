// C API of libllmpipe_kernels.so, for Python (ctypes) verify:
//   lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)   # registers llmpipe::update_and_attend.out
//   h = llmpipe_cache_create(n, kv_heads[], head_dims[], v_dims[], windows[], capacity,
//                            max_write, initial, dtype_code)      (NULL on error)
//   llmpipe_cache_check_step(h, pos, T) / llmpipe_cache_bind(h) / execute / llmpipe_cache_commit(h, pos, T)
// Functions returning int return 0 on success, -1 on error (llmpipe_last_error() says why).
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "platform/huge_pages.h"
#include "kernels/offgraph_cache.h"

using llmrt::offgraph::OffgraphKvCache;

namespace {
thread_local std::string tl_text;
}

extern "C" {

void* llmpipe_cache_create(int n, const int64_t* kv_heads, const int64_t* head_dims,
                           const int64_t* v_dims, const int64_t* windows, int64_t capacity,
                           int64_t max_write, int64_t initial, int dtype_code) {
  try {
    std::vector<llmrt::offgraph::LayerSpec> specs(n);
    for (int i = 0; i < n; ++i)
      specs[i] = {kv_heads[i], head_dims[i], v_dims ? v_dims[i] : head_dims[i], windows[i]};
    return new OffgraphKvCache(std::move(specs), capacity, max_write, initial, dtype_code);
  } catch (const std::exception& e) {
    llmrt::offgraph::set_last_error(e.what());
    return nullptr;
  }
}

void llmpipe_cache_destroy(void* h) {
  auto* c = static_cast<OffgraphKvCache*>(h);
  if (llmrt::offgraph::bound_cache() == c) llmrt::offgraph::bind_cache(nullptr);
  delete c;
}

void llmpipe_cache_bind(void* h) { llmrt::offgraph::bind_cache(static_cast<OffgraphKvCache*>(h)); }

int llmpipe_cache_check_step(void* h, int64_t pos, int64_t T) {
  std::string why;
  if (static_cast<OffgraphKvCache*>(h)->check_step(pos, T, &why)) return 0;
  llmrt::offgraph::set_last_error(why);
  return -1;
}

void llmpipe_cache_commit(void* h, int64_t pos, int64_t T) {
  static_cast<OffgraphKvCache*>(h)->commit(pos, T);
}

int llmpipe_cache_rewind(void* h, int64_t target) {
  std::string why;
  if (static_cast<OffgraphKvCache*>(h)->rewind(target, &why)) return 0;
  llmrt::offgraph::set_last_error(why);
  return -1;
}

// Speculation's rollback on a recurrent program: a snapshot (into `snap`, or a new one when null; returned) and a
// restore (0, or -1: last_error says why); llmpipe_snapshot_free releases one.
void* llmpipe_cache_snapshot(void* h, void* snap) {
  auto* s = snap ? static_cast<OffgraphKvCache::Snapshot*>(snap) : new OffgraphKvCache::Snapshot();
  static_cast<OffgraphKvCache*>(h)->snapshot(s);
  return s;
}

int llmpipe_cache_restore(void* h, void* snap) {
  std::string why;
  if (static_cast<OffgraphKvCache*>(h)->restore(*static_cast<OffgraphKvCache::Snapshot*>(snap), &why)) return 0;
  llmrt::offgraph::set_last_error(why);
  return -1;
}

void llmpipe_snapshot_free(void* snap) { delete static_cast<OffgraphKvCache::Snapshot*>(snap); }

void llmpipe_cache_reset(void* h) { static_cast<OffgraphKvCache*>(h)->reset(); }
int64_t llmpipe_cache_length(void* h) { return static_cast<OffgraphKvCache*>(h)->length(); }
int64_t llmpipe_cache_allocated(void* h, int layer) {
  return static_cast<OffgraphKvCache*>(h)->allocated(layer);
}

// The recurrent layers' state (the program's get_state_shapes: five dims per state). 0, or -1 (last_error says why).
int llmpipe_cache_set_states(void* h, int n, const int64_t* dims) {
  try {
    static_cast<OffgraphKvCache*>(h)->set_states(llmrt::offgraph::state_specs(dims, 5 * static_cast<size_t>(n)));
    return 0;
  } catch (const std::exception& e) {
    llmrt::offgraph::set_last_error(e.what());
    return -1;
  }
}

void llmpipe_cache_set_shared(void* h, int64_t n) { static_cast<OffgraphKvCache*>(h)->set_shared_layers(n); }
int64_t llmpipe_cache_bytes(void* h) { return static_cast<OffgraphKvCache*>(h)->bytes(); }

const char* llmpipe_cache_describe(void* h) {
  tl_text = static_cast<OffgraphKvCache*>(h)->describe();
  return tl_text.c_str();
}

// The runners' --huge-pages for a Python process (python -m pipeline generate): bytes put on 2 MiB pages.
int64_t llmpipe_back_with_huge_pages(int64_t min_bytes) { return llmrt::back_with_huge_pages(min_bytes).bytes; }

const char* llmpipe_last_error() {
  tl_text = llmrt::offgraph::last_error();
  return tl_text.c_str();
}

}  // extern "C"
