// The AVX-512 copy of the CPU kernels (csrc/cpu/isa.h), compiled with setup.py's CPU_ISA_FLAGS["avx512"].
#if !defined(CPU_CAPABILITY_AVX512) || !defined(__AVX512F__) || !defined(__AVX512BW__) || \
    !defined(__AVX512VL__) || !defined(__AVX512DQ__) || !defined(__FMA__)
#error "the AVX-512 copy is compiled with setup.py's CPU_ISA_FLAGS[\"avx512\"]"
#endif
#include "kernels.h"
