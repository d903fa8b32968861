// wgmma.mma_async wrappers: one template per A source, wgmma_ss (A from shared memory) and
// wgmma_rs (A from registers), on <element type, N, tnspB> (wgmma_ss: and tnspA); N = 32, 40, 48, 64, 80, 96, 112, 128, 160, 176, 192, 224 or 256 (hand-checked
// against the PTX ISA: with 16-bit A/B, N is any multiple of 8 from 8 to 256).
// D (f32 accumulators) is m64 x N, N/2 registers per thread: per warp w of the warpgroup rows
// 16w..16w+15; for n8 block i a thread holds d[4i+0..3] = (r, c), (r, c+1), (r+8, c), (r+8, c+1)
// with r = 16w + lane/4, c = 8i + 2*(lane%4).
// SS: A and B from shared memory via 64-bit descriptors.
// RS: A from registers (4 x b32 per thread, the m16n8k16 A layout per warp), B from smem.
// tnspB (immediate) = 0: B is K-major (N rows of K contiguous elements);
//                   = 1: B is MN-major (K rows of N contiguous elements).
//
// Why macros: inline asm takes neither a pack expansion in its operand list nor symbolic operand
// names in nvcc ("expected a )" / "symbolic operand reference not supported"), and the
// instruction names every accumulator register, so the text and the operand list of each width
// are spelled by the macros below and the templates pick them with if constexpr.
#pragma once
#include <cstdint>

