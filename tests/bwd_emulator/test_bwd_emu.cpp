// CPU emulation of the flashop backward kernels (csrc/cuda/sm80/bwd_kernel.cuh built with
// FLASHOP_BWD_EMULATE against bwd_emulate.cuh): every thread of a block runs as a fiber, the mma,
// ldmatrix and cp.async instructions are emulated from their PTX definitions, and dQ/dK/dV are
// compared with a float64 reference. Run by tests/test_bwd_emulator.py:
//   test_bwd_emu <config|all> <lazy|eager> <rr|serial|reverse|random> [- <edge|full> [packed]]
// lazy/eager: cp.async lands at its wait / at issue; serial/reverse: one warp runs ahead until a
// barrier stops it, which exposes a missing __syncthreads.
#define FLASHOP_BWD_EMULATE 1
#define FLASHOP_BWD_LPT_MIN_KEY_TILES 1  // lpt groups on problems of a few key tiles
#include "sm80/bwd_kernel.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace flashop;

template <typename Elem> float to_f(Elem x);
template <> float to_f<__half>(__half x) { return __half2float(x); }
template <> float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename Elem> Elem from_f(float x);
template <> __half from_f<__half>(float x) { return __float2half(x); }
template <> __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// hd: the true head dimension (0: the tile width D), a multiple of 8 <= D. Inputs are laid out
// (B, S, H, hd + head_pad) with the head_pad columns NaN, outputs (B, S, H, hd + 8) with the last 8
// columns a sentinel: a read past hd poisons the gradients, a write past it changes the sentinel, and
// every cp.async source (zero fills included) is checked to lie inside a row's first hd columns.
// Variants (csrc/attention_variants.h), normalised as the ops pass them: causal is causal = true with
// window (-1, 0); a general window has causal = false. alibi: 0 none, 1 slopes (Hq,), 2 slopes (B, Hq).
// sinks: the reference forward's lse includes them (the backward kernels take them through lse only).
struct Variant { int wl = -1, wr = -1; float softcap = 0.f; int alibi = 0; bool sinks = false; };
struct Problem { int B, Sq, Sk, Hq, Hk; bool causal; bool det; int head_pad; float scale_mul; int hd = 0; Variant var = {}; };
Problem with(Problem p, Variant v) { p.var = v; return p; }

