// A CPU emulator for the handful of CUDA features the backward kernels use, so
// the kernels' index math (fragment layouts, swizzle, tails, causal, GQA,
// pipelining, deterministic ordering) can be checked on a machine without a
// GPU. Test-only: included by ptx.cuh when FLASHOP_BWD_EMULATE is defined,
// compiled with a host compiler (g++), never part of the extension.
//
// Model: every CUDA thread of a block is a fiber (ucontext) on one OS thread;
// a fiber runs until it waits (block barrier, warp-collective instruction,
// spin on a semaphore), then yields; Options::schedule picks who runs next
// (lockstep round robin, or one warp racing ahead of the others, which is
// what exposes a missing barrier). Blocks run one after another in launch
// order (x fastest). Warp-collective instructions (ldmatrix, mma, shfl) gather
// the 32 lanes' operands through a per-warp exchange and compute each lane's
// result from the PTX ISA's fragment definitions, independently of the
// kernels' own comments. cp.async copies run either at issue ("eager": hides
// missing waits, exposes write-after-read races on a buffer being refilled) or
// at the wait that retires them ("lazy": the opposite); run both. Shared memory
// starts as 0xFF bytes (NaN in fp16, bf16 and fp32) to expose reads of bytes
// nobody wrote.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashop {
namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct CpAsyncCopy {
  uint32_t dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
  std::vector<std::vector<CpAsyncCopy>> committed;
  std::vector<CpAsyncCopy> open;
};

struct WarpState {
  int count = 0;
  unsigned gen = 0;
  uint32_t slots[32][8];
};

// Fiber schedules. Warps that run in lockstep hide missing barriers, so the
// skewed ones let one warp run ahead until it blocks on a block barrier.
enum class Schedule {
  kRoundRobin,   // every thread one step per round
  kWarpSerial,   // warp 0 as far as it can go, then warp 1, ...
  kWarpReverse,  // the same, last warp first
  kRandomWarps,  // random warp order, random number of steps per warp
};

struct Options {
  bool eager_cp_async = false;  // see the header comment
  Schedule schedule = Schedule::kRoundRobin;
  unsigned seed = 1;
};

struct State {
  Options opt;
  // Called with every cp.async source address, zero-fill copies included (the kernels clamp those
  // to an address they may read): the test checks that it lies inside a row's true head dimension.
  std::function<void(const void*)> check_global_read;
  Dim3 grid, block, block_idx;
  int nthreads = 0;
  std::size_t smem_bytes = 0;
  unsigned char* smem = nullptr;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  int bar_count = 0;
  unsigned bar_gen = 0;
  int cur = -1;
  ucontext_t sched;
  std::function<void()> body;
  std::mt19937 rng{1};
  long long spins = 0;
  long long collectives = 0;
  long long progress = 0;  // completed barriers and finished fibers
};

inline State& state() {
  static State s;
  return s;
}

[[noreturn]] inline void fail(const char* what) {
  const State& s = state();
  std::fprintf(stderr, "emu: %s (block %u,%u,%u thread %d)\n", what, s.block_idx.x, s.block_idx.y,
               s.block_idx.z, s.cur);
  std::abort();
}

inline int thread_x() { return state().cur; }
inline int block_x() { return int(state().block_idx.x); }
inline int block_y() { return int(state().block_idx.y); }
inline int block_z() { return int(state().block_idx.z); }

inline void yield() {
  State& s = state();
  swapcontext(&s.fibers[s.cur].ctx, &s.sched);
}

inline void syncthreads() {
  State& s = state();
  const unsigned gen = s.bar_gen;
  if (++s.bar_count == s.nthreads) {
    s.bar_count = 0;
    ++s.bar_gen;
    ++s.progress;
  } else {
    while (s.bar_gen == gen) yield();
  }
}

inline void syncwarp() {
  State& s = state();
  WarpState& w = s.warps[s.cur / 32];
  const unsigned gen = w.gen;
  if (++w.count == 32) {
    w.count = 0;
    ++w.gen;
    ++s.progress;
  } else {
    while (w.gen == gen) yield();
  }
}

// Every lane contributes N words; every lane gets all 32 lanes' words.
template <int N>
inline void warp_gather(const uint32_t (&mine)[N], uint32_t (&all)[32][N]) {
  State& s = state();
  ++s.collectives;
  WarpState& w = s.warps[s.cur / 32];
  const int lane = s.cur % 32;
  for (int i = 0; i < N; ++i) w.slots[lane][i] = mine[i];
  syncwarp();
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < N; ++i) all[l][i] = w.slots[l][i];
  syncwarp();
}