namespace flashop {
namespace sm90 {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHOP_SM90_ENABLED 1
#endif

// Keeps the compiler from moving accumulator reads/writes across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---------------------------------------------------------------- operand spelling
// R = N/2 accumulator registers are asm operands %0 .. %(R-1) ("+f", read and written).
#define FLASHOP_WG_ACC_32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHOP_WG_ACC_16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FLASHOP_WG_ACC_20 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19"
#define FLASHOP_WG_ACC_24 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23"
#define FLASHOP_WG_ACC_40 FLASHOP_WG_ACC_32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define FLASHOP_WG_ACC_64 FLASHOP_WG_ACC_32 \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHOP_WG_ACC_48 FLASHOP_WG_ACC_40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define FLASHOP_WG_ACC_56 FLASHOP_WG_ACC_48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define FLASHOP_WG_ACC_80 FLASHOP_WG_ACC_64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define FLASHOP_WG_ACC_88 FLASHOP_WG_ACC_64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
  ", %80, %81, %82, %83, %84, %85, %86, %87"
#define FLASHOP_WG_ACC_96 FLASHOP_WG_ACC_88 \
  ", %88, %89, %90, %91, %92, %93, %94, %95"
#define FLASHOP_WG_ACC_112 FLASHOP_WG_ACC_96 \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define FLASHOP_WG_ACC_128 FLASHOP_WG_ACC_64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
  ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// The matching output operands d[0] .. d[R-1] of an array `d`.
#define FLASHOP_WG_D8(i)                                                                    \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),            \
      "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLASHOP_WG_D32(i) \
  FLASHOP_WG_D8(i), FLASHOP_WG_D8(i + 8), FLASHOP_WG_D8(i + 16), FLASHOP_WG_D8(i + 24)
#define FLASHOP_WG_D_16 FLASHOP_WG_D8(0), FLASHOP_WG_D8(8)
#define FLASHOP_WG_D_20 FLASHOP_WG_D8(0), FLASHOP_WG_D8(8), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define FLASHOP_WG_D_24 FLASHOP_WG_D8(0), FLASHOP_WG_D8(8), FLASHOP_WG_D8(16)
#define FLASHOP_WG_D_32 FLASHOP_WG_D32(0)
#define FLASHOP_WG_D_40 FLASHOP_WG_D32(0), FLASHOP_WG_D8(32)
#define FLASHOP_WG_D_48 FLASHOP_WG_D32(0), FLASHOP_WG_D8(32), FLASHOP_WG_D8(40)
#define FLASHOP_WG_D_56 FLASHOP_WG_D32(0), FLASHOP_WG_D8(32), FLASHOP_WG_D8(40), FLASHOP_WG_D8(48)
#define FLASHOP_WG_D_64 FLASHOP_WG_D32(0), FLASHOP_WG_D32(32)
#define FLASHOP_WG_D_80 FLASHOP_WG_D32(0), FLASHOP_WG_D32(32), FLASHOP_WG_D8(64), FLASHOP_WG_D8(72)
#define FLASHOP_WG_D_88 \
  FLASHOP_WG_D32(0), FLASHOP_WG_D32(32), FLASHOP_WG_D8(64), FLASHOP_WG_D8(72), FLASHOP_WG_D8(80)
#define FLASHOP_WG_D_96 FLASHOP_WG_D32(0), FLASHOP_WG_D32(32), FLASHOP_WG_D32(64)
#define FLASHOP_WG_D_112 \
  FLASHOP_WG_D32(0), FLASHOP_WG_D32(32), FLASHOP_WG_D32(64), FLASHOP_WG_D8(96), FLASHOP_WG_D8(104)
#define FLASHOP_WG_D_128 FLASHOP_WG_D32(0), FLASHOP_WG_D32(32), FLASHOP_WG_D32(64), FLASHOP_WG_D32(96)

// The inputs follow the outputs: operand k after the accumulators is %(R+k).
//   SS: %R desc_a, %R+1 desc_b, %R+2 scale_d, %R+3 tnspB
//   RS: %R..%R+3 a[0..3], %R+4 desc_b, %R+5 scale_d, %R+6 tnspB
#define FLASHOP_WG_ARG16_0 "%16"
#define FLASHOP_WG_ARG16_1 "%17"
#define FLASHOP_WG_ARG16_2 "%18"
#define FLASHOP_WG_ARG16_3 "%19"
#define FLASHOP_WG_ARG16_4 "%20"
#define FLASHOP_WG_ARG16_5 "%21"
#define FLASHOP_WG_ARG16_6 "%22"
#define FLASHOP_WG_ARG20_0 "%20"
#define FLASHOP_WG_ARG20_1 "%21"
#define FLASHOP_WG_ARG20_2 "%22"
#define FLASHOP_WG_ARG20_3 "%23"
#define FLASHOP_WG_ARG20_4 "%24"
#define FLASHOP_WG_ARG20_5 "%25"
#define FLASHOP_WG_ARG20_6 "%26"
#define FLASHOP_WG_ARG24_0 "%24"
#define FLASHOP_WG_ARG24_1 "%25"
#define FLASHOP_WG_ARG24_2 "%26"
#define FLASHOP_WG_ARG24_3 "%27"
#define FLASHOP_WG_ARG24_4 "%28"
#define FLASHOP_WG_ARG24_5 "%29"
#define FLASHOP_WG_ARG24_6 "%30"
#define FLASHOP_WG_ARG32_0 "%32"
#define FLASHOP_WG_ARG32_1 "%33"
#define FLASHOP_WG_ARG32_2 "%34"
#define FLASHOP_WG_ARG32_3 "%35"
#define FLASHOP_WG_ARG32_4 "%36"
#define FLASHOP_WG_ARG32_5 "%37"
#define FLASHOP_WG_ARG32_6 "%38"
#define FLASHOP_WG_ARG40_0 "%40"
#define FLASHOP_WG_ARG40_1 "%41"
#define FLASHOP_WG_ARG40_2 "%42"
#define FLASHOP_WG_ARG40_3 "%43"
#define FLASHOP_WG_ARG40_4 "%44"
#define FLASHOP_WG_ARG40_5 "%45"
#define FLASHOP_WG_ARG40_6 "%46"
#define FLASHOP_WG_ARG48_0 "%48"
#define FLASHOP_WG_ARG48_1 "%49"
#define FLASHOP_WG_ARG48_2 "%50"
#define FLASHOP_WG_ARG48_3 "%51"
#define FLASHOP_WG_ARG48_4 "%52"
#define FLASHOP_WG_ARG48_5 "%53"
#define FLASHOP_WG_ARG48_6 "%54"
#define FLASHOP_WG_ARG56_0 "%56"
#define FLASHOP_WG_ARG56_1 "%57"
#define FLASHOP_WG_ARG56_2 "%58"
#define FLASHOP_WG_ARG56_3 "%59"
#define FLASHOP_WG_ARG56_4 "%60"
#define FLASHOP_WG_ARG56_5 "%61"
#define FLASHOP_WG_ARG56_6 "%62"
#define FLASHOP_WG_ARG80_0 "%80"
#define FLASHOP_WG_ARG80_1 "%81"
#define FLASHOP_WG_ARG80_2 "%82"
#define FLASHOP_WG_ARG80_3 "%83"
#define FLASHOP_WG_ARG80_4 "%84"
#define FLASHOP_WG_ARG80_5 "%85"
#define FLASHOP_WG_ARG80_6 "%86"
#define FLASHOP_WG_ARG112_0 "%112"
#define FLASHOP_WG_ARG112_1 "%113"
#define FLASHOP_WG_ARG112_2 "%114"
#define FLASHOP_WG_ARG112_3 "%115"
#define FLASHOP_WG_ARG112_4 "%116"
#define FLASHOP_WG_ARG112_5 "%117"
#define FLASHOP_WG_ARG112_6 "%118"
#define FLASHOP_WG_ARG64_0 "%64"
#define FLASHOP_WG_ARG64_1 "%65"
#define FLASHOP_WG_ARG64_2 "%66"
#define FLASHOP_WG_ARG64_3 "%67"
#define FLASHOP_WG_ARG64_4 "%68"
#define FLASHOP_WG_ARG64_5 "%69"
#define FLASHOP_WG_ARG64_6 "%70"
#define FLASHOP_WG_ARG88_0 "%88"
#define FLASHOP_WG_ARG88_1 "%89"
#define FLASHOP_WG_ARG88_2 "%90"
#define FLASHOP_WG_ARG88_3 "%91"
#define FLASHOP_WG_ARG88_4 "%92"
#define FLASHOP_WG_ARG88_5 "%93"
#define FLASHOP_WG_ARG88_6 "%94"
#define FLASHOP_WG_ARG96_0 "%96"
#define FLASHOP_WG_ARG96_1 "%97"
#define FLASHOP_WG_ARG96_2 "%98"
#define FLASHOP_WG_ARG96_3 "%99"
#define FLASHOP_WG_ARG96_4 "%100"
#define FLASHOP_WG_ARG96_5 "%101"
#define FLASHOP_WG_ARG96_6 "%102"
#define FLASHOP_WG_ARG128_0 "%128"
#define FLASHOP_WG_ARG128_1 "%129"
#define FLASHOP_WG_ARG128_2 "%130"
#define FLASHOP_WG_ARG128_3 "%131"
#define FLASHOP_WG_ARG128_4 "%132"
#define FLASHOP_WG_ARG128_5 "%133"
#define FLASHOP_WG_ARG128_6 "%134"

// D[64xN] (+)= A[64x16] (smem, tnspA) * B[16xN] (smem, tnspB); scale_d = 0 overwrites D.
// AB: "bf16.bf16" or "f16.f16". Uses desc_a, desc_b, scale_d, kTnspB, kTnspA and d of the caller.
#define FLASHOP_WGMMA_SS_ASM(N, R, AB)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLASHOP_WG_ARG##R##_2 ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB " "                            \
               "{" FLASHOP_WG_ACC_##R "}, " FLASHOP_WG_ARG##R##_0 ", " FLASHOP_WG_ARG##R##_1       \
               ", p, 1, 1, " FLASHOP_WG_ARG##R##_4 ", " FLASHOP_WG_ARG##R##_3 ";\n}\n"                   \
               : FLASHOP_WG_D_##R                                                                  \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTnspB), "n"(kTnspA))
// D[64xN] (+)= A[64x16] (registers a[0..3]) * B[16xN] (smem, tnspB).
#define FLASHOP_WGMMA_RS_ASM(N, R, AB)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " FLASHOP_WG_ARG##R##_5 ", 0;\n"                 \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." AB " "                            \
               "{" FLASHOP_WG_ACC_##R "}, {" FLASHOP_WG_ARG##R##_0 ", " FLASHOP_WG_ARG##R##_1      \
               ", " FLASHOP_WG_ARG##R##_2 ", " FLASHOP_WG_ARG##R##_3 "}, " FLASHOP_WG_ARG##R##_4   \
               ", p, 1, 1, " FLASHOP_WG_ARG##R##_6 ";\n}\n"                                        \
               : FLASHOP_WG_D_##R                                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d),             \
                 "n"(kTnspB))
#define FLASHOP_WGMMA_BY_TYPE(KIND, N, R)                 \
  do {                                                    \
    if constexpr (kBf16) KIND(N, R, "bf16.bf16");         \
    else KIND(N, R, "f16.f16");                           \
  } while (0)

// N widths with spelled operands (N/2 registers): 32 (16; the sm90 wide backward's S^T, dP^T), 40 (20; its
// B_c = 80 build's S, dP), 48 (24; the sm90 backward's d96 dQ), 64 (32), 80 (40),
// 96 (48), 112 (56), 128 (64), 160 (80), 176 (88), 192 (96), 224 (112), 256 (128). Another width needs its FLASHOP_WG_ACC_/D_/ARG entries and one
// line in each template below.
template <int N>
constexpr bool kWgmmaWidthSpelled = N == 32 || N == 40 || N == 48 || N == 64 || N == 80 || N == 96 || N == 112 || N == 128 || N == 160 ||
                                    N == 176 || N == 192 || N == 224 || N == 256;

// D[64xN] (+)= A[64x16] (smem, descriptor, tnspA: 0 K-major, 1 MN-major) * B[16xN] (smem, descriptor, tnspB)
template <bool kBf16, int N, int kTnspB, int kTnspA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  static_assert(kWgmmaWidthSpelled<N>, "wgmma N not spelled in wgmma.cuh");
#ifdef FLASHOP_SM90_ENABLED
  if constexpr (N == 32) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 32, 16);
  else if constexpr (N == 40) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 40, 20);
  else if constexpr (N == 48) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 48, 24);
  else if constexpr (N == 64) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 64, 32);
  else if constexpr (N == 80) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 80, 40);
  else if constexpr (N == 96) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 96, 48);
  else if constexpr (N == 112) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 112, 56);
  else if constexpr (N == 128) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 128, 64);
  else if constexpr (N == 160) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 160, 80);
  else if constexpr (N == 176) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 176, 88);
  else if constexpr (N == 192) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 192, 96);
  else if constexpr (N == 224) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 224, 112);
  else if constexpr (N == 256) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_SS_ASM, 256, 128);