template <class Cfg>
bool run_case(const Problem& pr, unsigned seed, bool verbose = true) {
  using Elem = typename sm80::bwd::ElemOf<Cfg::kDType>::type;
  constexpr int W = Cfg::kHeadDim;  // tile width
  const int D = pr.hd > 0 ? pr.hd : W;  // true head dimension
  const int B = pr.B, Sq = pr.Sq, Sk = pr.Sk, Hq = pr.Hq, Hk = pr.Hk, ratio = Hq / Hk;
  const double scale = pr.scale_mul / std::sqrt(double(D));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Layout (B, S, H, Dp): head stride Dp >= D (multiple of 8) to test strides.
  const int Dp = D + pr.head_pad;
  auto alloc = [&](int S, int H) { return std::vector<Elem>(size_t(B) * S * H * Dp + 64, from_f<Elem>(NAN)); };
  auto idx = [&](int S, int H, int b, int s, int h, int d) { return ((size_t(b) * S + s) * H + h) * Dp + d; };
  std::vector<Elem> q = alloc(Sq, Hq), k = alloc(Sk, Hk), v = alloc(Sk, Hk), o = alloc(Sq, Hq), dout = alloc(Sq, Hq);
  for (int b = 0; b < B; ++b) for (int s = 0; s < Sq; ++s) for (int h = 0; h < Hq; ++h) for (int d = 0; d < D; ++d) {
    q[idx(Sq, Hq, b, s, h, d)] = from_f<Elem>(nd(rng)); dout[idx(Sq, Hq, b, s, h, d)] = from_f<Elem>(nd(rng)); }
  for (int b = 0; b < B; ++b) for (int s = 0; s < Sk; ++s) for (int h = 0; h < Hk; ++h) for (int d = 0; d < D; ++d) {
    k[idx(Sk, Hk, b, s, h, d)] = from_f<Elem>(nd(rng)); v[idx(Sk, Hk, b, s, h, d)] = from_f<Elem>(nd(rng)); }
  std::vector<float> lse(size_t(B) * Hq * Sq);
  const Variant& var = pr.var;
  std::vector<float> slopes(size_t(B) * Hq), sinks(Hq);
  for (auto& x : slopes) x = 0.05f + 0.5f * std::fabs(nd(rng));
  for (auto& x : sinks) x = 2.f * nd(rng);
  // The contract, written out (csrc/attention_variants.h): query i sees key j iff both window bounds
  // (and causal) hold, with off = Sk - Sq.
  auto visible = [&](int i, int j) {
    const long off = long(Sk) - Sq;
    if (pr.causal && j > i + off) return false;
    if (var.wl >= 0 && j < i + off - var.wl) return false;
    if (var.wr >= 0 && j > i + off + var.wr) return false;
    return true;
  };
  // reference forward + backward in double
  std::vector<double> rdq(size_t(B) * Sq * Hq * D, 0), rdk(size_t(B) * Sk * Hk * D, 0), rdv(size_t(B) * Sk * Hk * D, 0);
  const int diag = Sk - Sq;
  std::vector<double> P(size_t(Sq) * Sk), dP(size_t(Sq) * Sk), dcap(size_t(Sq) * Sk, 1.0);
  for (int b = 0; b < B; ++b) for (int h = 0; h < Hq; ++h) {
    const int hk = h / ratio;
    for (int i = 0; i < Sq; ++i) {
      double mx = -INFINITY;
      for (int j = 0; j < Sk; ++j) {
        double sc = 0; for (int d = 0; d < D; ++d) sc += double(to_f(q[idx(Sq, Hq, b, i, h, d)])) * to_f(k[idx(Sk, Hk, b, j, hk, d)]);
        sc *= scale;
        if (var.softcap > 0) {  // d(capped)/d(scale q.k) = 1 - tanh^2
          const double th = std::tanh(sc / var.softcap);
          sc = var.softcap * th;
          dcap[size_t(i) * Sk + j] = 1.0 - th * th;
        }
        if (var.alibi) sc -= double(slopes[(var.alibi == 2 ? b * Hq : 0) + h]) * std::fabs(double(i + diag - j));
        if (!visible(i, j)) sc = -INFINITY;
        P[size_t(i) * Sk + j] = sc; mx = std::max(mx, sc);
      }
      double l = 0;
      const double sink = var.sinks ? double(sinks[h]) : -INFINITY;
      if (mx == -INFINITY) {
        for (int j = 0; j < Sk; ++j) P[size_t(i) * Sk + j] = 0;
        lse[(size_t(b) * Hq + h) * Sq + i] = float(sink);
      } else {
        const double top = std::max(mx, sink);
        for (int j = 0; j < Sk; ++j) l += std::exp(P[size_t(i) * Sk + j] - top);
        if (var.sinks) l += std::exp(sink - top);
        const double L = top + std::log(l);
        lse[(size_t(b) * Hq + h) * Sq + i] = float(L);
        for (int j = 0; j < Sk; ++j) P[size_t(i) * Sk + j] = std::exp(P[size_t(i) * Sk + j] - L);
      }
      for (int d = 0; d < D; ++d) { double acc = 0; for (int j = 0; j < Sk; ++j) acc += P[size_t(i) * Sk + j] * to_f(v[idx(Sk, Hk, b, j, hk, d)]); o[idx(Sq, Hq, b, i, h, d)] = from_f<Elem>(float(acc)); }
    }
    for (int i = 0; i < Sq; ++i) {
      double Di = 0; for (int d = 0; d < D; ++d) Di += double(to_f(dout[idx(Sq, Hq, b, i, h, d)])) * to_f(o[idx(Sq, Hq, b, i, h, d)]);
      for (int j = 0; j < Sk; ++j) {
        double dp = 0; for (int d = 0; d < D; ++d) dp += double(to_f(dout[idx(Sq, Hq, b, i, h, d)])) * to_f(v[idx(Sk, Hk, b, j, hk, d)]);
        dP[size_t(i) * Sk + j] = P[size_t(i) * Sk + j] * (dp - Di) * dcap[size_t(i) * Sk + j];  // dS / scale
      }
    }
    for (int i = 0; i < Sq; ++i) for (int d = 0; d < D; ++d) { double acc = 0; for (int j = 0; j < Sk; ++j) acc += dP[size_t(i) * Sk + j] * to_f(k[idx(Sk, Hk, b, j, hk, d)]); rdq[((size_t(b) * Sq + i) * Hq + h) * D + d] = acc * scale; }
    for (int j = 0; j < Sk; ++j) for (int d = 0; d < D; ++d) {
      double ak = 0, av = 0;
      for (int i = 0; i < Sq; ++i) { ak += dP[size_t(i) * Sk + j] * to_f(q[idx(Sq, Hq, b, i, h, d)]); av += P[size_t(i) * Sk + j] * to_f(dout[idx(Sq, Hq, b, i, h, d)]); }
      rdk[((size_t(b) * Sk + j) * Hk + hk) * D + d] += ak * scale; rdv[((size_t(b) * Sk + j) * Hk + hk) * D + d] += av;
    }
  }
  // kernel; outputs (B, S, H, Do) with columns [D, Do) a sentinel nothing may overwrite
  const int Do = D + 8;
  uint16_t sentinel_bits = 0x7fa5;  // a NaN no computation produces
  Elem sentinel;
  std::memcpy(&sentinel, &sentinel_bits, 2);
  // (+ W sentinel elements at the end: a full-width store to the last row lands there.)
  auto out_alloc = [&](int S, int H) {
    const size_t n = size_t(B) * S * H * Do;
    std::vector<Elem> t(n + W, from_f<Elem>(NAN));
    for (size_t i = 0; i < t.size(); ++i) if (i >= n || int(i % Do) >= D) t[i] = sentinel;
    return t;
  };
  std::vector<Elem> dq = out_alloc(Sq, Hq), dk = out_alloc(Sk, Hk), dv = out_alloc(Sk, Hk);
  // dq_accum rows are as wide as the tile (bwd_params.h).
  const BwdWorkspaceSizes ws = bwd_workspace_sizes(B, Hq, Sq, W, Cfg::kBlockM, pr.det);
  std::vector<float> dq_accum(ws.dq_accum, NAN), dsum(ws.dsum, NAN), lse2(ws.lse_log2, NAN);
  std::vector<int> sem(ws.dq_semaphore + 1, 12345);
  BwdParams p{};
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = o.data(); p.dout = dout.data(); p.lse = lse.data();
  p.dq = dq.data(); p.dk = dk.data(); p.dv = dv.data();
  p.dq_accum = dq_accum.data(); p.dsum = dsum.data(); p.lse_log2 = lse2.data(); p.dq_semaphore = pr.det ? sem.data() : nullptr;
  p.q_batch_stride = int64_t(Sq) * Hq * Dp; p.q_row_stride = int64_t(Hq) * Dp; p.q_head_stride = Dp;
  p.k_batch_stride = int64_t(Sk) * Hk * Dp; p.k_row_stride = int64_t(Hk) * Dp; p.k_head_stride = Dp;
  p.v_batch_stride = p.k_batch_stride; p.v_row_stride = p.k_row_stride; p.v_head_stride = Dp;
  p.o_batch_stride = p.q_batch_stride; p.o_row_stride = p.q_row_stride; p.o_head_stride = Dp;
  p.do_batch_stride = p.q_batch_stride; p.do_row_stride = p.q_row_stride; p.do_head_stride = Dp;
  p.dq_batch_stride = int64_t(Sq) * Hq * Do; p.dq_row_stride = int64_t(Hq) * Do; p.dq_head_stride = Do;
  p.dk_batch_stride = int64_t(Sk) * Hk * Do; p.dk_row_stride = int64_t(Hk) * Do; p.dk_head_stride = Do;
  p.dv_batch_stride = p.dk_batch_stride; p.dv_row_stride = p.dk_row_stride; p.dv_head_stride = Do;
  p.lse_batch_stride = int64_t(Hq) * Sq; p.lse_head_stride = Sq;
  p.batch = B; p.seqlen_q = Sq; p.seqlen_k = Sk; p.seqlen_q_rounded = ws.seqlen_q_rounded; p.heads_q = Hq; p.heads_k = Hk;
  p.head_ratio = ratio; p.headdim = D; p.num_m_blocks = ws.num_m_blocks;
  p.sm_count = 9;  // lpt: ceil(9 / key tiles) pairs per group, several groups, the last partial
  // ... and, deterministic, an L2 that holds 3 pairs' rows: groups of 3 (the L2 cap)
  p.l2_bytes = pr.det ? 3 * int64_t(ws.seqlen_q_rounded) * W * ratio * 8 : int64_t(1) << 30;
  p.scale = float(scale); p.scale_log2 = float(scale * 1.4426950408889634); p.causal = pr.causal; p.deterministic = pr.det;
  p.variants.window_left = var.wl;
  p.variants.window_right = pr.causal ? 0 : var.wr;
  p.variants.softcap = var.softcap;
  p.variants.alibi_slopes = var.alibi ? slopes.data() : nullptr;
  p.variants.alibi_batch_stride = var.alibi == 2 ? Hq : 0;
  p.variants.sinks = var.sinks ? sinks.data() : nullptr;  // unused by the backward
  // cp.async sources: inside q, k, v, dout (a row's first D columns) or the lse/D workspaces.
  bool bad_read = false;
  emu::state().check_global_read = [&](const void* src) {
    auto in_rows = [&](const std::vector<Elem>& t, int S, int H) {
      const Elem* e = static_cast<const Elem*>(src);
      if (e < t.data() || e >= t.data() + size_t(B) * S * H * Dp) return false;
      return int((e - t.data()) % Dp) + 8 <= D;
    };
    auto in_ws = [&](const std::vector<float>& t) {
      const float* f = static_cast<const float*>(src);
      return f >= t.data() && f + 4 <= t.data() + t.size();
    };
    if (!(in_rows(q, Sq, Hq) || in_rows(dout, Sq, Hq) || in_rows(k, Sk, Hk) || in_rows(v, Sk, Hk) || in_ws(lse2) ||
          in_ws(dsum))) {
      if (!bad_read) printf("  cp.async source outside the rows' first %d columns  <-- FAIL\n", D);
      bad_read = true;
    }
  };
  const bool accepted = sm80::bwd::emulate_bwd<Cfg>(p);
  emu::state().check_global_read = nullptr;
  if (!accepted) { printf("params rejected\n"); return false; }
  // Compacted (B, S, H, D) views of the outputs; the sentinel columns must be intact.
  bool bad_write = false;
  auto compact = [&](const std::vector<Elem>& t) {
    const size_t rows = (t.size() - W) / Do;
    std::vector<Elem> c(rows * D);
    for (size_t r = 0; r < rows; ++r) {
      for (int d = 0; d < D; ++d) c[r * D + d] = t[r * Do + d];
      for (int d = D; d < Do; ++d) bad_write |= std::memcmp(&t[r * Do + d], &sentinel, 2) != 0;
    }
    for (size_t i = rows * Do; i < t.size(); ++i) bad_write |= std::memcmp(&t[i], &sentinel, 2) != 0;
    return c;
  };
  auto cmp = [&](const char* name, const std::vector<Elem>& got_padded, const std::vector<double>& ref) {
    const std::vector<Elem> got = compact(got_padded);
    double maxerr = 0, maxref = 0; size_t worst = 0; bool nan = false;
    for (size_t i = 0; i < ref.size(); ++i) { const double gv = to_f(got[i]); if (!std::isfinite(gv)) { nan = true; worst = i; break; }
      const double e = std::fabs(gv - ref[i]); if (e > maxerr) { maxerr = e; worst = i; } maxref = std::max(maxref, std::fabs(ref[i])); }
    const double rel = maxerr / std::max(maxref, 1e-3);
    const bool ok = !nan && rel < 2e-2;
    if (verbose || !ok) printf("  %s: max|err| %.3e max|ref| %.3e rel %.2e%s%s (worst idx %zu got %f ref %f)\n", name, maxerr, maxref, rel, nan ? " NaN!" : "", ok ? "" : "  <-- FAIL", worst, double(to_f(got[worst])), ref[worst]);
    return ok;
  };
  bool ok = true;
  ok &= cmp("dq", dq, rdq); ok &= cmp("dk", dk, rdk); ok &= cmp("dv", dv, rdv);
  if (bad_write) printf("  a store past the head dimension overwrote the sentinel  <-- FAIL\n");
  return ok && !bad_read && !bad_write;
}

