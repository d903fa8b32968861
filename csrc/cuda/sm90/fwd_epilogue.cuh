// The forward kernel's epilogue, per consumer warpgroup: O /= l and lse = m * scale + ln l, stored from
// registers or staged in shared memory for a TMA store; and the split schedules' partial results
// (unnormalised O, running max and sum) written to and merged from a global workspace.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../fwd_params.h"
#include "fwd_scheduler.cuh"
#include "fwd_traits.cuh"
#include "primitives.cuh"
#include "softmax.cuh"

namespace flashop {
namespace sm90 {

// A consumer warpgroup's view of its results: references to the consumer thread's O, m, l and place.
template <class T>
struct FwdEpilogue {
  static constexpr int kBM = T::kBlockM, kD = T::kHeadDim;
  static constexpr int kWGs = T::kConsumerWGs;
  using Elem = typename std::conditional<T::kBf16, __nv_bfloat16, __half>::type;
  // Persistent kernel with its own O tile: the wait for an O store's read of the staging is deferred to
  // just before the next store into it (see store_o_tma). Only with the separate O tile: otherwise the
  // staging is Q, which the producer needs back (q_empty) as early as possible for the next tile's load.
  static constexpr bool kDeferStoreWait = T::kSeparateO;

  const FwdParams& p;
  const FwdSmem<T>& smem;
  const FwdTileScheduler<T>& sched;
  float (&o)[kD / 2];
  float (&m)[2];
  float (&l)[2];  // per-thread partial row sums (reduced over the quad here)
  const int& c;      // consumer warpgroup: rows 64c .. 64c+63 of the tile
  const int& ctid;   // 0..127 within the warpgroup
  const int& warp;
  const int& lane;
  const int& q_row0;  // this thread's rows q_row0 and q_row0 + 8
  const int& col_base;
  const float& sl2;
  const bool& multicast;  // launched as a cluster of two (T::kMulticast)

  // The 128 threads of this consumer warpgroup (kTmaStore epilogue): named
  // barrier 3 (consumer 0) or 4 (consumer 1); 4, 5, 6 with three consumers.
  // Compile-time ids, so ptxas reserves 5 (7) barriers, not all 16.
  __device__ void bar() const {
    if constexpr (kWGs == 2) {
      if (c == 0) named_bar_sync<3, 128>();
      else named_bar_sync<4, 128>();
    } else {
      if (c == 0) named_bar_sync<4, 128>();
      else if (c == 1) named_bar_sync<5, 128>();
      else named_bar_sync<6, 128>();
    }
  }

  __device__ bool bar_or(bool pred) const {
    if constexpr (kWGs == 2) {
      return c == 0 ? named_bar_sync_or<3, 128>(pred) : named_bar_sync_or<4, 128>(pred);
    } else {
      return c == 0 ? named_bar_sync_or<4, 128>(pred) : c == 1 ? named_bar_sync_or<5, 128>(pred)
                                                               : named_bar_sync_or<6, 128>(pred);
    }
  }

