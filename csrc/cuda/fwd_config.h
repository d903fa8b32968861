// The forward kernel configuration: a compile-time struct (FwdConfig) that the
// kernel turns into constants, and its short string form
// "<dtype>.d<D>.br<B_r>.bc<B_c>.w<warps>[.<flag>...]", e.g. "bf16.d128.br128.bc64.w4.kv2".
// flashop/configs.py (KernelConfig) mirrors this file field by field; keep the
// two in step (tools/codegen.py static_asserts the shared-memory size).
// Plain C++17: no torch, no CUDA headers.
#pragma once

#include <cstddef>

#include "kernel_config.h"  // DType

namespace flashop {

// Pipeline options: one bit each; the short form appends their names (flashop/configs.py), in
// this order.
enum FwdFlag : unsigned {
  // kv2: two K and two V buffers; tile j+1's K and V are fetched while tile j is
  // computed (one barrier per key tile). Off: one buffer each, V_j streams in under
  // Q K_j^T and K_{j+1} under softmax + P V_j (two barriers per key tile, less smem).
  kFlagKVDoubleBuffer = 1u << 0,
  // qreg: Q's mma fragments stay in registers for the whole key loop (one ldmatrix
  // pass) instead of being re-read from shared memory for every key tile.
  kFlagQInRegs = 1u << 1,
  // noswz: plain row-major shared tiles without the XOR swizzle (built only when named: shows
  // what ldmatrix bank conflicts cost).
  kFlagNoSwizzle = 1u << 2,
};

template <DType kDType_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, unsigned kFlags_ = 0>
struct FwdConfig {
  static constexpr DType kDType = kDType_;
  static constexpr int kHeadDim = kHeadDim_;  // tile width W: 32, 64, ..., 256 (takes head dims up to W)
  static constexpr int kBlockM = kBlockM_;    // B_r: query rows per thread block
  static constexpr int kBlockN = kBlockN_;    // B_c: key rows per key tile
  static constexpr int kWarps = kWarps_;      // warps per block; each owns B_r / warps query rows
  static constexpr unsigned kFlags = kFlags_;

  static constexpr bool kKVDoubleBuffer = (kFlags & kFlagKVDoubleBuffer) != 0;
  static constexpr bool kQInRegs = (kFlags & kFlagQInRegs) != 0;
  static constexpr bool kSwizzle = (kFlags & kFlagNoSwizzle) == 0;

  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;  // 16 or 32: one or two m16 mma tiles
  static constexpr int kStages = kKVDoubleBuffer ? 2 : 1;

  // Shared memory: Q tile + kStages x (K tile + V tile), 2-byte elements. The
  // output tile is staged in Q's space at the end, so it costs nothing extra.
  static constexpr std::size_t kSmemBytes =
      std::size_t(2) * kHeadDim * (kBlockM + 2 * kStages * kBlockN);

  static_assert(kHeadDim % 32 == 0 && kHeadDim >= 32 && kHeadDim <= 256,
                "tile width: a multiple of 32 up to 256 (it takes every head dimension up to it)");
  static_assert(kWarps == 2 || kWarps == 4 || kWarps == 8, "warps: 2, 4 or 8");
  static_assert(kBlockM % kWarps == 0 && (kRowsPerWarp == 16 || kRowsPerWarp == 32),
                "each warp owns 16 or 32 query rows");
  static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128, "B_c: 32, 64 or 128");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory beyond any sm80+ device");
};

// The same configuration as run-time values (registry entries).
struct FwdConfigDesc {
  DType dtype;
  int headdim;
  int block_m;
  int block_n;
  int warps;
  unsigned flags;
};

}  // namespace flashop
