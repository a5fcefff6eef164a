#include "platform/huge_pages.h"

#include <sys/mman.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "platform/sysmem.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers lack it
#endif

namespace llmrt {

HugePages back_with_huge_pages(int64_t min_bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  HugePages out;
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (!maps) {
    out.error = "cannot read /proc/self/maps";
    return out;
  }
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  unsigned char resident[kHuge / 4096];  // mincore's answer for one 2 MiB, a byte a 4 KiB page
  char line[512];
  int first_errno = 0;
  const uint64_t ram = physical_memory_bytes();
  while (std::fgets(line, sizeof(line), maps)) {
    unsigned long begin = 0, end = 0, offset = 0, inode = 0;
    char perms[8] = {0}, dev[16] = {0};
    int name_at = 0;
    if (std::sscanf(line, "%lx-%lx %7s %lx %15s %lu %n", &begin, &end, perms, &offset, dev, &inode, &name_at) < 6)
      continue;
    const char* name = line + name_at;
    const bool anonymous = inode == 0 && (name[0] == '\n' || name[0] == '\0' || std::strncmp(name, "[heap]", 6) == 0);
    if (!anonymous || std::strncmp(perms, "rw-p", 4) != 0) continue;
    const uintptr_t b = (begin + kHuge - 1) & ~(kHuge - 1), e = end & ~(kHuge - 1);
    if (e <= b || static_cast<int64_t>(end - begin) < min_bytes) continue;
    // a reservation beyond the machine's memory (a sanitizer's shadow: terabytes) is never resident; walking it
    // 2 MiB at a time would take minutes
    if (end - begin > ram) continue;
    ++out.regions;
    // only 2 MiB that are all resident: a collapse fills the holes, and reserved but untouched memory (a KV
    // cache's unused capacity) must stay unbacked. No MADV_HUGEPAGE either: a later fault would take 2 MiB
    for (uintptr_t c = b; c < e; c += kHuge) {
      if (mincore(reinterpret_cast<void*>(c), kHuge, resident) != 0) break;
      bool all = true;
      for (unsigned char r : resident) all = all && (r & 1);
      if (!all) continue;
      if (madvise(reinterpret_cast<void*>(c), kHuge, MADV_COLLAPSE) == 0) out.bytes += static_cast<int64_t>(kHuge);
      else if (!first_errno) first_errno = errno;
    }
  }
  std::fclose(maps);
  out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (out.bytes == 0 && first_errno)
    out.error = std::string("MADV_COLLAPSE: ") + std::strerror(first_errno) + " (Linux >= 6.1 with THP not 'never')";
  return out;
}

std::string describe(const HugePages& h, bool asked) {
  if (!asked) return "[memory] huge pages off (--huge-pages off)";
  if (h.bytes == 0)
    return "[memory] huge pages: none" + (h.error.empty() ? std::string(" (no mapping large enough)") : " (" + h.error + ")");
  char buf[160];
  std::snprintf(buf, sizeof(buf), "[memory] huge pages: %.1f MiB of %d mappings on 2 MiB pages (%.1f ms)",
                static_cast<double>(h.bytes) / (1 << 20), h.regions, h.ms);
  return buf;
}

}  // namespace llmrt
