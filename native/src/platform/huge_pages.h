// Back a process's large anonymous mappings with 2 MiB pages (Linux >= 6.1, MADV_COLLAPSE).
//
// Why: a decoded token streams every weight once (SmolLM2 8da4w ~70 MB, gemma3 ~150 MB), from the buffers XNNPACK
// packs them into at load. On 4 KiB pages the hardware prefetcher stops at every page boundary and each page costs a
// TLB miss; on 2 MiB pages the stream runs on. Transparent huge pages are often `madvise`-only, and XNNPACK's
// buffers are never advised. gemma3_offgraph_8da4w on a 2-core Xeon: decode 59.7 -> 75.2 tok/s at 1 thread,
// 98.9 -> 119.3 at 2 (python bench/huge_pages.py; README, The native runner).
#pragma once

#include <cstdint>
#include <string>

namespace llmrt {

struct HugePages {
  int64_t bytes = 0;   // bytes now on 2 MiB pages
  int regions = 0;     // mappings collapsed (or tried)
  double ms = 0;       // the time it took (the pages are copied)
  std::string error;   // why none could be (an old kernel, THP off); empty when they were
};

// Collapses the wholly resident 2 MiB chunks of every private anonymous mapping (the heap included) of at least
// `min_bytes` into huge pages, so resident memory never grows. Call after the program's methods are loaded
// (XNNPACK packs its weights then) and the KV cache is allocated; what is touched later stays on 4 KiB pages.
HugePages back_with_huge_pages(int64_t min_bytes = 4 << 20);

// The runners' "[memory] huge pages ..." line.
std::string describe(const HugePages& h, bool asked);

}  // namespace llmrt