// A packed batch (csrc/packed_sequences.h): q (total_q, Hq, D), k/v (total_k, Hk, D), sequence b rows
// cu[b] .. cu[b + 1], of which the first used[b] take part; the other rows get zero gradients. Outputs
// are NaN-filled first, so a row the kernels fail to write fails the comparison. The reference runs
// each sequence on its used rows (causal / windows bottom-right within it, ALiBi (B, Hq) row b).
struct PackedProblem { std::vector<int> lq, lk, uq, uk; int Hq, Hk; bool causal, det; Variant var = {}; };
template <class Cfg>
bool run_packed_case(const PackedProblem& pr, unsigned seed) {
  using Elem = typename sm80::bwd::ElemOf<Cfg::kDType>::type;
  constexpr int D = Cfg::kHeadDim;
  const int B = int(pr.lq.size()), Hq = pr.Hq, Hk = pr.Hk, ratio = Hq / Hk;
  std::vector<int> cq(B + 1, 0), ck(B + 1, 0);
  for (int b = 0; b < B; ++b) cq[b + 1] = cq[b] + pr.lq[b], ck[b + 1] = ck[b] + pr.lk[b];
  const int Tq = cq[B], Tk = ck[B];
  int max_q = 0, max_k = 0;
  for (int b = 0; b < B; ++b) max_q = std::max(max_q, pr.lq[b]), max_k = std::max(max_k, pr.lk[b]);
  const double scale = 1.0 / std::sqrt(double(D));
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto randn = [&](int rows, int H) { std::vector<Elem> t(size_t(rows) * H * D + 8); for (auto& x : t) x = from_f<Elem>(nd(rng)); return t; };
  std::vector<Elem> q = randn(Tq, Hq), k = randn(Tk, Hk), v = randn(Tk, Hk), o(size_t(Tq) * Hq * D + 8), dout = randn(Tq, Hq);
  std::vector<float> slopes(size_t(B) * Hq), sinks(Hq), lse(size_t(Hq) * Tq + 8, -INFINITY);
  for (auto& x : slopes) x = 0.05f + 0.5f * std::fabs(nd(rng));
  for (auto& x : sinks) x = 2.f * nd(rng);
  const Variant& var = pr.var;
  std::vector<double> rdq(size_t(Tq) * Hq * D, 0), rdk(size_t(Tk) * Hk * D, 0), rdv(size_t(Tk) * Hk * D, 0);
  auto at = [&](const std::vector<Elem>& t, int H, int row, int h, int d) { return double(to_f(t[(size_t(row) * H + h) * D + d])); };
  for (int b = 0; b < B; ++b) {
    const int q0 = cq[b], k0 = ck[b], Sq = pr.uq[b], Sk = pr.uk[b], diag = Sk - Sq;
    std::vector<double> P(size_t(Sq) * Sk), dS(size_t(Sq) * Sk), dcap(size_t(Sq) * Sk, 1.0);
    for (int h = 0; h < Hq; ++h) {
      const int hk = h / ratio;
      for (int i = 0; i < Sq; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < Sk; ++j) {
          double sc = 0; for (int d = 0; d < D; ++d) sc += at(q, Hq, q0 + i, h, d) * at(k, Hk, k0 + j, hk, d);
          sc *= scale;
          if (var.softcap > 0) { const double th = std::tanh(sc / var.softcap); sc = var.softcap * th; dcap[size_t(i) * Sk + j] = 1.0 - th * th; }
          if (var.alibi) sc -= double(slopes[(var.alibi == 2 ? b * Hq : 0) + h]) * std::fabs(double(i + diag - j));
          const bool vis = !(pr.causal && j > i + diag) && !(var.wl >= 0 && j < i + diag - var.wl) && !(var.wr >= 0 && j > i + diag + var.wr);
          P[size_t(i) * Sk + j] = vis ? sc : -INFINITY; mx = std::max(mx, P[size_t(i) * Sk + j]);
        }
        const double sink = var.sinks ? double(sinks[h]) : -INFINITY;
        float& L = lse[size_t(h) * Tq + q0 + i];
        if (mx == -INFINITY) { for (int j = 0; j < Sk; ++j) P[size_t(i) * Sk + j] = 0; L = float(sink); }
        else {
          const double top = std::max(mx, sink); double l = var.sinks ? std::exp(sink - top) : 0;
          for (int j = 0; j < Sk; ++j) l += std::exp(P[size_t(i) * Sk + j] - top);
          L = float(top + std::log(l));
          for (int j = 0; j < Sk; ++j) P[size_t(i) * Sk + j] = std::exp(P[size_t(i) * Sk + j] - (top + std::log(l)));
        }
        for (int d = 0; d < D; ++d) { double a = 0; for (int j = 0; j < Sk; ++j) a += P[size_t(i) * Sk + j] * at(v, Hk, k0 + j, hk, d); o[(size_t(q0 + i) * Hq + h) * D + d] = from_f<Elem>(float(a)); }
      }
      for (int i = 0; i < Sq; ++i) {
        double Di = 0; for (int d = 0; d < D; ++d) Di += at(dout, Hq, q0 + i, h, d) * to_f(o[(size_t(q0 + i) * Hq + h) * D + d]);
        for (int j = 0; j < Sk; ++j) {
          double dp = 0; for (int d = 0; d < D; ++d) dp += at(dout, Hq, q0 + i, h, d) * at(v, Hk, k0 + j, hk, d);
          dS[size_t(i) * Sk + j] = P[size_t(i) * Sk + j] * (dp - Di) * dcap[size_t(i) * Sk + j];
        }
      }
      for (int i = 0; i < Sq; ++i) for (int d = 0; d < D; ++d) { double a = 0; for (int j = 0; j < Sk; ++j) a += dS[size_t(i) * Sk + j] * at(k, Hk, k0 + j, hk, d); rdq[(size_t(q0 + i) * Hq + h) * D + d] = a * scale; }
      for (int j = 0; j < Sk; ++j) for (int d = 0; d < D; ++d) {
        double ak = 0, av = 0;
        for (int i = 0; i < Sq; ++i) { ak += dS[size_t(i) * Sk + j] * at(q, Hq, q0 + i, h, d); av += P[size_t(i) * Sk + j] * at(dout, Hq, q0 + i, h, d); }
        rdk[(size_t(k0 + j) * Hk + hk) * D + d] += ak * scale; rdv[(size_t(k0 + j) * Hk + hk) * D + d] += av;
      }
    }
  }
  std::vector<Elem> dq(size_t(Tq) * Hq * D + 8, from_f<Elem>(NAN)), dk(size_t(Tk) * Hk * D + 8, from_f<Elem>(NAN)),
      dv(size_t(Tk) * Hk * D + 8, from_f<Elem>(NAN));
  const BwdWorkspaceSizes ws = bwd_workspace_sizes(B, Hq, max_q, D, Cfg::kBlockM, pr.det, Tq);
  std::vector<float> dq_accum(ws.dq_accum, NAN), dsum(ws.dsum, NAN), lse2(ws.lse_log2, NAN);
  std::vector<int> sem(ws.dq_semaphore + 1, 12345);
  std::vector<int32_t> cu_q(cq.begin(), cq.end()), cu_k(ck.begin(), ck.end()), used_q(pr.uq.begin(), pr.uq.end()),
      used_k(pr.uk.begin(), pr.uk.end());
  BwdParams p{};
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.out = o.data(); p.dout = dout.data(); p.lse = lse.data();
  p.dq = dq.data(); p.dk = dk.data(); p.dv = dv.data();
  p.dq_accum = dq_accum.data(); p.dsum = dsum.data(); p.lse_log2 = lse2.data(); p.dq_semaphore = pr.det ? sem.data() : nullptr;
  p.q_row_stride = p.o_row_stride = p.do_row_stride = p.dq_row_stride = int64_t(Hq) * D;
  p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = int64_t(Hk) * D;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = p.do_head_stride = D;
  p.dq_head_stride = p.dk_head_stride = p.dv_head_stride = D;
  p.lse_head_stride = Tq;  // batch strides 0
  p.batch = B; p.seqlen_q = max_q; p.seqlen_k = max_k; p.seqlen_q_rounded = ws.seqlen_q_rounded; p.heads_q = Hq; p.heads_k = Hk;
  p.head_ratio = ratio; p.headdim = D; p.num_m_blocks = ws.num_m_blocks; p.sm_count = 9; p.l2_bytes = int64_t(1) << 30;
  p.scale = float(scale); p.scale_log2 = float(scale * 1.4426950408889634); p.causal = pr.causal; p.deterministic = pr.det;
  p.variants.window_left = var.wl; p.variants.window_right = pr.causal ? 0 : var.wr; p.variants.softcap = var.softcap;
  p.variants.alibi_slopes = var.alibi ? slopes.data() : nullptr; p.variants.alibi_batch_stride = var.alibi == 2 ? Hq : 0;
  p.packed.cu_seqlens_q = cu_q.data(); p.packed.cu_seqlens_k = cu_k.data();
  p.packed.seqused_q = used_q.data(); p.packed.seqused_k = used_k.data(); p.packed.total_q = Tq; p.packed.total_k = Tk;
  if (!sm80::bwd::emulate_bwd<Cfg>(p)) { printf("params rejected\n"); return false; }
  bool ok = true;
  auto cmp = [&](const char* name, const std::vector<Elem>& got, const std::vector<double>& ref) {
    double maxerr = 0, maxref = 0; bool nan = false;
    for (size_t i = 0; i < ref.size(); ++i) { const double g = to_f(got[i]); if (!std::isfinite(g)) { nan = true; break; }
      maxerr = std::max(maxerr, std::fabs(g - ref[i])); maxref = std::max(maxref, std::fabs(ref[i])); }
    const double rel = maxerr / std::max(maxref, 1e-3);
    const bool good = !nan && rel < 2e-2;
    printf("  %s: max|err| %.3e max|ref| %.3e rel %.2e%s%s\n", name, maxerr, maxref, rel, nan ? " NaN!" : "", good ? "" : "  <-- FAIL");
    ok &= good;
  };
  cmp("dq", dq, rdq); cmp("dk", dk, rdk); cmp("dv", dv, rdv);
  return ok;
}

