// llm_batched_runner --serve: the engine behind `python -m pipeline.serve`, driven by JSON lines.
//
// stdin, one object a line (the server's Python side writes them; a line it cannot read gets an "error" event):
//   {"op": "submit", "id": 7, "ids": [...], "max_tokens": 64, "temperature": 0.7, "top_p": 1, "top_k": 0,
//    "seed": 1, "speculate": true, "ignore_eos": false,
//    "mask": "<hex>"}                                     a request; "mask": its first sample's allowed tokens, and
//                                                         then every sample waits for a "mask" line
//   {"op": "mask", "id": 7, "mask": "<hex>"}             the allowed tokens of its next sample (vocab bits as
//                                                         little-endian 32-bit words, their bytes in hex)
//   {"op": "cancel", "id": 7}                            ends it with reason "cancelled" (a client went away)
//   {"op": "stats"}                                      the totals, as a "stats" event
// stdout, one object a line: "ready" (the program and the engine), "tokens" (a request's new tokens), "done" (its
// end: reason, token counts, times), "stats", "error". End of stdin ends the process.
// Requests join the running batch between steps; a step runs whenever some session can take one.
#pragma once

#include <nlohmann/json.hpp>

#include "batched/batched_engine.h"

namespace llmrt {

// Serves until stdin ends; `ready` is the first event's body. Returns the exit code.
int serve_stdio(Engine& engine, int64_t vocab, nlohmann::json ready);

}  // namespace llmrt