inline void check_smem(uint32_t addr, uint32_t bytes, uint32_t align) {
  const State& s = state();
  if (addr % align != 0) fail("misaligned shared-memory access");
  if (std::size_t(addr) + bytes > s.smem_bytes) fail("shared-memory access out of bounds");
}

inline unsigned char* smem_base() { return state().smem; }

inline uint32_t smem_u32(const void* p) {
  const State& s = state();
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < s.smem || c > s.smem + s.smem_bytes) fail("pointer is not in shared memory");
  return uint32_t(c - s.smem);
}

inline uint16_t ld_u16(uint32_t addr) {
  check_smem(addr, 2, 2);
  uint16_t v;
  std::memcpy(&v, state().smem + addr, 2);
  return v;
}

inline uint32_t ld_u32(uint32_t addr) {
  check_smem(addr, 4, 4);
  uint32_t v;
  std::memcpy(&v, state().smem + addr, 4);
  return v;
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA): lanes 8i..8i+7
// give the row addresses of matrix i (16 bytes each). Without .trans lane l
// receives row l/4, elements 2(l%4) and 2(l%4)+1 of each matrix; with .trans
// it receives elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4).
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr, bool trans) {
  const int lane = state().cur % 32;
  check_smem(addr, 16, 16);
  uint32_t mine[1] = {addr};
  uint32_t all[32][1];
  warp_gather(mine, all);
  for (int i = 0; i < 4; ++i) {
    if (!trans) {
      r[i] = ld_u32(all[8 * i + lane / 4][0] + 4 * (lane % 4));
    } else {
      const uint32_t lo = ld_u16(all[8 * i + 2 * (lane % 4)][0] + 2 * (lane / 4));
      const uint32_t hi = ld_u16(all[8 * i + 2 * (lane % 4) + 1][0] + 2 * (lane / 4));
      r[i] = lo | (hi << 16);
    }
  }
}

