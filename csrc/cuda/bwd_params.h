// Arguments of the backward kernels: plain data, no torch, no CUDA headers.
// The glue (backward_cuda.cpp) fills it from validated tensors and allocates
// the workspaces whose sizes bwd_workspace_sizes() gives; every kernel config
// reads the same struct.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../attention_variants.h"
#include "../packed_sequences.h"

namespace flashop {

// Query rows of every per-(batch, head) workspace row block are padded to a
// multiple of this, so a query tile (B_r divides 128) never reads past the end.
constexpr int kBwdSeqQPad = 128;

inline constexpr int bwd_round_up(int x, int m) { return (x + m - 1) / m * m; }

// Packed batches (p.packed): the workspaces dq_accum, dsum, lse_log2 hold, per query head,
// bwd_packed_ws_rows rows; sequence b's query rows start at row bwd_packed_ws_row0 of its head's block
// (start = its first row in q, from sequence_bounds). Each sequence owns round_up(len, kBwdSeqQPad) rows
// there (len <= its next start - start): round_up(start, 4) + 132 b, with 16-byte aligned rows for the
// 16-byte lse/D copies, advances by at least len + 129 from one sequence to the next.
FLASHOP_HOST_DEVICE int64_t bwd_packed_ws_row0(int start, int b) {
  return int64_t(bwd_round_up(start, 4)) + int64_t(kBwdSeqQPad + 4) * b;
}
FLASHOP_HOST_DEVICE int64_t bwd_packed_ws_rows(int total_q, int batch) {
  return int64_t(bwd_round_up(total_q, 4)) + int64_t(kBwdSeqQPad + 4) * batch;
}

// The Hopper backward's tail split (sm90/bwd_tail.h): blocks first_block .. first_block + blocks - 1 of the
// dispatch order (the last wave's) run as `pieces` CTAs each, over consecutive runs of their query steps.
// pieces = 0: no split.
struct BwdTailSplit {
  int first_block;
  int blocks;
  int pieces;
};

struct BwdParams {
  // Inputs, fp16 or bf16, last dimension contiguous; base pointers 16-byte
  // aligned and every stride a multiple of 8 elements (the glue copies
  // otherwise), so each 8-element chunk of a row moves as one 16-byte access.
  const void* q;     // (B, Sq, Hq, D)
  const void* k;     // (B, Sk, Hk, D)
  const void* v;     // (B, Sk, Hk, D)
  const void* out;   // (B, Sq, Hq, D)
  const void* dout;  // (B, Sq, Hq, D)
  const float* lse;  // (B, Hq, Sq) float32, natural log, row (query) stride 1

  // Outputs, same dtype, same layout rules as the inputs.
  void* dq;  // (B, Sq, Hq, D)
  void* dk;  // (B, Sk, Hk, D)
  void* dv;  // (B, Sk, Hk, D)

  // Workspaces (fp32/int32, contiguous, written by the kernels before use; no
  // memset needed). Rows of each (batch, q_head) padded to seqlen_q_rounded.
  // [B][Hq][seqlen_q_rounded][W], W the kernel's tile width (>= headdim; columns past headdim are
  // padding): sum over key tiles of dS K (unscaled).
  // Packed batches: [Hq][bwd_packed_ws_rows][W], and likewise dsum and lse_log2 (above).
  float* dq_accum;
  float* dsum;      // [B][Hq][seqlen_q_rounded]: D_i = rowsum(dO_i * O_i); 0 on padding rows
  float* lse_log2;  // [B][Hq][seqlen_q_rounded]: lse * log2(e); +inf where lse = -inf and on padding
  int* dq_semaphore;  // [B][Hq][num_m_blocks]: deterministic mode only (else may be null); packed: B sequences

  // Strides in elements.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  int batch;
  int seqlen_q;          // >= 1
  int seqlen_k;          // >= 1
  int seqlen_q_rounded;  // bwd_round_up(seqlen_q, kBwdSeqQPad) (packed: of max_seqlen_q)
  int heads_q;
  int heads_k;
  int head_ratio;  // heads_q / heads_k: kv_head = q_head / head_ratio (GQA/MQA)
  int headdim;     // the true head dimension: a multiple of 8, 8 <= headdim <= the kernel's tile width
                   // (Cfg::kHeadDim); no kernel reads or writes a column at or past it
  int num_m_blocks;  // ceil(seqlen_q / B_r) of the launched config (semaphore row length)
  int sm_count;      // multiprocessors of the device (sizes the lpt block groups, bwd_config.h)
  int64_t l2_bytes;  // L2 cache of the device (caps the lpt block groups)