// Configs that run every variant case; the others (same code paths, other tiles and flags) run
// variant_short, to keep a mode of the test within its time limit.
bool all_variant_cases(const std::string& name) {
  for (const char* n : {"bf16.d64.br64.bc64.w4", "bf16.d128.br64.bc128.w8.k32", "bf16.d64.br128.bc128.w8.k32.dpe.dqe.pfs.hreg",
                        "bf16.d128.br64.bc128.w8.k32.dpe.dqe.pfs.hreg.qup", "fp16.d192.br64.bc64.w8.k32.q1.dpe.dqe",
                        "bf16.d160.br64.bc64.w8.dpe.dqe.pfs.hreg"})
    if (name == n) return true;
  return false;
}

template <class Cfg>
bool run_suite(const char* name, bool quick, bool packed_only) {
  printf("== %s (smem %zu, WarpsN %d WarpsD %d, dQ warps %dx%d)\n", name, Cfg::kSmemBytes, Cfg::kWarpsN, Cfg::kWarpsD, Cfg::kWarpsMdQ, Cfg::kWarpsDdQ);
  std::vector<Problem> cases = {
    {1, 100, 77, 2, 1, false, false, 8, 1.0f},
    {1, 77, 150, 2, 2, true, false, 0, 1.0f},
    {2, 150, 60, 3, 1, true, true, 0, 1.3f},
    {1, 64, 128, 1, 1, false, true, 0, 1.0f},
  };
  if (Cfg::kWalkUp) {  // several query and key tiles: the rotated and the diagonal-first walks
    cases.push_back({1, 300, 270, 2, 1, false, false, 0, 1.0f});
    cases.push_back({1, 270, 300, 2, 1, true, false, 0, 1.0f});
  }
  if (Cfg::kLongestFirst) {  // 34 (batch, kv head) pairs, 2 key tiles: groups of 5 pairs, the last partial
    cases.push_back({17, 40, 150, 2, 2, true, false, 0, 1.0f});
    cases.push_back({17, 40, 150, 4, 2, true, true, 0, 1.0f});
  }
  // Head dimensions below the tile width (zero-filled columns, skipped stores): one 16-byte chunk
  // short of it, one 64-column block short where there is one, and the smallest.
  const int hd_short = Cfg::kHeadDim - 8, hd_far = Cfg::kHeadDim > 64 ? Cfg::kHeadDim - 56 : 8;
  cases.push_back({1, 100, 77, 2, 1, false, false, 8, 1.0f, hd_short});
  cases.push_back({2, 150, 60, 3, 1, true, true, 0, 1.3f, hd_far});
  // Variants. Windows: {wl, wr}; causal + left is the window {wl, 0} without causal.
  const std::vector<Problem> variant_cases = {
    with({1, 200, 230, 2, 1, false, false, 0, 1.0f}, {40, -1}),                 // left only
    with({1, 260, 150, 2, 1, false, true, 0, 1.0f}, {-1, 30}),                  // right only, first rows empty
    with({1, 300, 300, 2, 1, false, true, 0, 1.0f}, {20, 10}),                  // both
    with({1, 150, 290, 4, 2, false, true, 0, 1.0f}, {50, 0}),                   // causal + left
    with({1, 300, 120, 2, 1, false, true, 0, 1.0f}, {60, -1}),                  // left, Sq > Sk
    with({1, 300, 100, 2, 1, false, true, 0, 1.0f}, {5, 5}),                    // most rows empty
    with({1, 64, 400, 2, 1, false, true, 0, 1.0f}, {10, 10}),                   // key tiles with no query
    with({1, 150, 170, 2, 1, false, false, 0, 3.0f}, {-1, -1, 5.f}),            // softcap
    with({1, 170, 150, 2, 1, true, true, 0, 3.0f}, {-1, 0, 2.f}),               // softcap, causal
    with({1, 200, 200, 2, 1, false, false, 0, 1.0f}, {-1, -1, 0.f, 1}),         // ALiBi (Hq,)
    with({2, 130, 190, 2, 1, true, true, 0, 1.0f}, {-1, 0, 0.f, 2}),            // ALiBi (B, Hq), causal
    with({1, 200, 90, 2, 1, true, false, 0, 1.0f}, {-1, 0, 0.f, 0, true}),      // sinks, empty rows
    with({2, 180, 250, 4, 2, false, true, 8, -0.8f}, {30, 20, 4.f, 2, true}),   // all, negative scale
    with({1, 190, 160, 2, 1, false, false, 0, 2.0f}, {17, 3, 3.f, 1}),          // all but sinks
    with({1, 140, 210, 2, 1, false, true, 0, 1.5f, hd_far}, {17, -1, 3.f, 1}),  // below the tile width
  };
  Problem causal_left_nondet = variant_cases[3];  // (qup walks only outside deterministic mode)
  causal_left_nondet.det = false;
  const std::vector<Problem> variant_short = {variant_cases[2], causal_left_nondet, variant_cases[6], variant_cases[12],
                                              variant_cases[13]};
  const std::vector<Problem>& variants = all_variant_cases(name) ? variant_cases : variant_short;
  cases.insert(cases.end(), variants.begin(), variants.end());
  if (quick) {
    cases = {
      {1, 1, 1, 1, 1, false, false, 0, 1.0f},
      {1, 1, 1, 1, 1, true, true, 0, 1.0f},
      {1, 3, 5, 2, 1, true, false, 16, 1.0f},
      {1, 300, 20, 2, 2, true, true, 0, 1.0f},
      {1, 10, 300, 4, 1, true, false, 0, -0.7f},
      {1, 129, 129, 1, 1, true, true, 0, 1.0f},
      {3, 33, 65, 4, 2, false, false, 24, 2.0f},
      {1, 3, 5, 2, 1, true, false, 16, 1.0f, 8},
      {3, 33, 65, 4, 2, false, true, 8, 2.0f, hd_far},
      {1, 129, 129, 1, 1, true, false, 0, 1.0f, hd_short},
      with({1, 3, 5, 2, 1, false, true, 0, 1.0f}, {0, 0}),           // one key per row
      with({1, 5, 3, 2, 1, false, false, 0, 1.0f}, {0, 0, 2.f, 1}),   // rows without keys, softcap, ALiBi
      with({1, 129, 129, 1, 1, false, true, 0, 1.0f}, {1, -1}),
      with({1, 1, 1, 1, 1, false, true, 0, 1.0f}, {-1, -1, 1.f, 2, true}),
      with({1, 33, 300, 2, 1, false, true, 0, 1.0f, 8}, {0, 2, 0.5f, 2, true}),
    };
  }
  bool ok = true;
  unsigned seed = 1;
  // Packed batches: an empty sequence, single tokens, tails, seqused cutting tiles, GQA, deterministic.
  const int M = Cfg::kBlockM, N = Cfg::kBlockN;
  const std::vector<PackedProblem> packed = quick ? std::vector<PackedProblem>{
      {{1, 0, 3}, {2, 5, 0}, {1, 0, 2}, {2, 5, 0}, 2, 1, true, true},
      {{5, 3}, {3, 5}, {5, 3}, {3, 5}, 2, 1, false, false, {0, 0, 2.f, 2, true}}}
    : std::vector<PackedProblem>{
      {{M + 3, 0, 1, 2 * M - 1}, {N + 1, 7, 0, 2 * N}, {M + 3, 0, 1, M - 5}, {N - 2, 7, 0, 2 * N}, 4, 2, true, true},
      {{M - 1, 2 * M + 1}, {2 * N + 3, N}, {M - 1, M + 2}, {N + 9, N}, 2, 1, false, true, {17, 3, 3.f, 2}}};
  for (const PackedProblem& pr : packed) {
    printf(" packed case %zu sequences causal=%d det=%d window=(%d,%d) softcap=%g alibi=%d\n", pr.lq.size(), pr.causal,
           pr.det, pr.var.wl, pr.var.wr, pr.var.softcap, pr.var.alibi);
    ok &= run_packed_case<Cfg>(pr, seed++);
  }
  if (packed_only) return ok;
  for (const Problem& pr : cases) {
    printf(" case B=%d Sq=%d Sk=%d Hq=%d Hk=%d causal=%d det=%d pad=%d headdim=%d scale*%g window=(%d,%d) softcap=%g alibi=%d sinks=%d\n", pr.B, pr.Sq, pr.Sk, pr.Hq, pr.Hk, pr.causal, pr.det, pr.head_pad, pr.hd > 0 ? pr.hd : Cfg::kHeadDim, pr.scale_mul, pr.var.wl, pr.var.wr, pr.var.softcap, pr.var.alibi, pr.var.sinks);
    ok &= run_case<Cfg>(pr, seed++);
  }
  return ok;
}