  // Split tail (T::kStreamK): this warpgroup's partial result of a split tile in CTA cta's workspace
  // slot (layout: the traits' kPartialFloat4s), and the flag that says it is complete.
  __device__ float4* partial_slot(int cta) const {
    return reinterpret_cast<float4*>(p.workspace) + cta * T::kPartialFloat4s + c * (kD / 8 + 1) * 128 + ctid;
  }
  __device__ int* partial_flag(int cta) const {
    return reinterpret_cast<int*>(reinterpret_cast<float4*>(p.workspace) + gridDim.x * T::kPartialFloat4s) +
           cta * kWGs + c;
  }
  // This thread's O (unnormalised), m and l into a partial-result slot (layout: kPartialFloat4s).
  __device__ void write_partial(float4* slot) const {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i)
      __stcg(slot + i * 128, make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]));
    __stcg(slot + (kD / 8) * 128, make_float4(m[0], m[1], l[0], l[1]));
  }
  // kPartOut: O (unnormalised), m and l as they stand, then the flag once all 128 threads have stored.
  __device__ void store_partial() const {
    write_partial(partial_slot(blockIdx.x));
    bar();
    if (ctid == 0) {
      __threadfence();
      st_release_gpu(partial_flag(blockIdx.x), 1);
    }
  }
  // kPartIn: wait for CTA b-1's part of this tile and fold it in (the online softmax's merge of two
  // key ranges: both sides rescaled to the larger running max). m is the same in the four threads of a
  // row, so the per-thread partial sums l merge as they are and are reduced over the quad as usual.
  __device__ void merge_from(const float4* slot) const {
    const float4 ml = __ldcg(slot + (kD / 8) * 128);
    const float m_in[2] = {ml.x, ml.y}, l_in[2] = {ml.z, ml.w};
    float f_own[2], f_in[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx = fmaxf(m[h], m_in[h]);
      f_own[h] = m[h] == -INFINITY ? 0.f : exp2f((m[h] - mx) * sl2);
      f_in[h] = m_in[h] == -INFINITY ? 0.f : exp2f((m_in[h] - mx) * sl2);
      m[h] = mx;
      l[h] = l[h] * f_own[h] + l_in[h] * f_in[h];
    }
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      const float4 v = __ldcg(slot + i * 128);
      o[4 * i + 0] = o[4 * i + 0] * f_own[0] + v.x * f_in[0];
      o[4 * i + 1] = o[4 * i + 1] * f_own[0] + v.y * f_in[0];
      o[4 * i + 2] = o[4 * i + 2] * f_own[1] + v.z * f_in[1];
      o[4 * i + 3] = o[4 * i + 3] * f_own[1] + v.w * f_in[1];
    }
  }
  __device__ void merge_partial() const {
    while (ld_acquire_gpu(partial_flag(blockIdx.x - 1)) == 0) __nanosleep(32);
    merge_from(partial_slot(blockIdx.x - 1));
  }

  // Split last wave (T::kSplitTail): piece q of split tile st keeps its partial result in slot
  // st * split_pieces + q; each consumer warpgroup of each split tile has an arrival counter (zeroed by
  // the launcher). A warpgroup stores its partial, then counts itself in; the one that arrives last (the
  // others' stores are visible: each made them, with a fence, before its arrival) merges all pieces'
  // parts in piece order (deterministic) and goes on to the epilogue; the others are done. Nobody
  // waits for another CTA, whatever order the CTAs run in. Returns whether this warpgroup writes the
  // rows.
  __device__ bool finish_piece() const {
    const int k = p.split_pieces;
    int piece, split_tile;
    sched.piece_of_cta(piece, split_tile, multicast);
    const float4* const slots = reinterpret_cast<const float4*>(p.workspace) +
                                static_cast<int64_t>(split_tile) * k * T::kPartialFloat4s +
                                c * (kD / 8 + 1) * 128 + ctid;
    write_partial(const_cast<float4*>(slots) + piece * T::kPartialFloat4s);
    __threadfence();
    bar();  // all 128 stores made before the arrival
    int before = 0;
    if (ctid == 0) {
      int* const counters = reinterpret_cast<int*>(reinterpret_cast<float4*>(p.workspace) +
                                                   static_cast<int64_t>(p.split_tiles) * k * T::kPartialFloat4s);
      before = atomicAdd(counters + split_tile * kWGs + c, 1);
    }
    if (!bar_or(ctid == 0 && before == k - 1)) return false;  // a later piece writes the rows
    __threadfence();
    // All k parts, its own too, in piece order: the result does not depend on which piece came last.
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    for (int q = 0; q < k; ++q) merge_from(slots + q * T::kPartialFloat4s);
    return true;
  }

  // T::kVariants: row h's lse (natural log) and, with sinks, its normaliser inv (O *= inv), from the
  // quad's sum and `seen` = sum > 0. The sink (score units) is one more term of the row's denominator,
  // folded in here, after any split part's merge (which therefore counts it exactly once). With
  // ms = m * scale, mx = max(ms, sink): lse = mx + log(sum exp(ms - mx) + exp(sink - mx)), and
  // O / (sum + exp(sink - ms)) = O * exp(ms - mx) / (sum exp(ms - mx) + exp(sink - mx)). No visible
  // key: inv = 0 (as without sinks), lse = sink. (The dense kernel keeps its own expressions inline.)
  // Packed batches: a row past its sequence's seqlen_q (seqused_q) is not live: out = 0 (a select, not
  // a product: its q row may hold anything), lse = -inf, sinks or not.
  __device__ __forceinline__ void variants_row(int h, int row, float sum, bool seen, float& inv, float& lse_row,
                                               bool& live) const {
    live = row < sched.seqlen_q();
    lse_row = seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
    if (!live) {
      lse_row = -INFINITY;
    } else if (p.variants.sinks != nullptr) {
      const float sink = p.variants.sinks[sched.head];
      if (!seen) {
        lse_row = sink;
      } else {
        const float ms = m[h] * p.scale;
        const float mx = fmaxf(ms, sink);
        const float own = __expf(ms - mx);
        const float total = sum * own + __expf(sink - mx);
        lse_row = mx + __logf(total);
        inv = own / total;
      }
    }
  }

  // Two output columns of a row: O / l, or zeros where the row is not live (T::kVariants; constant true
  // in the dense kernel).
  __device__ __forceinline__ uint32_t out_pair(float a, float b, float inv, bool live) const {
    return pack2<T::kBf16>(live ? a * inv : 0.f, live ? b * inv : 0.f);
  }

  // O /= l and lse from registers straight to global memory (rows < Sq, columns < headdim: n8 block i
  // holds columns 8i .. 8i+7 and headdim is a multiple of 8, so one uniform compare per block).
  __device__ __forceinline__ void store_o_regs(float* lse) const {
    const int n8 = p.headdim / 8;
    Elem* out = reinterpret_cast<Elem*>(p.out) + sched.batch * p.o_batch_stride + sched.head * p.o_head_stride +
                static_cast<int64_t>(sched.q_row_base()) * p.o_row_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = q_row0 + 8 * h;
      const float sum = quad_sum(l[h]);
      const bool seen = sum > 0.f;  // no visible key: out = 0, lse = -inf
      float inv = seen ? 1.f / sum : 0.f;
      float lse_row = 0.f;
      bool live = true;
      if constexpr (T::kVariants) variants_row(h, row, sum, seen, inv, lse_row, live);
      if (row < sched.rows_q()) {
        Elem* orow = out + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll
        for (int i = 0; i < kD / 8; ++i) {
          const uint32_t v = out_pair(o[4 * i + 2 * h], o[4 * i + 2 * h + 1], inv, live);
          if (i < n8) *reinterpret_cast<uint32_t*>(orow + 8 * i + col_base) = v;
        }
        if ((lane % 4) == 0) lse[row] = T::kVariants ? lse_row : seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
      }
    }
  }

  // O /= l through this warpgroup's staging tile in shared memory and a TMA store; lse from registers.
  // sQ, k: the tile's Q buffer and its number within the CTA (q_empty when the staging is Q).
  __device__ __forceinline__ void store_o_tma(float* lse, const CUtensorMap* tm_o, uint32_t sQ, uint32_t k) const {
    // Staging = rows 64c..64c+63 of every Q column block (see the traits).
    // Q smem is free for this warpgroup: its own wgmmas, the only readers of
    // these rows, are complete (wait_group 0 above; a wgmma's completion
    // includes an implicit generic-async proxy fence), the TMA write of Q
    // completed before they started (q_full), and the previous tile's TMA
    // store has read it (persistent: wait_group.read + bar 3+c, below, or
    // with the deferred wait just below). With no key tile, Q was not loaded
    // at all.
    const uint32_t stage = (T::kSeparateO ? smem.base + T::kOOff : sQ) + c * T::kOStageBytes;
    // Deferred store wait (persistent, own O tile): the previous tile's store of this warpgroup
    // may still be reading the staging; wait here, just before it is written again, rather than
    // at the end of that tile's epilogue, where the wait would hold the warpgroup (and, through the
    // ping-pong, the other one's next turn) off the tensor cores for the store's whole read.
    if constexpr (kDeferStoreWait) {
      if (ctid == 0) tma_store_wait_read<0>();
      bar();
    }
    // 128B swizzle: row r of a 64 x 64 box at r * 128, 16-byte chunk q at
    // (q ^ (r % 8)) * 16. This thread's rows r = 16 warp + lane/4 (+8):
    // r % 8 = lane / 4. n8 block i holds columns 8i + 2(lane%4) + {0,1}: column
    // block i / 8, chunk i % 8, bytes 4(lane%4) .. +3 of the chunk. For a fixed
    // i the 8 rows of a warp hit 8 distinct chunks: 32 distinct banks.
    // 64B swizzle: row r of a 64 x 32 box at r * 64, chunk q at (q ^ ((r / 2) % 4)) * 16, with
    // (r / 2) % 4 = (8 warp + lane/8 + 4h) % 4 = lane / 8; column block i / 4, chunk i % 4. A warp's 8
    // rows for a fixed i: (r % 2, swizzled chunk) all distinct, 8 x 16 bytes of one 512-byte atom in
    // 8 distinct 4-bank groups: again 32 distinct banks.
    constexpr int kChunks = T::kColBlock / 8;  // 16-byte chunks per row
    const int rsw = T::kRowBytes == 128 ? lane / 4 : lane / 8;
    const int orow0 = sched.q_tile * kBM + 64 * c;  // this warpgroup's first row
    // Packed batch: the map's rows run on into the next sequence, so a box that reaches past this
    // sequence's rows is not TMA-stored; its rows go from registers to global memory instead.
    bool direct = false;
    if constexpr (T::kVariants) direct = p.packed.packed() && orow0 + T::kOStageRows > sched.rows_q();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = q_row0 + 8 * h;
      const int r = 16 * warp + lane / 4 + 8 * h;  // row within this warpgroup's 64
      const float sum = quad_sum(l[h]);
      const bool seen = sum > 0.f;  // no visible key: out = 0, lse = -inf
      float inv = seen ? 1.f / sum : 0.f;
      float lse_row = 0.f;
      bool live = true;
      if constexpr (T::kVariants) variants_row(h, row, sum, seen, inv, lse_row, live);
      if constexpr (T::kVariants) {
        if (direct) {
          if (row < sched.rows_q()) {
            const int n8 = p.headdim / 8;
            Elem* orow = reinterpret_cast<Elem*>(p.out) + sched.head * p.o_head_stride +
                         static_cast<int64_t>(sched.q_start + row) * p.o_row_stride;
#pragma unroll
            for (int i = 0; i < kD / 8; ++i) {
              const uint32_t v = out_pair(o[4 * i + 2 * h], o[4 * i + 2 * h + 1], inv, live);
              if (i < n8) *reinterpret_cast<uint32_t*>(orow + 8 * i + col_base) = v;
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        const uint32_t v = out_pair(o[4 * i + 2 * h], o[4 * i + 2 * h + 1], inv, live);
        const uint32_t addr = stage + (i / kChunks) * T::kQBlockBytes + r * T::kRowBytes +
                              ((((i % kChunks) ^ rsw) << 4) | (4 * (lane % 4)));
        st_shared_b32(addr, v);
      }
      if (row < sched.rows_q() && (lane % 4) == 0)
        lse[row] = T::kVariants ? lse_row : seen ? m[h] * p.scale + __logf(sum) : -INFINITY;
    }
    // Every writer: its st.shared before the async proxy's reads; then all
    // 128 threads of this warpgroup (bar 3 + c; 1 and 2 are the turns).
    fence_proxy_async_smem();
    bar();
    if (ctid == 0) {
      // The map's row extent is Sq and its column extent headdim: rows >= Sq and columns >= headdim
      // of a box are not written. A box entirely past Sq (second half of a short last tile) or
      // past headdim (a column block of the padded width) is skipped. Packed: only whole boxes of the
      // sequence (direct above), at its row offset.
      if (orow0 < sched.rows_q() && !direct) {
#pragma unroll
        for (int b = 0; b < T::kDBlocks; ++b)
          if (b == 0 || b * T::kColBlock < p.headdim)
            tma_store_4d(tm_o, stage + b * T::kQBlockBytes, b * T::kColBlock, sched.q_row_base() + orow0,
                         sched.head, sched.tma_batch());
        tma_store_commit();
        // Staging must stay valid (CTA alive; persistent: not overwritten)
        // until the store has read it (deferred: at the next tile's epilogue,
        // or after the CTA's last tile).
        if constexpr (!kDeferStoreWait) tma_store_wait_read<0>();
      }
      // The tile's q_empty arrival: the staging (Q) has been read.
      if constexpr (T::kPersistent && !T::kSeparateO) mbar_arrive(smem.bar_q_empty(smem.q_pair(k, c)));
    }
    // Persistent: nobody in this warpgroup writes the staging of the next
    // tile before the store above has read this one (deferred: the barrier
    // after the wait at the top of the next epilogue).
    if constexpr (T::kPersistent && !kDeferStoreWait) bar();
  }
};

}  // namespace sm90
}  // namespace flashop
