// --interactive: multi-turn chat on stdin over one context, with /reset, /undo [N] and /quit.
#pragma once

#include "runner/runner_options.h"
#include "runner/turn_report.h"
#include "runner/turn_runner.h"
#include "runtime/chat_template.h"
#include "runtime/kv_cache.h"
#include "runtime/llm_program.h"
#include "tokenizer/tokenizer.h"

namespace llmrt::runner {

// Reads turns until /quit, /exit or the end of stdin. A turn is admitted only if its tokens fit in
// the free context, so generation never has to drop history; each admitted turn is reported.
void run_interactive(const Options& o, const ChatTemplate& tpl, const Tokenizer& tok, const ProgramInfo& info,
                     const LoadInfo& li, KvCacheOwner& cache, Runner& runner);

}  // namespace llmrt::runner
