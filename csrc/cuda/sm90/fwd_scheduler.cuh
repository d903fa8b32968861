// The forward kernel's tile scheduler: which (query tile, head, batch) and which key tiles of it each
// CTA works on, in which order. Producer and consumers hold one each and walk it identically.
//
// Persistent scheduler (T::kPersistent): tile t in [0, n_q_tiles * Hq * B) is
//   q_tile = n_q_tiles - 1 - t % n_q_tiles, head = (t / n_q_tiles) % Hq,
//   batch = t / (n_q_tiles * Hq)
// (the order in which the non-persistent grid's blocks are numbered: heaviest
// causal tiles of a head first); CTA b takes t = b, b + gridDim.x, ...
// T::kLongestFirst ("pers.lpt"): the query tile varies slowest instead,
//   q_tile = n_q_tiles - 1 - t / (Hq * B), head = t % (Hq * B) % Hq,
//   batch = t % (Hq * B) / Hq,
// so under causal masking tiles come in non-increasing length over all heads
// and batches, and the CTAs of one step of the stride (t = s * gridDim.x + b)
// hold tiles of equal (or adjacent) query index. Both orders are bijections of
// [0, n_q_tiles * Hq * B) onto the (q_tile, head, batch) triples, and both are
// computed by the one set_tile below from t alone.
//
// Packed batches (p.packed, csrc/packed_sequences.h; the variants build only): B is the number of
// sequences and the query tiles span max_seqlen_q, so a sequence's tiles past its own rows are
// enumerated too and skipped at once (tile_outside: the one-tile CTA exits, the walks go on), at the
// cost of a few loads of cu_seqlens per skipped tile.
#pragma once

#include <cstdint>

#include "../fwd_params.h"

namespace flashop {
namespace sm90 {

// Number of key tiles the CTA visits (identical for producer and consumers).
template <class T>
__device__ __forceinline__ int num_key_tiles(const FwdParams& p, int q_tile) {
  int key_end = p.seqlen_k;
  if (p.causal) {
    const int last_row = min((q_tile + 1) * T::kBlockM, p.seqlen_q) - 1;
    // query i sees key j iff j <= i + Sk - Sq
    key_end = min(key_end, last_row + p.seqlen_k - p.seqlen_q + 1);
  }
  return key_end <= 0 ? 0 : (key_end + T::kBlockN - 1) / T::kBlockN;
}

// The key tiles of query tile q_tile: first .. first + count - 1 (identical for producer and consumers).
// Dense kernel: key tiles 0 .. num_key_tiles - 1. T::kVariants: the tiles that hold a key some row of
// the tile sees through the window (csrc/attention_variants.h; causal is the window (-1, 0)): with
// off = Sk - Sq, rows r0 .. r1 see keys r0 + off - window_left .. r1 + off + window_right, one run
// without holes (row i's run is its predecessor's shifted by one), clipped to 0 .. Sk-1. No key at
// all: count 0 (the tile writes out = 0 and lse = -inf, or the sink). sq, sk: the tile's sequence's
// used queries and keys (T::kVariants; a packed batch's sequence, else Sq and Sk); a tile of rows all
// past sq (rows a packed sequence owns past its seqused) has no key tile.
template <class T>
__device__ __forceinline__ void key_tile_range(const FwdParams& p, int q_tile, int sq, int sk, int& first,
                                               int& count) {
  if constexpr (!T::kVariants) {
    first = 0;
    count = num_key_tiles<T>(p, q_tile);
  } else {
    const int wl = p.variants.window_left, wr = p.variants.window_right;
    const int off = sk - sq;
    const int r0 = q_tile * T::kBlockM;
    const int r1 = min(r0 + T::kBlockM, sq) - 1;
    const int key_begin = wl >= 0 ? max(r0 + off - wl, 0) : 0;
    const int key_end = wr >= 0 ? min(r1 + off + wr + 1, sk) : sk;
    if (key_end <= key_begin || r1 < r0) {
      first = 0;
      count = 0;
    } else {
      first = key_begin / T::kBlockN;
      count = (key_end + T::kBlockN - 1) / T::kBlockN - first;
    }
  }
}

// A work item's role: a whole tile (key tiles 0 .. n_tiles-1), or a part of a split tile (see walk).
constexpr int kWholeTile = 0, kPartOut = 1, kPartIn = 2;

template <class T>
struct FwdTileScheduler {
  const FwdParams& p;
  const int n_q_tiles;
  const int total_tiles;
  // The current tile. Non-persistent: one per CTA, highest query tiles first
  // (under causal masking they see the most keys).
  int q_tile = 0, head = 0, batch = 0, n_tiles = 0;
  int key_tile0 = 0;  // the first key tile of the work item (> 0 for a split tile's later parts, or a window)
  // The tile's sequence, T::kVariants only (the build that runs packed batches; csrc/packed_sequences.h):
  // its query rows start at row q_start of q, out and lse, its keys at row k_start of k and v; the
  // attention runs over its first used_q queries and used_k keys, and its rows used_q .. len_q - 1 are
  // written as zeros with lse = -inf. A dense batch: starts 0, used_q = len_q = Sq, used_k = Sk.
  int q_start = 0, k_start = 0, len_q = 0, used_q = 0, used_k = 0;

