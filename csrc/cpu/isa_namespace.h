// The namespace of one instruction set's copy of the CPU kernels, named from the flags the copy is
// compiled with (csrc/cpu/isa/, setup.py; the same flags pick at::vec's implementation). Every inline
// function and template of a copy then has names of its own, so at link time no copy's code stands in
// for another's.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#define FLASHOP_CPU_ISA_NAMESPACE isa_avx512
#elif defined(CPU_CAPABILITY_AVX2)
#define FLASHOP_CPU_ISA_NAMESPACE isa_avx2
#else
#define FLASHOP_CPU_ISA_NAMESPACE isa_default
#endif
