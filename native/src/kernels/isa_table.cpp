// One ISA path's table of cores (kernels/cores.h), compiled with that path's copies.
#include "kernels/cores.h"

namespace llmrt::LLMPIPE_ISA_NS {

const Cores kCores = {&kv::LLMPIPE_ISA_NS::attend_segments_core, &tied_head::LLMPIPE_ISA_NS::run,
                      &experts::LLMPIPE_ISA_NS::project, &recurrent::LLMPIPE_ISA_NS::run_delta,
                      &recurrent::LLMPIPE_ISA_NS::run_conv, &recurrent::LLMPIPE_ISA_NS::run_ssd};

}  // namespace llmrt::LLMPIPE_ISA_NS
