// Checks on a .pte file around ExecuTorch's own: its SHA-256 against a recorded digest (--verify-pte),
// and the indices and fields of the execution plans that the loader follows without checking.
#pragma once

#include <string>

namespace llmrt {

// True for 64 hex digits (either case): a SHA-256 as --verify-pte takes it.
bool is_sha256_hex(const std::string& s);

// spec: a SHA-256 in hex, or "auto" = the record of this file in the manifest.json beside it (the
// pipeline's lower-stage cache entry: outputs[<file name>].sha256). Returns the verified digest.
// Throws ProgramError naming the file, the expected and the actual digest on a mismatch, and the
// manifest on a missing or unreadable record.
std::string verify_pte_digest(const std::string& path, const std::string& spec);

// Walks every execution plan of the program (after ExecuTorch's InternalConsistency verification, before
// any method is loaded) and refuses what would crash ExecuTorch 1.5's loader or the XNNPACK delegate
// instead of failing cleanly:
//  - a KernelCall whose operator index is out of range (Method::init records the error, a later
//    instruction's success overwrites it, and execute calls a null kernel);
//  - an operator without a name, a delegate without an id or data reference, a compile spec without a
//    key or value, a plan without a name (dereferenced unchecked);
//  - a DelegateCall to an XNNPACK delegate with fewer arguments than its graph's external values
//    (XNNExecutor::prepare_args indexes the arguments by external id unchecked), and an XNNPACK graph
//    value or node whose union has no value (XNNCompiler dereferences it), or a zero it divides by (a
//    quantization group size, a depthwise convolution's input channels per group);
//  - a JumpFalseCall destination outside its chain;
//  - a kernel whose output argument (the last of an out variant, the first of an in-place op) is a
//    constant: constants are mapped read-only, the write would fault;
//  - planned memory (allocated up front) beyond the machine's physical memory, or negative.
// Throws ProgramError naming the file, the plan and the instruction.
void check_program_plans(const std::string& path);

}  // namespace llmrt
