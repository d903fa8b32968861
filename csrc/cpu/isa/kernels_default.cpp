// The generic copy of the CPU kernels (csrc/cpu/isa.h): no ISA flags, it runs on any CPU of the target.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#error "the generic copy is compiled without CPU_CAPABILITY flags (setup.py, CPU_ISA_FLAGS)"
#endif
#include "kernels.h"