inline float half_bits_to_float(uint16_t h, bool bf16) {
  if (bf16) {
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw raw;
  raw.x = h;
  return __half2float(__half(raw));
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: with g = lane/4, t = lane%4
// (PTX ISA "Matrix fragments for mma.m16n8k16"):
//   A: reg0 = (g, 2t..2t+1) reg1 = (g+8, 2t..) reg2 = (g, 2t+8..) reg3 = (g+8, 2t+8..)
//   B: reg0 = (k 2t..2t+1, n g) reg1 = (k 2t+8.., n g)
//   C: c0,c1 = (g, 2t..2t+1)  c2,c3 = (g+8, 2t..2t+1)
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  const int lane = state().cur % 32;
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  uint32_t all[32][6];
  warp_gather(mine, all);
  auto half_of = [](uint32_t w, int k) { return uint16_t(k % 2 ? (w >> 16) : (w & 0xffff)); };
  auto A = [&](int r, int k) {
    const uint32_t w = all[4 * (r % 8) + (k % 8) / 2][(r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return double(half_bits_to_float(half_of(w, k), bf16));
  };
  auto B = [&](int k, int n) {
    const uint32_t w = all[4 * n + (k % 8) / 2][4 + (k >= 8 ? 1 : 0)];
    return double(half_bits_to_float(half_of(w, k), bf16));
  };
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
    double acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[e] = float(acc);
  }
}

inline float shfl_xor(float v, int mask) {
  const int lane = state().cur % 32;
  uint32_t mine[1];
  std::memcpy(&mine[0], &v, 4);
  uint32_t all[32][1];
  warp_gather(mine, all);
  float r;
  std::memcpy(&r, &all[lane ^ mask][0], 4);
  return r;
}

inline float shfl_idx(float v, int src_lane) {
  uint32_t mine[1];
  std::memcpy(&mine[0], &v, 4);
  uint32_t all[32][1];
  warp_gather(mine, all);
  float r;
  std::memcpy(&r, &all[src_lane & 31][0], 4);
  return r;
}

inline void do_copy(const CpAsyncCopy& c) {
  unsigned char* dst = state().smem + c.dst;
  if (c.valid)
    std::memcpy(dst, c.src, 16);
  else
    std::memset(dst, 0, 16);
}

inline void cp_async_16(uint32_t dst, const void* src, bool valid) {
  check_smem(dst, 16, 16);
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("misaligned cp.async source");
  if (state().check_global_read) state().check_global_read(src);
  const CpAsyncCopy c{dst, src, valid};
  if (state().opt.eager_cp_async)
    do_copy(c);
  else
    state().fibers[state().cur].open.push_back(c);
}

inline void cp_async_commit() {
  Fiber& f = state().fibers[state().cur];
  f.committed.push_back(std::move(f.open));
  f.open.clear();
}

inline void cp_async_wait(int n) {
  Fiber& f = state().fibers[state().cur];
  while (int(f.committed.size()) > n) {
    for (const CpAsyncCopy& c : f.committed.front()) do_copy(c);
    f.committed.erase(f.committed.begin());
  }
}

// A spinning thread makes no progress: with blocks run one after another, a
// wait on a later block is reported as a deadlock by the scheduler.
inline void spin_pause() {
  ++state().spins;
  yield();
}

inline void fiber_entry() {
  State& s = state();
  s.body();
  s.fibers[s.cur].done = true;
  ++s.progress;
}

// Runs body() as every thread of every block of the grid.
inline void launch(Dim3 grid, int threads, std::size_t smem_bytes, std::function<void()> body) {
  State& s = state();
  constexpr std::size_t kStack = 512 * 1024;
  s.grid = grid;
  s.nthreads = threads;
  s.body = std::move(body);
  s.rng.seed(s.opt.seed);
  if (threads % 32 != 0) fail("block size must be a multiple of 32");
  std::unique_ptr<unsigned char, void (*)(void*)> smem(
      static_cast<unsigned char*>(std::aligned_alloc(128, (smem_bytes + 255) / 128 * 128)), std::free);
  s.smem = smem.get();
  s.smem_bytes = smem_bytes;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        s.block_idx = Dim3{x, y, z};
        std::memset(s.smem, 0xFF, smem_bytes);
        s.fibers.clear();
        s.fibers.resize(threads);
        s.warps.assign(threads / 32, WarpState{});
        s.bar_count = 0;
        s.bar_gen = 0;
        for (int i = 0; i < threads; ++i) {
          Fiber& f = s.fibers[i];
          f.stack.reset(new char[kStack]);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.get();
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = &s.sched;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        const int nwarps = threads / 32;
        std::vector<int> warp_order(nwarps);
        std::iota(warp_order.begin(), warp_order.end(), 0);
        if (s.opt.schedule == Schedule::kWarpReverse) std::reverse(warp_order.begin(), warp_order.end());
        // One step of warp w: each of its live threads runs until it waits.
        auto step_warp = [&](int w) {
          bool any = false;
          for (int i = 32 * w; i < 32 * w + 32; ++i) {
            if (s.fibers[i].done) continue;
            s.cur = i;
            swapcontext(&s.sched, &s.fibers[i].ctx);
            any = any || !s.fibers[i].done;
          }
          return any;
        };
        int stalled = 0;
        for (bool alive = true; alive;) {
          alive = false;
          const long long progress_before = s.progress;
          if (s.opt.schedule == Schedule::kRandomWarps) std::shuffle(warp_order.begin(), warp_order.end(), s.rng);
          for (int w : warp_order) {
            switch (s.opt.schedule) {
              case Schedule::kRoundRobin:
                alive = step_warp(w) || alive;
                break;
              case Schedule::kWarpSerial:
              case Schedule::kWarpReverse:
                // Run warp w until it stops making progress (all its threads
                // wait on a block barrier, a semaphore, or are done).
                for (;;) {
                  const long long before = s.progress;
                  const bool live = step_warp(w);
                  alive = live || alive;
                  if (!live || s.progress == before) break;
                }
                break;
              case Schedule::kRandomWarps: {
                const int steps = int(s.rng() % 4);
                for (int k = 0; k < steps; ++k) alive = step_warp(w) || alive;
                alive = alive || std::any_of(s.fibers.begin() + 32 * w, s.fibers.begin() + 32 * w + 32,
                                             [](const Fiber& f) { return !f.done; });
                break;
              }
            }
          }
          // (A random round may legitimately step nobody; give it many tries.)
          stalled = (alive && s.progress == progress_before) ? stalled + 1 : 0;
          if (stalled > (s.opt.schedule == Schedule::kRandomWarps ? 10000 : 0))
            fail("no thread can make progress (barrier mismatch or deadlock)");
        }
        s.cur = -1;
        s.fibers.clear();
      }
  s.smem = nullptr;
  s.smem_bytes = 0;
}

}  // namespace emu
}  // namespace flashop
