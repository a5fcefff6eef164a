#include "kernels/isa.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cores.h"

#if defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace llmrt {

// The paths this build compiled (native/CMakeLists.txt defines LLMPIPE_PATHS_X86 or LLMPIPE_PATHS_ARM).
namespace isa_scalar {
extern const Cores kCores;
}
#if defined(LLMPIPE_PATHS_X86)
namespace isa_avx2 {
extern const Cores kCores;
}
namespace isa_avx512 {
extern const Cores kCores;
}
#elif defined(LLMPIPE_PATHS_ARM)
namespace isa_neon {
extern const Cores kCores;
}
namespace isa_dotprod {
extern const Cores kCores;
}
#endif

namespace isa {
namespace {

struct Feature {
  const char* name;
  bool present;
};

std::vector<Feature> features() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return {{"avx2", __builtin_cpu_supports("avx2") != 0},
          {"fma", __builtin_cpu_supports("fma") != 0},
          {"f16c", __builtin_cpu_supports("f16c") != 0},
          {"avx512f", __builtin_cpu_supports("avx512f") != 0},
          {"avx512bw", __builtin_cpu_supports("avx512bw") != 0},
          {"avx512vl", __builtin_cpu_supports("avx512vl") != 0},
          {"avx512dq", __builtin_cpu_supports("avx512dq") != 0},
          {"avx512vnni", __builtin_cpu_supports("avx512vnni") != 0}};
#elif defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  return {{"asimd", (hw & HWCAP_ASIMD) != 0}, {"asimddp", (hw & HWCAP_ASIMDDP) != 0},
#ifdef HWCAP2_I8MM
          {"i8mm", (hw2 & HWCAP2_I8MM) != 0}
#else
          {"i8mm", false}
#endif
  };
#else
  return {};
#endif
}

bool has(const char* f) {
  for (const Feature& x : features())
    if (std::strcmp(x.name, f) == 0) return x.present;
  return false;
}

}  // namespace

// Whether this CPU can take the path, and whether this build has it.
bool supported(Isa p) {
  switch (p) {
    case Isa::scalar: return true;
#if defined(LLMPIPE_PATHS_X86)
    case Isa::avx2: return has("avx2") && has("fma") && has("f16c");
    case Isa::avx512:
      return supported(Isa::avx2) && has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq");
#elif defined(LLMPIPE_PATHS_ARM)
    case Isa::neon: return has("asimd");
    case Isa::dotprod: return has("asimd") && has("asimddp");
#endif
    default: return false;
  }
}

namespace {

Isa best() {
  for (Isa p : {Isa::avx512, Isa::avx2, Isa::dotprod, Isa::neon})
    if (supported(p)) return p;
  return Isa::scalar;
}

std::string g_problem;

Isa resolve() {
  const char* want = std::getenv("LLMPIPE_ISA");
  if (want == nullptr || *want == '\0') return best();
  for (Isa p : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::neon, Isa::dotprod}) {
    if (std::strcmp(want, name(p)) != 0) continue;
    if (supported(p)) return p;
    g_problem = std::string("LLMPIPE_ISA=") + want + ": this " +
#if defined(__x86_64__)
                "x86-64 "
#elif defined(__aarch64__)
                "ARM64 "
#endif
                "build or CPU has no such path (cpu: " + cpu_features() + ")";
    return best();
  }
#if defined(__x86_64__)
  g_problem = std::string("LLMPIPE_ISA=") + want + ": not a path (x86-64: scalar, avx2, avx512)";
#else
  g_problem = std::string("LLMPIPE_ISA=") + want + ": not a path (ARM64: scalar, neon, dotprod)";
#endif
  return best();
}

}  // namespace

const char* name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::neon: return "neon";
    case Isa::dotprod: return "dotprod";
  }
  return "?";
}

Isa active() {
  static const Isa chosen = resolve();
  return chosen;
}

const char* active_name() { return name(active()); }

std::string cpu_features() {
  std::string out;
  for (const Feature& f : features())
    if (f.present) out += (out.empty() ? "" : " ") + std::string(f.name);
  return out.empty() ? "none of the paths' features" : out;
}

const std::string& problem() {
  active();
  return g_problem;
}

std::string describe() {
  const char* env = std::getenv("LLMPIPE_ISA");
  std::string s = active_name();
  s += " (";
  if (env != nullptr && *env != '\0') s += std::string("LLMPIPE_ISA=") + env + "; ";
  return s + "cpu: " + cpu_features() + ")";
}

bool has_avx512_vnni() { return has("avx512vnni"); }
bool has_i8mm() { return has("i8mm"); }

}  // namespace isa

const Cores* cores_of(isa::Isa path) {
  if (!isa::supported(path)) return nullptr;
  switch (path) {
#if defined(LLMPIPE_PATHS_X86)
    case isa::Isa::avx512: return &isa_avx512::kCores;
    case isa::Isa::avx2: return &isa_avx2::kCores;
#elif defined(LLMPIPE_PATHS_ARM)
    case isa::Isa::dotprod: return &isa_dotprod::kCores;
    case isa::Isa::neon: return &isa_neon::kCores;
#endif
    case isa::Isa::scalar: return &isa_scalar::kCores;
    default: return nullptr;
  }
}

const Cores& cores() {
  static const Cores* c = cores_of(isa::active());
  return *c;
}

}  // namespace llmrt

// For Python (pipeline.ops) through ctypes: the path taken, and what LLMPIPE_ISA asked that could not be had.
extern "C" const char* llmpipe_isa() { return llmrt::isa::active_name(); }
extern "C" const char* llmpipe_isa_problem() { return llmrt::isa::problem().c_str(); }
extern "C" int llmpipe_isa_supported(const char* path) {
  for (auto p : {llmrt::isa::Isa::scalar, llmrt::isa::Isa::avx2, llmrt::isa::Isa::avx512, llmrt::isa::Isa::neon,
                 llmrt::isa::Isa::dotprod})
    if (std::strcmp(path, llmrt::isa::name(p)) == 0) return llmrt::isa::supported(p) ? 1 : 0;
  return 0;
}
extern "C" const char* llmpipe_isa_describe() {
  static const std::string d = llmrt::isa::describe();
  return d.c_str();
}
