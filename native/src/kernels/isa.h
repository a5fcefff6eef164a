// Which instruction-set path our kernels take, chosen once per process from what the CPU reports (cpuid on
// x86-64, the auxiliary vector's hwcaps on ARM64), never from the machine that built them: one build runs on every
// CPU of its architecture. LLMPIPE_ISA forces a path:
//   x86-64: scalar | avx2 (AVX2 + FMA + F16C) | avx512 (AVX-512 F/BW/VL/DQ, the tied head's vpdpwssd with VNNI)
//   ARM64:  scalar | neon | dotprod (NEON + SDOT, the tied head's and the experts' int8 dots)
// A path this CPU or this build lacks is refused (problem() says why) and the best one runs instead.
//
// Each kernel's numeric core is compiled once per path (native/CMakeLists.txt) in namespace isa_<path>; cores.h
// holds the table the op wrappers call through.
#pragma once

#include <string>

namespace llmrt::isa {

enum class Isa : int { scalar, avx2, avx512, neon, dotprod };

const char* name(Isa isa);
bool supported(Isa isa);    // this build has the path and this CPU can take it
Isa active();               // the path taken, resolved at the first call
const char* active_name();  // its name
std::string cpu_features();  // what the CPU reports that the paths use, e.g. "avx2 fma f16c avx512f avx512bw avx512vnni"
const std::string& problem();  // LLMPIPE_ISA asked for a path this build or CPU cannot take ("" if not)
std::string describe();     // for the runners' report: "avx2 (LLMPIPE_ISA=avx2; cpu: avx2 fma ...)"

// Features a path checks within itself at run time (the avx512 path's tied head: VNNI; dotprod's: i8mm).
bool has_avx512_vnni();
bool has_i8mm();

}  // namespace llmrt::isa
