// The CPU kernels are compiled once per instruction set, each copy in its own namespace
// (csrc/cpu/isa/kernels_<isa>.cpp, setup.py's CPU_ISA_FLAGS): the generic x86-64 one everywhere, and on
// x86-64 an AVX2 and an AVX-512 one. The functions here are compiled without ISA flags and run the best
// copy this CPU supports, or the one the environment variable FLASHOP_CPU_ISA names (default, avx2,
// avx512), chosen once per process at the first call.
#pragma once

#include "attention_params.h"

#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace flashop::cpu {

// The chosen copy's kernels, for inputs of `dtype` (float32, float16 or bfloat16).
void forward(const AttentionParams& p, at::ScalarType dtype);
void backward(const BackwardParams& p, at::ScalarType dtype);

// The chosen copy's name. Raises when FLASHOP_CPU_ISA names an ISA that this build lacks or this CPU
// cannot run.
std::string cpu_isa();
// The copies in this build, generic first; those this CPU can run (same order).
std::vector<std::string> cpu_isas();
std::vector<std::string> cpu_isas_supported();
// The copy that FLASHOP_CPU_ISA=`requested` picks among `supported` (unset or empty: the last one, the
// best); raises on an unknown or unsupported name. cpu_isa() applies it to this CPU; tests call it with
// other lists.
std::string select_cpu_isa(const std::string& requested, const std::vector<std::string>& supported);

// The entry points of each copy (csrc/cpu/isa/kernels.h defines them).
#define FLASHOP_CPU_ISA_ENTRY_POINTS(ns)                           \
  namespace ns {                                                   \
  void forward(const AttentionParams& p, at::ScalarType dtype);    \
  void backward(const BackwardParams& p, at::ScalarType dtype);    \
  }
FLASHOP_CPU_ISA_ENTRY_POINTS(isa_default)
#if defined(__x86_64__)
#define FLASHOP_CPU_X86_ISAS 1
FLASHOP_CPU_ISA_ENTRY_POINTS(isa_avx2)
FLASHOP_CPU_ISA_ENTRY_POINTS(isa_avx512)
#endif
#undef FLASHOP_CPU_ISA_ENTRY_POINTS

}  // namespace flashop::cpu