  // The tile's query and key counts and the rows it writes (the dense kernel: the params' own).
  __device__ __forceinline__ int seqlen_q() const {
    if constexpr (T::kVariants) return used_q;
    else return p.seqlen_q;
  }
  __device__ __forceinline__ int seqlen_k() const {
    if constexpr (T::kVariants) return used_k;
    else return p.seqlen_k;
  }
  __device__ __forceinline__ int rows_q() const {
    if constexpr (T::kVariants) return len_q;
    else return p.seqlen_q;
  }
  // Row offsets in the packed tensors and the TMA maps' batch coordinate (packed: maps of one batch).
  __device__ __forceinline__ int q_row_base() const { return T::kVariants ? q_start : 0; }
  __device__ __forceinline__ int k_row_base() const { return T::kVariants ? k_start : 0; }
  __device__ __forceinline__ int tma_batch() const {
    if constexpr (T::kVariants) return p.packed.packed() ? 0 : batch;
    else return batch;
  }
  // Packed: a tile of the max_seqlen_q grid whose rows all lie past its sequence's end has nothing to
  // do (no load, no store); the walks skip it.
  __device__ __forceinline__ bool tile_outside() const { return T::kVariants && q_tile * T::kBlockM >= len_q; }

  // The sequence of `batch` (T::kVariants). The consumers call it again for the epilogue, so that only
  // used_k (and their diag) stays live through the main loop: the persistent variants builds have no
  // register to spare there.
  __device__ __forceinline__ void set_sequence() {
    if constexpr (T::kVariants) {
      if (p.packed.packed()) {
        const SequenceBounds bq = sequence_bounds(p.packed.cu_seqlens_q, p.packed.seqused_q, batch,
                                                  p.packed.total_q, p.seqlen_q);
        const SequenceBounds bk = sequence_bounds(p.packed.cu_seqlens_k, p.packed.seqused_k, batch,
                                                  p.packed.total_k, p.seqlen_k);
        q_start = bq.start;
        len_q = bq.len;
        used_q = bq.used;
        k_start = bk.start;
        used_k = bk.used;
      } else {
        len_q = used_q = p.seqlen_q;
        used_k = p.seqlen_k;
      }
    }
  }
  // The sequence, then the key tiles of the tile.
  __device__ __forceinline__ void set_sequence_and_keys() {
    set_sequence();
    key_tile_range<T>(p, q_tile, seqlen_q(), seqlen_k(), key_tile0, n_tiles);
  }

  // The host guarantees n_q_tiles * Hq * B + gridDim.x < 2^31. set_tile runs only for t < total_tiles,
  // hence n_q_tiles >= 1 and Hq * B <= total_tiles: no product below overflows.
  __device__ __forceinline__ explicit FwdTileScheduler(const FwdParams& params)
      : p(params),
        n_q_tiles((params.seqlen_q + T::kBlockM - 1) / T::kBlockM),
        total_tiles(n_q_tiles * params.heads_q * params.batch) {}

  // Persistent: tile t -> (q_tile, head, batch, n_tiles); see the top of the file.
  __device__ void set_tile(int t) {
    if constexpr (T::kLongestFirst) {
      const int n_hb = p.heads_q * p.batch;  // (head, batch) pairs per query tile
      const int qi = t / n_hb;
      const int hb = t - qi * n_hb;
      q_tile = n_q_tiles - 1 - qi;
      batch = hb / p.heads_q;
      head = hb - batch * p.heads_q;
    } else {
      const int hb = t / n_q_tiles;
      q_tile = n_q_tiles - 1 - (t - hb * n_q_tiles);
      batch = hb / p.heads_q;
      head = hb - batch * p.heads_q;
    }
    set_sequence_and_keys();
  }

