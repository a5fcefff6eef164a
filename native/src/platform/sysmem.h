// Process memory from /proc (Linux).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace llmrt {

// Physical memory in bytes (UINT64_MAX if unknown): what no single program or cache can exceed.
inline uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : UINT64_MAX;
}

// Resident set size in MiB.
inline double rss_mib() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * sysconf(_SC_PAGESIZE) / (1024.0 * 1024.0);
}

// Peak resident set size (VmHWM) in MiB.
inline double peak_rss_mib() {
  double kb = 0;
  if (FILE* f = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f)) {
      if (std::strncmp(line, "VmHWM:", 6) == 0) {
        kb = std::atof(line + 6);
        break;
      }
    }
    std::fclose(f);
  }
  return kb / 1024.0;
}

}  // namespace llmrt
