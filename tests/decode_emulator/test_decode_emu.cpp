// CPU emulation of the split-KV decode kernels (csrc/cuda/decode/decode_kernel.cuh built with
// FLASHOP_BWD_EMULATE against csrc/cuda/sm80/bwd_emulate.cuh): every thread of a block runs as a fiber, the
// mma, ldmatrix and cp.async instructions are emulated from their PTX definitions, and out and lse are
// compared with a float64 reference. Run by tests/test_decode_emulator.py:
//   test_decode_emu <lazy|eager> <rr|serial|reverse|random>
// Inputs hold NaN in the columns past the head dimension and the outputs a sentinel there: a read past
// headdim poisons the result, a write past it changes the sentinel, and every cp.async source (zero fills
// included) is checked to lie inside a row's first headdim columns of K or V.
#define FLASHOP_BWD_EMULATE 1
#include "decode/decode_kernel.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace flashop;

template <typename T> float to_f(T x);
template <> float to_f<__half>(__half x) { return __half2float(x); }
template <> float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> T from_f(float x);
template <> __half from_f<__half>(float x) { return __float2half(x); }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// One call: `lens` the sequences' key_end (cache_seqlens + new), `leftpad` their key_begin (empty: none),
// page_size 0 for a contiguous cache, batch_idx: cache rows through cache_batch_idx (contiguous only).
struct Case {
  int hd, Sq, Hq, Hk, capacity;
  std::vector<int> lens, leftpad;
  int page_size = 0;
  bool batch_idx = false;
  int splits = 1;
  int wl = -1, wr = -1;  // normalised window (causal: -1, 0)
  float softcap = 0.f;
  bool alibi = false, sinks = false;
};