  // A persistent CTA's work items, in order; item(role) runs once the tile variables above are set.
  // Roles: a whole tile (key tiles 0 .. n_tiles-1), or a part of a split tile (below).
  // Without the split: tiles blockIdx.x, + gridDim.x, ... With it (T::kStreamK and p.stream_k, set by
  // the launcher for non-causal problems whose tile count is not a multiple of the grid): the tiles
  // below p.stream_k_tile0 the same way (a multiple of gridDim.x: the same number for every CTA), then
  // the rest, the last one or two waves, as units u = (t - stream_k_tile0) * n + j (key tile j of tile
  // t, n key tiles per tile, the same for all tiles when non-causal), dealt out in equal runs:
  // CTA b takes [u0, u1), u1 - u0 = per or per + 1 >= n (the launcher keeps at least one tile per CTA
  // in this part), so each run holds at most one tile's end part and one tile's start part, and a tile
  // is cut at most once. The run is walked from its last tile down:
  //   kPartOut: keys 0 .. x-1 of a tile whose other keys are the start of CTA b+1's run, the first
  //     item of b's split part; stores its unnormalised O, running max and sum in b's workspace slot
  //     and raises b's flag instead of writing O.
  //   kPartIn: keys x .. n-1 of a tile that CTA b-1 started, the last item of b's run; waits for b-1's
  //     flag, merges its partial into its own and writes O and lse.
  // CTA b only ever waits for CTA b-1, which raised its flag after its first split item, so the waits
  // form a chain that ends at CTA 0 (which never waits); the grid is at most one CTA per SM.
  // The launcher never splits a windowed problem (stream_k_plan): softcap, ALiBi and sinks leave every
  // tile's key range at 0 .. n-1, so the split part's units are those of the dense kernel.
  // One call site of item (the tile body is inlined once).
  template <class Item>
  __device__ void walk(Item&& item) {
    if constexpr (!T::kStreamK) {
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        set_tile(t);
        if (tile_outside()) continue;
        item(kWholeTile);
      }
    } else {
      const bool split = p.stream_k;
      const int b = blockIdx.x;
      const int whole_end = split ? p.stream_k_tile0 : total_tiles;
      const int n_whole = b < whole_end ? (whole_end - b + gridDim.x - 1) / gridDim.x : 0;
      int n_items = n_whole;
      int n = 0, u0 = 0, u1 = 0;  // the split part's key tiles per tile and this CTA's run [u0, u1)
      if (split) {
        n = num_key_tiles<T>(p, 0);
        const int units = (total_tiles - p.stream_k_tile0) * n;  // < 2^31 (launcher)
        const int per = units / gridDim.x, extra = units - per * gridDim.x;
        u0 = b * per + min(b, extra);
        u1 = u0 + per + (b < extra ? 1 : 0);
        n_items += (u1 - 1) / n - u0 / n + 1;
      }
      for (int i = 0; i < n_items; ++i) {
        int role = kWholeTile;
        if (i < n_whole) {
          set_tile(b + i * gridDim.x);
          if (tile_outside()) continue;  // packed: never split (the launcher)
        } else {
          const int tt = (u1 - 1) / n - (i - n_whole);  // from the run's last tile down
          set_tile(p.stream_k_tile0 + tt);
          const int kb = max(u0 - tt * n, 0), ke = min(u1 - tt * n, n);
          key_tile0 = kb;
          n_tiles = ke - kb;
          role = ke < n ? kPartOut : kb > 0 ? kPartIn : kWholeTile;
        }
        item(role);
      }
    }
  }

  // One tile per CTA. Plain grid (q tiles reversed, Hq, B): highest query tiles first (under causal
  // masking they see the most keys). Split last wave (T::kSplitTail and p.stream_k, non-causal): a 1-D
  // grid, CTA b < stream_k_tile0 runs tile b whole (the plain order, set_tile), the CTAs after it run
  // the pieces of the tiles from stream_k_tile0 on: piece i of k = split_pieces holds key tiles
  // [i n / k, (i + 1) n / k) of the tile's n (never for a windowed problem: split_tail_plan; its tiles
  // start at key tile 0). Launched in clusters of two (multicast), a cluster runs
  // the same piece of two adjacent tiles (one head: the tile count per head is even), so both CTAs
  // walk the same key tiles; stream_k_tile0 is even then and b % 2 is the CTA's rank.
  // (piece, split tile index) of a piece CTA, decoded again where needed rather than kept live
  // through the main loop (the B_c = 192 and d256 kernels have no register to spare).
  // multicast: launched as clusters of two (T::kMulticast).
  __device__ void piece_of_cta(int& piece, int& split_tile, bool multicast) const {
    const int pair = multicast ? 2 : 1;
    const int e = static_cast<int>(blockIdx.x) - p.stream_k_tile0;
    const int group = e / pair;  // (split tile or pair of them, piece)
    piece = group % p.split_pieces;
    split_tile = (group / p.split_pieces) * pair + (e - group * pair);
  }
  __device__ bool is_piece_cta() const {
    return T::kSplitTail && p.stream_k && static_cast<int>(blockIdx.x) >= p.stream_k_tile0;
  }

  // One tile per CTA: this CTA's tile (or piece of one).
  __device__ __forceinline__ void set_cta_tile(bool multicast) {
    if (T::kSplitTail && p.stream_k) {
      if (!is_piece_cta()) {
        set_tile(blockIdx.x);
      } else {
        int piece, split_tile;
        piece_of_cta(piece, split_tile, multicast);
        set_tile(p.stream_k_tile0 + split_tile);
        const int n = n_tiles;  // >= split_pieces (launcher)
        key_tile0 = piece * n / p.split_pieces;
        n_tiles = (piece + 1) * n / p.split_pieces - key_tile0;
      }
    } else {
      q_tile = gridDim.x - 1 - blockIdx.x;
      head = blockIdx.y;
      batch = blockIdx.z;
      set_sequence_and_keys();
    }
  }
};

}  // namespace sm90
}  // namespace flashop
