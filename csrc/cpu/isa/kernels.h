// One instruction set's copy of the CPU kernels and its entry points (csrc/cpu/isa.h). Included by one
// kernels_<isa>.cpp per copy, which setup.py compiles with that ISA's flags; the flags name the
// namespace (../isa_namespace.h).
#pragma once

#include "../attention_kernels.h"
#include "../isa.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace flashop::cpu {

void FLASHOP_CPU_ISA_NAMESPACE::forward(const AttentionParams& p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return attention_forward<float>(p);
    case at::kHalf: return attention_forward<c10::Half>(p);
    case at::kBFloat16: return attention_forward<c10::BFloat16>(p);
    default: TORCH_CHECK(false, "flashop: unsupported dtype ", dtype);  // check_forward_inputs rules this out
  }
}

void FLASHOP_CPU_ISA_NAMESPACE::backward(const BackwardParams& p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return attention_backward<float>(p);
    case at::kHalf: return attention_backward<c10::Half>(p);
    case at::kBFloat16: return attention_backward<c10::BFloat16>(p);
    default: TORCH_CHECK(false, "flashop: unsupported dtype ", dtype);
  }
}

}  // namespace flashop::cpu