template <typename T, int W>
bool run_case(const Case& c, unsigned seed) {
  const int B = int(c.lens.size()), D = c.hd, Dp = D + 8, ratio = c.Hq / c.Hk;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const float nan = NAN;
  const T sentinel = from_f<T>(-12345.f);
  // Caches: contiguous (rows, capacity, Hk, Dp), rows = B (+1 with batch_idx, shuffled), or pages
  // (num_blocks, page_size, Hk, Dp) with a shuffled block table and one spare page.
  const bool paged = c.page_size > 0;
  const int pages_per_seq = paged ? (c.capacity + c.page_size - 1) / c.page_size : 0;
  const int num_blocks = paged ? B * pages_per_seq + 1 : B + (c.batch_idx ? 1 : 0);
  const int rows_per_block = paged ? c.page_size : c.capacity;
  std::vector<T> kc(size_t(num_blocks) * rows_per_block * c.Hk * Dp, from_f<T>(nan)), vc = kc;
  for (size_t i = 0; i < kc.size(); ++i) {
    if (int(i % Dp) < D) { kc[i] = from_f<T>(nd(rng)); vc[i] = from_f<T>(nd(rng)); }
  }
  std::vector<int> table(size_t(B) * (pages_per_seq + 1), 1 << 30);  // the extra column: stale, never used
  std::vector<int> batch_row(B);
  std::vector<int> order(num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int b = 0; b < B; ++b) {
    if (paged) for (int j = 0; j < pages_per_seq; ++j) table[size_t(b) * (pages_per_seq + 1) + j] = order[b * pages_per_seq + j];
    batch_row[b] = c.batch_idx ? order[b] : b;
  }
  const int64_t stride_block = int64_t(rows_per_block) * c.Hk * Dp, stride_row = int64_t(c.Hk) * Dp;
  auto at = [&](int b, int pos, int h) {  // element index of (sequence b, position pos, kv head h)
    if (paged) return int64_t(table[size_t(b) * (pages_per_seq + 1) + pos / c.page_size]) * stride_block +
                      int64_t(pos % c.page_size) * stride_row + int64_t(h) * Dp;
    return int64_t(batch_row[b]) * stride_block + int64_t(pos) * stride_row + int64_t(h) * Dp;
  };
  std::vector<T> q(size_t(B) * c.Sq * c.Hq * Dp, from_f<T>(nan));
  for (size_t i = 0; i < q.size(); ++i) if (int(i % Dp) < D) q[i] = from_f<T>(nd(rng));
  std::vector<T> out(q.size(), sentinel);
  std::vector<float> lse(size_t(B) * c.Hq * c.Sq, nan), slopes(size_t(B) * c.Hq), sinks(c.Hq);
  for (auto& x : slopes) x = 0.05f + 0.3f * std::fabs(nd(rng));
  for (auto& x : sinks) x = 2.f * nd(rng);
  std::vector<int> key_end(c.lens), key_begin(c.leftpad.empty() ? std::vector<int>(B, 0) : c.leftpad);

  DecodeParams p{};
  p.q = q.data();
  p.out = out.data();
  p.q_batch_stride = int64_t(c.Sq) * c.Hq * Dp, p.q_row_stride = int64_t(c.Hq) * Dp, p.q_head_stride = Dp;
  p.o_batch_stride = p.q_batch_stride, p.o_row_stride = p.q_row_stride, p.o_head_stride = Dp;
  p.lse = lse.data();
  p.k = kc.data();
  p.v = vc.data();
  p.k_batch_stride = p.v_batch_stride = stride_block;
  p.k_row_stride = p.v_row_stride = stride_row;
  p.k_head_stride = p.v_head_stride = Dp;
  p.cache_batch_idx = c.batch_idx ? batch_row.data() : nullptr;
  p.block_table = paged ? table.data() : nullptr;
  p.block_table_stride = pages_per_seq + 1;
  p.page_size = rows_per_block;
  p.num_blocks = num_blocks;
  p.capacity = paged ? pages_per_seq * c.page_size : c.capacity;
  p.key_begin = c.leftpad.empty() ? nullptr : key_begin.data();
  // The kernel reads key_end[b] + key_end_offset (cache_seqlens and seqlen_new): split the ends so.
  p.key_end_offset = int(seed % 3);
  for (int& end : key_end) end -= p.key_end_offset;
  p.key_end = key_end.data();
  p.batch = B, p.seqlen_q = c.Sq, p.heads_q = c.Hq, p.heads_k = c.Hk, p.head_ratio = ratio, p.headdim = D;
  p.scale = float(1.0 / std::sqrt(double(D)));
  p.variants.window_left = c.wl;
  p.variants.window_right = c.wr;
  p.variants.softcap = c.softcap;
  p.variants.alibi_slopes = c.alibi ? slopes.data() : nullptr;
  p.variants.alibi_batch_stride = c.Hq;
  p.variants.sinks = c.sinks ? sinks.data() : nullptr;
  p.num_splits = c.splits;
  const int64_t rows_total = int64_t(B) * c.Hq * c.Sq;
  std::vector<float> partial_out(size_t(c.splits) * rows_total * W, nan), partial_lse(size_t(c.splits) * rows_total, nan);
  p.partial_out = c.splits > 1 ? partial_out.data() : nullptr;
  p.partial_lse = c.splits > 1 ? partial_lse.data() : nullptr;

  bool bad_read = false;
  emu::state().check_global_read = [&](const void* src) {
    for (const std::vector<T>* t : {&kc, &vc}) {
      const T* e = static_cast<const T*>(src);
      if (e >= t->data() && e < t->data() + t->size() && int((e - t->data()) % Dp) + 8 <= D) return;
    }
    bad_read = true;
  };
  emu::launch(emu::Dim3{unsigned(c.splits), unsigned(c.Hk), unsigned(B)}, decode::kThreads,
              decode::DecodeSmem<W>::kBytes, [&] { decode::decode_kernel<T, W>(p); });
  if (c.splits > 1)
    emu::launch(emu::Dim3{unsigned(rows_total)}, decode::kThreads, decode::kCombineSmemBytes,
                [&] { decode::combine_kernel<T, W>(p); });
  emu::state().check_global_read = nullptr;

  // The reference: sequence b's query i (head h) sees relative key j in [0, n) iff the window holds,
  // bottom-right aligned (diag = n - Sq).
  double max_err = 0, max_lse_err = 0;
  bool bad = bad_read, bad_write = false;
  for (int b = 0; b < B; ++b) {
    const int end = std::min(std::max(key_end[b] + p.key_end_offset, 0), p.capacity), begin = std::min(std::max(key_begin[b], 0), end);
    const int n = end - begin, diag = n - c.Sq;
    for (int h = 0; h < c.Hq; ++h) {
      for (int i = 0; i < c.Sq; ++i) {
        const T* qr = &q[((size_t(b) * c.Sq + i) * c.Hq + h) * Dp];
        std::vector<double> s(n, -INFINITY);
        double top = c.sinks ? double(sinks[h]) : -INFINITY;
        for (int j = 0; j < n; ++j) {
          if ((c.wl >= 0 && j < i + diag - c.wl) || (c.wr >= 0 && j > i + diag + c.wr)) continue;
          double dot = 0;
          const int64_t kr = at(b, begin + j, h / ratio);
          for (int d = 0; d < D; ++d) dot += double(to_f(qr[d])) * to_f(kc[kr + d]);
          double sc = dot * p.scale;
          if (c.softcap > 0) sc = c.softcap * std::tanh(sc / c.softcap);
          if (c.alibi) sc -= double(slopes[size_t(b) * c.Hq + h]) * std::fabs(double(i + diag - j));
          s[j] = sc;
          top = std::max(top, sc);
        }
        double sum = 0;
        for (int j = 0; j < n; ++j) sum += std::exp(s[j] - top);
        if (c.sinks) sum += std::exp(double(sinks[h]) - top);
        const bool any_key = std::any_of(s.begin(), s.end(), [](double x) { return x != -INFINITY; });
        const double ref_lse_keys = top + std::log(sum);
        const double ref_lse = any_key || c.sinks ? ref_lse_keys : -INFINITY;
        const float got_lse = lse[(size_t(b) * c.Hq + h) * c.Sq + i];
        if (std::isinf(ref_lse) ? got_lse != float(ref_lse) : !(std::fabs(got_lse - ref_lse) <= 1e-2 * (1 + std::fabs(ref_lse))))
          bad = true, printf("  lse b=%d h=%d i=%d: got %g, want %g  <-- FAIL\n", b, h, i, got_lse, ref_lse);
        max_lse_err = std::max(max_lse_err, std::isinf(ref_lse) ? 0.0 : std::fabs(got_lse - ref_lse));
        const T* orow = &out[((size_t(b) * c.Sq + i) * c.Hq + h) * Dp];
        for (int d = 0; d < D; ++d) {
          double ref = 0;
          if (any_key) for (int j = 0; j < n; ++j) ref += std::exp(s[j] - ref_lse_keys) * to_f(vc[at(b, begin + j, h / ratio) + d]);
          const double got = to_f(orow[d]);
          if (!std::isfinite(got)) bad = true;
          max_err = std::max(max_err, std::fabs(got - ref) / (1 + std::fabs(ref)));
        }
        for (int d = D; d < Dp; ++d) bad_write |= std::memcmp(&orow[d], &sentinel, sizeof(T)) != 0;
      }
    }
  }
  const bool ok = !bad && !bad_write && max_err < 2e-2;
  printf("  W=%d hd=%d Sq=%d Hq=%d Hk=%d B=%d paged=%d splits=%d window=(%d,%d) softcap=%g alibi=%d sinks=%d: max relative err %.2e, "
         "lse %.2e%s%s %s\n", W, D, c.Sq, c.Hq, c.Hk, B, c.page_size, c.splits, c.wl, c.wr, c.softcap, c.alibi, c.sinks,
         max_err, max_lse_err, bad_read ? " [cp.async source outside the rows]" : "", bad_write ? " [write past headdim]" : "",
         ok ? "ok" : "<-- FAIL");
  return ok;
}

