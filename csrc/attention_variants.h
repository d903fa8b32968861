// The attention variants every kernel family implements: flashop.forward's and flashop.backward's
// keyword arguments after the checks of csrc/checks.cpp, as plain data (no torch). CPU, mma.sync and
// Hopper kernels read the same struct from their params.
#pragma once

#include <cstdint>

namespace flashop {

struct AttentionVariants {
  // Local (sliding-window) attention, bottom-right aligned like causal: query i sees key j iff
  //   i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right,
  // a bound of -1 is unbounded. Causal is window_right = 0; the checks set it, and turn a bound that
  // excludes no key into -1, so (-1, -1) is dense attention and (-1, 0) plain causal.
  int window_left = -1;
  int window_right = -1;
  // > 0: every score becomes softcap * tanh(scale * q.k / softcap) (Gemma 2's logit soft-capping);
  // 0: off.
  float softcap = 0.f;
  // ALiBi: null, or float32 slopes; score(i, j) -= alibi_slopes[b * alibi_batch_stride + h] * |i + Sk - Sq - j|
  // (after softcap). alibi_batch_stride is 0 for slopes of shape (heads_q,), heads_q for (batch, heads_q).
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  // Learnable attention sinks: null, or float32 (heads_q,): one more logit per query head in every row's
  // softmax denominator, attending to nothing (its value is zero). The forward's softmax_lse includes it;
  // the backward needs nothing more (P = exp(score - lse) already carries it), the sinks' own gradient is
  // -sum over rows of exp(sink - lse) * rowsum(dO * O), formed by the autograd formula.
  const float* sinks = nullptr;

  bool local() const { return window_left >= 0 || window_right > 0; }
};

}  // namespace flashop