// The convert kernel in each accumulator order (BwdDQLayout, bwd_params.h): an accumulator filled in that order
// from known values (the padding rows a large sentinel), converted, and compared element by element; the output's
// columns past the head dimension keep their sentinel.
template <class Cfg, BwdDQLayout kLayout>
bool run_convert_case(int B, int Sq, int Hq, int hd, unsigned seed) {
  using Elem = typename sm80::bwd::ElemOf<Cfg::kDType>::type;
  constexpr int W = Cfg::kHeadDim;
  const int Sq_r = bwd_round_up(Sq, kBwdSeqQPad), Do = hd + 8;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> acc(size_t(B) * Hq * Sq_r * W, 1e30f), ref(size_t(B) * Sq * Hq * W);
  for (auto& x : ref) x = nd(rng);
  for (int b = 0; b < B; ++b) for (int h = 0; h < Hq; ++h) for (int r = 0; r < Sq; ++r) for (int col = 0; col < W; ++col) {
    const size_t ws = (size_t(b) * Hq + h) * Sq_r;
    const size_t at = kLayout == BwdDQLayout::kFragments ? (ws + r / 64 * 64) * W + bwd_dq_fragment_offset(r % 64, col)
                      : kLayout == BwdDQLayout::kPairedRows ? (ws + bwd_dq_paired_row(r)) * W + col
                                                           : (ws + r) * W + col;
    acc[at] = ref[((size_t(b) * Sq + r) * Hq + h) * W + col];
  }
  const Elem sentinel = from_f<Elem>(-7.f);
  std::vector<Elem> dq(size_t(B) * Sq * Hq * Do, sentinel);
  BwdParams p{};
  p.dq = dq.data(); p.dq_accum = acc.data();
  p.dq_batch_stride = int64_t(Sq) * Hq * Do; p.dq_row_stride = int64_t(Hq) * Do; p.dq_head_stride = Do;
  p.batch = B; p.seqlen_q = Sq; p.seqlen_k = 1; p.seqlen_q_rounded = Sq_r; p.heads_q = Hq; p.heads_k = Hq;
  p.head_ratio = 1; p.headdim = hd; p.scale = 0.375f;
  const sm80::bwd::BwdGrids g = sm80::bwd::bwd_grids<Cfg, kLayout>(p);
  emu::launch(emu::Dim3{g.conv[0], g.conv[1], g.conv[2]}, sm80::bwd::kAuxThreads, 0,
              [&] { sm80::bwd::bwd_convert_dq_kernel<Cfg, kLayout>(p); });
  int bad = 0;
  for (int b = 0; b < B; ++b) for (int r = 0; r < Sq; ++r) for (int h = 0; h < Hq; ++h) for (int d = 0; d < Do; ++d) {
    const float got = to_f(dq[((size_t(b) * Sq + r) * Hq + h) * Do + d]);
    const float want = d < hd ? to_f(from_f<Elem>(ref[((size_t(b) * Sq + r) * Hq + h) * W + d] * p.scale)) : -7.f;
    if (got != want && bad++ < 5) printf("  FAIL convert: b=%d row=%d h=%d col=%d: %g, expected %g\n", b, r, h, d, got, want);
  }
  printf(" convert layout %d W=%d Sq=%d headdim=%d: %s\n", int(kLayout), W, Sq, hd, bad ? "FAIL" : "ok");
  return bad == 0;
}