template <typename T, int W>
bool run_width(unsigned& seed) {
  bool ok = true;
  const int hd_small = W == 64 ? 40 : (W == 128 ? 72 : 200);  // a head dimension below the tile width
  // Sequences: empty, one key, a partial block, several blocks with a tail; leftpad cutting blocks.
  const std::vector<int> lens = {0, 1, 77, 300};
  const std::vector<Case> cases = {
      {W, 1, 4, 1, 300, lens},                                          // GQA 4, one token
      {hd_small, 1, 8, 1, 300, lens, {0, 1, 5, 130}, 0, false, 3},     // 8 rows, leftpad, splits
      {W, 3, 4, 2, 300, lens, {}, 16, false, 4, -1, 0},                // 6 rows, causal, pages of 16
      {hd_small, 2, 2, 2, 300, lens, {}, 64, false, 2, 40, 0, 30.f, true, true},  // window, softcap, ALiBi, sinks
      {W, 1, 1, 1, 300, lens, {0, 0, 3, 64}, 0, true, 7, -1, -1, 0.f, false, true},  // batch_idx, splits past the blocks
  };
  for (const Case& c : cases) ok &= run_case<T, W>(c, seed++);
  return ok;
}

int main(int argc, char** argv) {
  const bool eager = argc > 1 && std::string(argv[1]) == "eager";
  const std::string sched = argc > 2 ? argv[2] : "rr";
  emu::state().opt.eager_cp_async = eager;
  emu::state().opt.schedule = sched == "serial"    ? emu::Schedule::kWarpSerial
                              : sched == "reverse" ? emu::Schedule::kWarpReverse
                              : sched == "random"  ? emu::Schedule::kRandomWarps
                                                   : emu::Schedule::kRoundRobin;
  unsigned seed = 1;
  bool ok = true;
  ok &= run_width<__nv_bfloat16, 64>(seed);
  ok &= run_width<__half, 128>(seed);
  ok &= run_width<__nv_bfloat16, 128>(seed);
  ok &= run_width<__nv_bfloat16, 256>(seed);
  printf(ok ? "ALL OK\n" : "SOME FAILED\n");
  return ok ? 0 : 1;
}