  float scale;       // softmax_scale (any sign)
  float scale_log2;  // softmax_scale * log2(e)
  bool causal;       // bottom-right aligned: query i sees key j iff j <= i + Sk - Sq
  // Windows, softcap, ALiBi (csrc/attention_variants.h; sinks need nothing here: lse carries them);
  // causal above is variants' (-1, 0) window.
  AttentionVariants variants;
  // Packed batches (csrc/packed_sequences.h); packed.packed() false for a dense batch.
  PackedSequences packed;
  // Bit-identical dQ run to run: key tiles add their dQ contributions to a
  // query tile in key-tile order, serialised by dq_semaphore (see bwd_kernel.cuh).
  bool deterministic;
  // Hopper builds only (sm90/bwd_tail.h); zero elsewhere. dkv_tail: [tail.blocks][2][B_c][W] floats, zeroed
  // before the main kernel: the split blocks' dK (unscaled) and dV, summed over their pieces.
  BwdTailSplit tail;
  float* dkv_tail;
};

// Rows of the workspaces dq_accum, dsum and lse_log2 (packed: total_q >= 0 the rows of q; dense: -1).
// The Hopper backward's dQ boxes (sm90/bwd_kernel.cuh) hold query offset r of a 16-row group at box row
// 2 (r % 8) + (r / 8) % 2, so that the rows a warp stores at once fall in different 128-byte swizzle phases;
// the reduce-add carries the order into the accumulator and the convert kernel reads it back. Queries
// and rows stay in their 16-aligned group (query tiles start at multiples of 64).
FLASHOP_HOST_DEVICE int bwd_dq_paired_row(int r) { return (r & ~15) | ((r & 7) << 1) | ((r >> 3) & 1); }

// The order of the dQ accumulator's elements within a 64-query tile (each tile's 64 rows of W floats), written by
// the main kernel and read back by the convert kernel:
//   kRows        row-major;
//   kPairedRows  rows of each 16-query group paired (bwd_dq_paired_row);
//   kFragments   64-column slices of 4096 floats (the last 2048 where W % 64 = 32) in the register order of an
//                m64n64 wgmma accumulator (the Hopper wide builds, D > 128): the four floats of a thread's n8 block
//                (queries g and g + 8, columns 2t and 2t + 1) are one float4, and a warp's 32 float4s 512 contiguous
//                bytes (bwd_dq_fragment_offset).
enum class BwdDQLayout { kRows, kPairedRows, kFragments };

// kFragments: the offset of (query r, column col) of a tile, for consumer-thread 32 w + 4 g + t of the warpgroup
// holding query 16 w + g + 8 h, columns 8 i + 2 t (+1) of n8 block i as registers 4 i + 2 h (+1).
FLASHOP_HOST_DEVICE int bwd_dq_fragment_offset(int r, int col) {
  const int w = r / 16, g = r % 8, h = (r / 8) % 2, i = (col % 64) / 8, t = (col % 8) / 2;
  return (col / 64) * 4096 + (i * 128 + 32 * w + 4 * g + t) * 4 + 2 * h + col % 2;
}

FLASHOP_HOST_DEVICE int64_t bwd_ws_rows(int batch, int heads_q, int seqlen_q_rounded, int total_q) {
  return total_q >= 0 ? int64_t(heads_q) * bwd_packed_ws_rows(total_q, batch)
                      : int64_t(batch) * heads_q * seqlen_q_rounded;
}

// Element counts of the workspaces for a problem and a config's tile width (Cfg::kHeadDim, the
// config name's d<W>: dq_accum rows are that wide, not the true head dimension) and B_r.
struct BwdWorkspaceSizes {
  std::size_t dq_accum;      // floats
  std::size_t dsum;          // floats
  std::size_t lse_log2;      // floats
  std::size_t dq_semaphore;  // ints (0 unless deterministic)
  int seqlen_q_rounded;
  int num_m_blocks;
};

// Packed batches: seqlen_q is max_seqlen_q and total_q the rows of q (>= 0); dense: total_q = -1.
inline BwdWorkspaceSizes bwd_workspace_sizes(int batch, int heads_q, int seqlen_q, int tile_width,
                                             int block_m, bool deterministic, int total_q = -1) {
  BwdWorkspaceSizes w{};
  w.seqlen_q_rounded = bwd_round_up(seqlen_q, kBwdSeqQPad);
  w.num_m_blocks = (seqlen_q + block_m - 1) / block_m;
  const std::size_t rows = std::size_t(bwd_ws_rows(batch, heads_q, w.seqlen_q_rounded, total_q));
  w.dq_accum = rows * tile_width;
  w.dsum = rows;
  w.lse_log2 = rows;
  w.dq_semaphore = deterministic ? std::size_t(batch) * heads_q * w.num_m_blocks : 0;
  return w;
}

}  // namespace flashop
