// The C interface of llmpipe_ops (native/: libllmpipe_ops.a / libllmpipe_ops.so, CMake package llmpipe_ops), for an
// app that runs the pipeline's programs with ExecuTorch. Linking the library registers every operator of ours
// (llmpipe::*) in ExecuTorch's kernel registry; nothing needs calling for a program whose cache is in the program
// (cache.mode custom or static). A program whose KV cache is the runtime's (cache.mode=offgraph) needs that cache:
// create it from the program's constant methods (get_n_caches, get_kv_heads, get_head_dims, get_v_head_dims,
// get_windows), bind it before each execute of `forward`, commit the step after. See docs/deploy.md.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The ISA path the kernels take in this process (scalar, avx2, avx512, neon, dotprod; LLMPIPE_ISA forces one).
const char* llmpipe_isa(void);
// Non-empty when LLMPIPE_ISA asked for a path this build or CPU lacks (the best path runs instead).
const char* llmpipe_isa_problem(void);

// An off-graph KV cache of n layer caches (dtype_code: ExecuTorch's ScalarType, 6 Float, 5 Half, 15 BFloat16);
// NULL on error (llmpipe_last_error says why).
void* llmpipe_cache_create(int n, const int64_t* kv_heads, const int64_t* head_dims, const int64_t* v_dims,
                           const int64_t* windows, int64_t capacity, int64_t max_write, int64_t initial,
                           int dtype_code);
void llmpipe_cache_destroy(void* cache);
// Before each forward: the step at positions [pos, pos + T) fits (0), or not (-1); then bind the cache the ops read.
int llmpipe_cache_check_step(void* cache, int64_t pos, int64_t T);
void llmpipe_cache_bind(void* cache);
// After a forward: the step is held.
void llmpipe_cache_commit(void* cache, int64_t pos, int64_t T);
int llmpipe_cache_rewind(void* cache, int64_t target);
void llmpipe_cache_reset(void* cache);
int64_t llmpipe_cache_length(void* cache);
// A recurrent model's state per layer (get_state_shapes), before the first forward.
int llmpipe_cache_set_states(void* cache, int n, const int64_t* dims);
// KV-shared layers (get_n_shared_layers): the last n attention layers read another layer's cache.
void llmpipe_cache_set_shared(void* cache, int64_t n);
const char* llmpipe_last_error(void);

#ifdef __cplusplus
}
#endif