#endif
}

// D[64xN] (+)= A[64x16] (registers) * B[16xN] (smem, descriptor, tnspB)
template <bool kBf16, int N, int kTnspB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b, int scale_d) {
  static_assert(kWgmmaWidthSpelled<N>, "wgmma N not spelled in wgmma.cuh");
#ifdef FLASHOP_SM90_ENABLED
  if constexpr (N == 32) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 32, 16);
  else if constexpr (N == 40) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 40, 20);
  else if constexpr (N == 48) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 48, 24);
  else if constexpr (N == 64) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 64, 32);
  else if constexpr (N == 80) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 80, 40);
  else if constexpr (N == 96) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 96, 48);
  else if constexpr (N == 112) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 112, 56);
  else if constexpr (N == 128) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 128, 64);
  else if constexpr (N == 160) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 160, 80);
  else if constexpr (N == 176) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 176, 88);
  else if constexpr (N == 192) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 192, 96);
  else if constexpr (N == 224) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 224, 112);
  else if constexpr (N == 256) FLASHOP_WGMMA_BY_TYPE(FLASHOP_WGMMA_RS_ASM, 256, 128);
#endif
}

}  // namespace sm90
}  // namespace flashop

// The spelling macros are not needed past this point (expanded in the templates above).
#undef FLASHOP_WG_ACC_16
#undef FLASHOP_WG_ACC_20
#undef FLASHOP_WG_ACC_24
#undef FLASHOP_WG_ACC_32
#undef FLASHOP_WG_ACC_40
#undef FLASHOP_WG_ACC_64
#undef FLASHOP_WG_ACC_48
#undef FLASHOP_WG_ACC_56
#undef FLASHOP_WG_ACC_80
#undef FLASHOP_WG_ACC_88
#undef FLASHOP_WG_ACC_96
#undef FLASHOP_WG_ACC_112
#undef FLASHOP_WG_ACC_128
#undef FLASHOP_WG_D8
#undef FLASHOP_WG_D32
#undef FLASHOP_WG_D_16
#undef FLASHOP_WG_D_20
#undef FLASHOP_WG_D_24
#undef FLASHOP_WG_D_32
#undef FLASHOP_WG_D_40
#undef FLASHOP_WG_D_48
#undef FLASHOP_WG_D_56
#undef FLASHOP_WG_D_64
#undef FLASHOP_WG_D_80
#undef FLASHOP_WG_D_88
#undef FLASHOP_WG_D_96
#undef FLASHOP_WG_D_112
#undef FLASHOP_WG_D_128
#undef FLASHOP_WG_ARG16_0
#undef FLASHOP_WG_ARG16_1
#undef FLASHOP_WG_ARG16_2
#undef FLASHOP_WG_ARG16_3
#undef FLASHOP_WG_ARG16_4
#undef FLASHOP_WG_ARG16_5
#undef FLASHOP_WG_ARG16_6
#undef FLASHOP_WG_ARG20_0
#undef FLASHOP_WG_ARG20_1
#undef FLASHOP_WG_ARG20_2
#undef FLASHOP_WG_ARG20_3
#undef FLASHOP_WG_ARG20_4
#undef FLASHOP_WG_ARG20_5
#undef FLASHOP_WG_ARG20_6
#undef FLASHOP_WG_ARG24_0
#undef FLASHOP_WG_ARG24_1
#undef FLASHOP_WG_ARG24_2
#undef FLASHOP_WG_ARG24_3
#undef FLASHOP_WG_ARG24_4
#undef FLASHOP_WG_ARG24_5
#undef FLASHOP_WG_ARG24_6
#undef FLASHOP_WG_ARG32_0
#undef FLASHOP_WG_ARG32_1
#undef FLASHOP_WG_ARG32_2
#undef FLASHOP_WG_ARG32_3
#undef FLASHOP_WG_ARG32_4
#undef FLASHOP_WG_ARG32_5
#undef FLASHOP_WG_ARG32_6
#undef FLASHOP_WG_ARG40_0
#undef FLASHOP_WG_ARG40_1
#undef FLASHOP_WG_ARG40_2
#undef FLASHOP_WG_ARG40_3
#undef FLASHOP_WG_ARG40_4
#undef FLASHOP_WG_ARG40_5
#undef FLASHOP_WG_ARG40_6
#undef FLASHOP_WG_ARG48_0
#undef FLASHOP_WG_ARG48_1
#undef FLASHOP_WG_ARG48_2
#undef FLASHOP_WG_ARG48_3
#undef FLASHOP_WG_ARG48_4
#undef FLASHOP_WG_ARG48_5
#undef FLASHOP_WG_ARG48_6
#undef FLASHOP_WG_ARG56_0
#undef FLASHOP_WG_ARG56_1
#undef FLASHOP_WG_ARG56_2
#undef FLASHOP_WG_ARG56_3
#undef FLASHOP_WG_ARG56_4
#undef FLASHOP_WG_ARG56_5
#undef FLASHOP_WG_ARG56_6
#undef FLASHOP_WG_ARG80_0
#undef FLASHOP_WG_ARG80_1
#undef FLASHOP_WG_ARG80_2
#undef FLASHOP_WG_ARG80_3
#undef FLASHOP_WG_ARG80_4
#undef FLASHOP_WG_ARG80_5
#undef FLASHOP_WG_ARG80_6
#undef FLASHOP_WG_ARG112_0
#undef FLASHOP_WG_ARG112_1
#undef FLASHOP_WG_ARG112_2
#undef FLASHOP_WG_ARG112_3
#undef FLASHOP_WG_ARG112_4
#undef FLASHOP_WG_ARG112_5
#undef FLASHOP_WG_ARG112_6
#undef FLASHOP_WG_ARG64_0
#undef FLASHOP_WG_ARG64_1
#undef FLASHOP_WG_ARG64_2
#undef FLASHOP_WG_ARG64_3
#undef FLASHOP_WG_ARG64_4
#undef FLASHOP_WG_ARG64_5
#undef FLASHOP_WG_ARG64_6
#undef FLASHOP_WG_ARG88_0
#undef FLASHOP_WG_ARG88_1
#undef FLASHOP_WG_ARG88_2
#undef FLASHOP_WG_ARG88_3
#undef FLASHOP_WG_ARG88_4
#undef FLASHOP_WG_ARG88_5
#undef FLASHOP_WG_ARG88_6
#undef FLASHOP_WG_ARG96_0
#undef FLASHOP_WG_ARG96_1
#undef FLASHOP_WG_ARG96_2
#undef FLASHOP_WG_ARG96_3
#undef FLASHOP_WG_ARG96_4
#undef FLASHOP_WG_ARG96_5
#undef FLASHOP_WG_ARG96_6
#undef FLASHOP_WG_ARG128_0
#undef FLASHOP_WG_ARG128_1
#undef FLASHOP_WG_ARG128_2
#undef FLASHOP_WG_ARG128_3
#undef FLASHOP_WG_ARG128_4
#undef FLASHOP_WG_ARG128_5
#undef FLASHOP_WG_ARG128_6
#undef FLASHOP_WGMMA_SS_ASM
#undef FLASHOP_WGMMA_RS_ASM
#undef FLASHOP_WGMMA_BY_TYPE
