// The library's own kernels as the ops that chain them from C++ call them (decoder_stack.cpp,
// draft_head.cpp, argmax.cpp): through the dispatcher, each looked up once, so a composite op runs the very
// kernel (and ISA build) that the Python modules call, and its numbers are theirs.

#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

#ifndef OCTAVO_CPU_NAMESPACE
#error "OCTAVO_CPU_NAMESPACE must name the op namespace of this build (one per ISA)"
#endif

#define OCTAVO_CPU_STR2(x) #x
#define OCTAVO_CPU_STR(x) OCTAVO_CPU_STR2(x)

// Internal linkage (an unnamed namespace): each ISA's library keeps its own lookups, never
// unified with the other's by the dynamic linker when a process loads both.
namespace {
namespace own_kernels {

using LinearFn = void(at::Tensor, const at::Tensor&, const at::Tensor&);
using QuantizedLinearFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using RmsNormFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, double);
using FusedAddRmsNormFn = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double);
using RotaryFn = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, int64_t);
using SiluAndMulFn = void(at::Tensor, const at::Tensor&, const at::Tensor&);
using PagedAttentionFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double, int64_t, int64_t);
using DecoderStackFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  at::TensorList, at::TensorList, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  at::IntArrayRef, int64_t, int64_t, int64_t, int64_t, double,
                                  int64_t, double, int64_t);
using GreedyTokensFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  const std::string full = std::string(OCTAVO_CPU_STR(OCTAVO_CPU_NAMESPACE)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "").typed<Fn>();
}

// Looked up at the first use (every op registers when the library loads).
struct Kernels {
  c10::TypedOperatorHandle<LinearFn> linear = find_op<LinearFn>("linear");
  c10::TypedOperatorHandle<QuantizedLinearFn> quantized_linear =
      find_op<QuantizedLinearFn>("quantized_linear");
  c10::TypedOperatorHandle<RmsNormFn> rms_norm = find_op<RmsNormFn>("rms_norm");
  c10::TypedOperatorHandle<FusedAddRmsNormFn> fused_add_rms_norm =
      find_op<FusedAddRmsNormFn>("fused_add_rms_norm");
  c10::TypedOperatorHandle<RotaryFn> rotary = find_op<RotaryFn>("rotary_embedding");
  c10::TypedOperatorHandle<SiluAndMulFn> silu_and_mul = find_op<SiluAndMulFn>("silu_and_mul");
  c10::TypedOperatorHandle<PagedAttentionFn> paged_attention =
      find_op<PagedAttentionFn>("paged_attention");
  c10::TypedOperatorHandle<DecoderStackFn> decoder_stack = find_op<DecoderStackFn>("decoder_stack");
  c10::TypedOperatorHandle<GreedyTokensFn> greedy_tokens = find_op<GreedyTokensFn>("greedy_tokens");
};

inline const Kernels& kernels() {
  static const Kernels k;
  return k;
}

}  // namespace own_kernels
}  // namespace