template <class Cfg>
bool run_convert_suite(unsigned seed) {
  constexpr int W = Cfg::kHeadDim;
  bool ok = true;
  for (int Sq : {1, 77, 200}) {
    ok &= run_convert_case<Cfg, BwdDQLayout::kRows>(2, Sq, 2, W - 8, seed++);
    ok &= run_convert_case<Cfg, BwdDQLayout::kPairedRows>(2, Sq, 2, W - 8, seed++);
    ok &= run_convert_case<Cfg, BwdDQLayout::kFragments>(2, Sq, 2, W, seed++);
    ok &= run_convert_case<Cfg, BwdDQLayout::kFragments>(1, Sq, 3, W - 24, seed++);
  }
  return ok;
}

int main(int argc, char** argv) {
  std::string which = argc > 1 ? argv[1] : "all";
  bool eager = argc > 2 && std::string(argv[2]) == "eager";
  std::string sched = argc > 3 ? argv[3] : "rr";
  emu::state().opt.eager_cp_async = eager;
  emu::state().opt.schedule = sched == "serial" ? emu::Schedule::kWarpSerial : sched == "reverse" ? emu::Schedule::kWarpReverse : sched == "random" ? emu::Schedule::kRandomWarps : emu::Schedule::kRoundRobin;
  bool ok = true;
  int suites = 0;
  const bool edge = argc > 5 && std::string(argv[5]) == "edge";  // argv[4]: "-"
  const bool packed_only = argc > 6 && std::string(argv[6]) == "packed";  // the packed-batch cases only
#define CASE(tag, ...) if (which == "all" || which == tag) { ok &= run_suite<BwdConfig<__VA_ARGS__>>(tag, edge, packed_only); ++suites; }
  CASE("bf16.d64.br64.bc64.w4", DType::kBf16, 64, 64, 64, 4, 0)
  CASE("fp16.d32.br32.bc32.w2", DType::kFp16, 32, 32, 32, 2, 0)
  CASE("bf16.d128.br64.bc128.w8", DType::kBf16, 128, 128, 64, 8, 0)
  CASE("bf16.d128.br64.bc128.w8.k32", DType::kBf16, 128, 128, 64, 8, kBwdFlagKeys32)
  CASE("fp16.d96.br64.bc64.w8", DType::kFp16, 96, 64, 64, 8, 0)
  CASE("bf16.d256.br64.bc64.w8.q1", DType::kBf16, 256, 64, 64, 8, kBwdFlagSingleBuffer)
  CASE("fp16.d192.br64.bc64.w8.k32.q1", DType::kFp16, 192, 64, 64, 8, kBwdFlagKeys32 | kBwdFlagSingleBuffer)
  // The reordered staged path (dpe, dqe, pfs, hreg): the shipped d64/d128 rows, and the other
  // combinations the flags allow (dpe alone, pfs without dpe, q1 and four warps per key slice).
  constexpr unsigned kAll = kBwdFlagKeys32 | kBwdFlagDPEarly | kBwdFlagDQEarly | kBwdFlagPrefetchS | kBwdFlagOwnHalfRegs;
  CASE("bf16.d64.br128.bc128.w8.k32.dpe.dqe.pfs.hreg", DType::kBf16, 64, 128, 128, 8, kAll)
  CASE("fp16.d128.br64.bc128.w8.k32.dpe.dqe.pfs.hreg", DType::kFp16, 128, 128, 64, 8, kAll)
  CASE("bf16.d128.br64.bc128.w8.k32.dpe.dqe.pfs", DType::kBf16, 128, 128, 64, 8, kAll & ~kBwdFlagOwnHalfRegs)
  // qup: the upward walks (causal from the diagonal, else rotated by the key tile).
  CASE("fp16.d64.br128.bc128.w8.k32.dpe.dqe.pfs.hreg.qup", DType::kFp16, 64, 128, 128, 8, kAll | kBwdFlagWalkUp)
  CASE("bf16.d128.br64.bc128.w8.k32.dpe.dqe.pfs.hreg.qup", DType::kBf16, 128, 128, 64, 8, kAll | kBwdFlagWalkUp)
  CASE("bf16.d64.br64.bc64.w4.qup", DType::kBf16, 64, 64, 64, 4, kBwdFlagWalkUp)
  // lpt: causal blocks renumbered key-tile major within groups of (batch, kv head) pairs.
  CASE("bf16.d64.br128.bc128.w8.k32.dpe.dqe.pfs.hreg.lpt", DType::kBf16, 64, 128, 128, 8, kAll | kBwdFlagLongestFirst)
  CASE("fp16.d128.br64.bc128.w8.k32.dpe.dqe.pfs.hreg.qup.lpt", DType::kFp16, 128, 128, 64, 8,
       kAll | kBwdFlagWalkUp | kBwdFlagLongestFirst)
  CASE("fp16.d64.br128.bc128.w8.k32.dpe", DType::kFp16, 64, 128, 128, 8, kBwdFlagKeys32 | kBwdFlagDPEarly)
  CASE("bf16.d32.br128.bc128.w8.k32.dqe.pfs", DType::kBf16, 32, 128, 128, 8, kBwdFlagKeys32 | kBwdFlagDQEarly | kBwdFlagPrefetchS)
  CASE("fp16.d192.br64.bc64.w8.k32.q1.dpe.dqe", DType::kFp16, 192, 64, 64, 8,
       kBwdFlagKeys32 | kBwdFlagSingleBuffer | kBwdFlagDPEarly | kBwdFlagDQEarly)
  // The d256 row of the reordered staged path (four warps per key slice).
  CASE("bf16.d256.br64.bc64.w8.k32.dpe.dqe.pfs", DType::kBf16, 256, 64, 64, 8,
       kBwdFlagKeys32 | kBwdFlagDPEarly | kBwdFlagDQEarly | kBwdFlagPrefetchS)
  // Tile widths 160 and 224 (32-column blocks, two warps per key slice, the copies on the first
  // 160 / 224 threads): the listed rows.
  CASE("bf16.d160.br64.bc64.w8.dpe.dqe.pfs.hreg", DType::kBf16, 160, 64, 64, 8,
       kBwdFlagDPEarly | kBwdFlagDQEarly | kBwdFlagPrefetchS | kBwdFlagOwnHalfRegs)
  CASE("fp16.d160.br64.bc64.w8", DType::kFp16, 160, 64, 64, 8, 0)
  CASE("bf16.d160.br64.bc64.w8.q1", DType::kBf16, 160, 64, 64, 8, kBwdFlagSingleBuffer)
  CASE("fp16.d224.br64.bc64.w8.dpe.dqe.pfs", DType::kFp16, 224, 64, 64, 8,
       kBwdFlagDPEarly | kBwdFlagDQEarly | kBwdFlagPrefetchS)
  CASE("bf16.d224.br64.bc64.w8.q1.dpe.dqe", DType::kBf16, 224, 64, 64, 8,
       kBwdFlagSingleBuffer | kBwdFlagDPEarly | kBwdFlagDQEarly)
  if (which == "all" || which == "convert") {
    ok &= run_convert_suite<BwdConfig<DType::kBf16, 256, 64, 64, 8, 0>>(7);
    ok &= run_convert_suite<BwdConfig<DType::kFp16, 128, 128, 64, 8, 0>>(11);
    ok &= run_convert_suite<BwdConfig<DType::kBf16, 160, 64, 64, 8, 0>>(13);  // a half-width last column slice
    ++suites;
  }
  if (suites == 0) {  // an unknown config name must not pass by testing nothing
    printf("no config named %s\n", which.c_str());
    return 2;
  }
  printf(ok ? "ALL OK (%d configs)\n" : "FAILURES\n", suites);
  return ok ? 0 : 1;
}
