// Process memory from /proc (Linux).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace llmrt {

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
