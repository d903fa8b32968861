// Packed batches (FlashAttention's varlen): flashop.forward's and flashop.backward's cu_seqlens_q/k and
// seqused_q/k as plain data (no torch). The CUDA kernels read it from their params; every index a kernel
// forms goes through sequence_bounds below, so no value in these tensors makes a kernel read or write
// outside the packed tensors (the eager checks of csrc/checks.cpp report bad values; under torch.compile
// nothing reads them on the host).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHOP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLASHOP_HOST_DEVICE inline
#endif

namespace flashop {

struct PackedSequences {
  // Null for a dense batch. Packed: sequence b is query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q,
  // out, dout and dq (the params' batch strides are 0 and only row and head strides apply) and key rows
  // cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k, v, dk and dv; the params' batch is the number of sequences
  // and seqlen_q / seqlen_k are max_seqlen_q / max_seqlen_k (they size the grid). softmax_lse is
  // (Hq, total_q): query row r of head h at lse[h * lse_head_stride + r] (lse_batch_stride 0).
  const int32_t* cu_seqlens_q = nullptr;  // int32 (batch + 1,)
  const int32_t* cu_seqlens_k = nullptr;  // int32 (batch + 1,)
  // Optional (FlashAttention-3's): sequence b uses only its first seqused_q[b] queries / seqused_k[b]
  // keys. Query rows past it get zero output, lse = -inf and zero dq; key rows past it zero dk and dv.
  const int32_t* seqused_q = nullptr;  // int32 (batch,) or null
  const int32_t* seqused_k = nullptr;  // int32 (batch,) or null
  int total_q = 0;  // rows of q (and out, dout, dq, lse)
  int total_k = 0;  // rows of k (and v, dk, dv)

  FLASHOP_HOST_DEVICE bool packed() const { return cu_seqlens_q != nullptr; }
};

// Where sequence b's rows start in the packed tensor and how many of them the kernel uses: clamped so that
// start + used <= total and used <= max_len (the grid's extent) whatever the index values. `used` is the
// row count the attention runs over (queries or keys); `len` the rows the sequence owns (used <= len), which
// a kernel that writes every owned row (zeros past `used`) must not exceed.
struct SequenceBounds {
  int start;
  int len;
  int used;
};

FLASHOP_HOST_DEVICE SequenceBounds sequence_bounds(const int32_t* cu_seqlens, const int32_t* seqused, int b,
                                                   int total, int max_len) {
  int start = cu_seqlens[b];
  int end = cu_seqlens[b + 1];
  start = start < 0 ? 0 : (start > total ? total : start);
  end = end < start ? start : (end > total ? total : end);
  int len = end - start;
  len = len > max_len ? max_len : len;
  int used = len;
  if (seqused != nullptr) {
    const int u = seqused[b];
    used = u < 0 ? 0 : (u < len ? u : len);
  }
  return {start, len, used};
}

}  // namespace flashop
