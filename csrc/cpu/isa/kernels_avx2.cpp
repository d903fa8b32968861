// The AVX2 copy of the CPU kernels (csrc/cpu/isa.h), compiled with setup.py's CPU_ISA_FLAGS["avx2"].
#if !defined(CPU_CAPABILITY_AVX2) || !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the AVX2 copy is compiled with setup.py's CPU_ISA_FLAGS[\"avx2\"]"
#endif
#include "kernels.h"
