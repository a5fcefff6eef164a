// LLMPIPE_KERNEL(ns, "op.out", fn): registers fn like EXECUTORCH_LIBRARY, but checks the argument count
// first. The boxed wrapper of make_boxed_from_unboxed_functor.h unboxes stack[0..n) without looking at the
// stack's size, so a damaged program calling the kernel with fewer arguments made it read past them (found by
// tests/native/test_fuzz.py under ASan). ExecuTorch's generated aten registrations check this; the library
// macro does not.
#pragma once

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include <string>

namespace llmrt::kernels {

// An operator refusing its arguments: logs "<op>: <why>", fails the call with `error` and hands back `out`, the out
// variant's return value (`return refuse(ctx, out, "llmpipe::sdpa", "q must be 4-d")`).
inline executorch::aten::Tensor& refuse(
    executorch::runtime::KernelRuntimeContext& ctx, executorch::aten::Tensor& out, const char* op,
    const std::string& why, executorch::runtime::Error error = executorch::runtime::Error::InvalidArgument) {
  ET_LOG(Error, "%s: %s", op, why.c_str());
  ctx.fail(error);
  return out;
}

// The boxed kernel: n arguments, or n + 1 with the return value the runtime appends to an out variant's call.
template <class FuncType>
void call_checked(executorch::runtime::KernelRuntimeContext& ctx,
                  executorch::runtime::Span<executorch::runtime::EValue*> stack) {
  using Wrapper = executorch::extension::WrapUnboxedIntoFunctor<FuncType>;
  constexpr size_t n =
      executorch::extension::kernel_util_internal::size<typename Wrapper::ContextRemovedArgsType>::value;
  if (stack.size() != n && stack.size() != n + 1) {
    ET_LOG(Error, "%s called with %zu arguments, expects %zu", FuncType::func_name_, stack.size(), n);
    ctx.fail(executorch::runtime::Error::InvalidProgram);
    return;
  }
  Wrapper::call(ctx, stack);
}

}  // namespace llmrt::kernels

#define LLMPIPE_KERNEL(ns, op_name, func) LLMPIPE_KERNEL_IMPL(ns, op_name, func, ET_UID)
#define LLMPIPE_KERNEL_IMPL(ns, op_name, func, uid)                                                      \
  static constexpr const char ET_CONCATENATE(llmpipe_op_name_, uid)[] = #ns "::" op_name;                 \
  static auto ET_CONCATENATE(llmpipe_op_reg_, uid) = ::executorch::runtime::register_kernel(             \
      ::executorch::runtime::Kernel(#ns "::" op_name,                                                     \
                                    ::llmrt::kernels::call_checked<EXECUTORCH_FN_TYPE(                    \
                                        func, ET_CONCATENATE(llmpipe_op_name_, uid))>))
