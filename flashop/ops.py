"""The FlashAttention- and SDPA-style functions over the ops. The ops' kernels (csrc/cpu/, csrc/cuda/ops_cuda.cpp)
and autograd formula (csrc/autograd.cpp) are C++; their fake kernels are flashop/meta.py."""
from __future__ import annotations

import torch

from . import paged

forward_op = torch.ops.flashop.forward.default
forward_with_out_op = torch.ops.flashop.forward.with_out
backward_op = torch.ops.flashop.backward.default


def _forward(out, *args):
    """(out, softmax_lse) of the forward op, or of its with_out overload writing into a given `out` (q's shape and
    dtype, any strides)."""
    if out is None:
        return forward_op(*args)
    return out, forward_with_out_op(*args, out=out)


# ---------------------------------------------------------------- FlashAttention-style API

def _reject_dropout(dropout_p):
    if dropout_p != 0.0:
        raise NotImplementedError(f"flashop: dropout_p={dropout_p} is not supported yet (only 0.0)")


def _window_pair(window_size):
    if len(window_size) != 2:
        raise ValueError(f"flashop: window_size must be a pair (left, right), got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _attention(q, k, v, softmax_scale, causal, return_attn_probs, config, deterministic=False, window_size=(-1, -1),
               softcap=0.0, alibi_slopes=None, learnable_sink=None, out=None):
    out, softmax_lse = _forward(out, q, k, v, softmax_scale, causal, config, deterministic, *_window_pair(window_size),
                                float(softcap), alibi_slopes, learnable_sink)
    # FlashAttention returns (out, softmax_lse, S_dmask); S_dmask only exists with dropout.
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                    config=None, out=None):
    """Attention over q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim).

    nheads % nheads_k == 0 gives MQA/GQA. causal=True aligns the mask to the bottom-right corner.
    window_size=(left, right) limits query i to keys i + Sk - Sq - left .. i + Sk - Sq + right (-1: unbounded);
    softcap > 0 caps the scores at softcap * tanh(score / softcap); alibi_slopes (nheads,) or (batch, nheads)
    float32 subtracts slope * |i + Sk - Sq - j|; learnable_sink (nheads,) float32 adds one logit per head to
    every row's softmax denominator (gpt-oss's attention sinks), with its gradient. `out`, if given (q's shape
    and dtype), receives the output (the forward's result copied in: one more pass over the output).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) with return_attn_probs.
    """
    _reject_dropout(dropout_p)
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs, config, deterministic, window_size, softcap,
                      alibi_slopes, learnable_sink, out)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                              config=None):
    """qkv (batch, seqlen, 3, nheads, headdim): q, k and v are strided views, never copied. The other
    arguments as in flash_attn_func."""
    _reject_dropout(dropout_p)
    if qkv.dim() != 5 or qkv.size(2) != 3:
        raise ValueError(f"flashop: qkv must have shape (batch, seqlen, 3, nheads, headdim), got {list(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs, config, deterministic, window_size, softcap,
                      alibi_slopes, learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                             alibi_slopes=None, deterministic=False, return_attn_probs=False, *, learnable_sink=None,
                             config=None):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim). The other
    arguments as in flash_attn_func."""
    _reject_dropout(dropout_p)
    if kv.dim() != 5 or kv.size(2) != 2:
        raise ValueError(f"flashop: kv must have shape (batch, seqlen_k, 2, nheads_k, headdim), got {list(kv.shape)}")
    k, v = kv.unbind(2)
    return _attention(q, k, v, softmax_scale, causal, return_attn_probs, config, deterministic, window_size, softcap,
                      alibi_slopes, learnable_sink)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink, seqused_q,
                      seqused_k, config, out=None):
    out, softmax_lse = _forward(out, q, k, v, softmax_scale, causal, config, deterministic, *_window_pair(window_size),
                                float(softcap), alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, seqused_q, seqused_k)
    return (out, softmax_lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None, *,
                           learnable_sink=None, seqused_q=None, seqused_k=None, config=None, out=None):
    """Attention over a packed batch: q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim),
    sequence b being rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (int32 (batch + 1,), starting at 0) and
    likewise of k/v. Causal and windows are aligned bottom-right within each sequence. seqused_q/k (int32
    (batch,)): only the first seqused[b] tokens of each sequence take part (FlashAttention-3's). Returns out
    (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q), None) with return_attn_probs. The other
    arguments (`out` too) as in flash_attn_func.

    With block_table (int32 (batch, max_blocks)), k and v are a paged KV cache (num_blocks, page_size, nheads_k,
    headdim), page_size a multiple of 16, as vLLM's FlashAttention backend calls it: sequence b's keys are its
    first seqused_k[b] positions (or cu_seqlens_k[b + 1] - cu_seqlens_k[b] without seqused_k, as
    FlashAttention-2 takes it; cu_seqlens_k may be None with seqused_k), position p being row p % page_size of
    page block_table[b, p // page_size]; table entries past a sequence's pages are ignored. max_seqlen_k, if
    given, is at least every key count. Gradients flow into the pages (summed over sequences sharing one)."""
    _reject_dropout(dropout_p)
    if block_table is not None:
        keys, values, seqused_k = paged.gather_paged_kv(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                                        max_seqlen_k)
        batch, capacity = keys.shape[:2]
        # Each sequence a packed sequence of its capacity rows, of which it uses its first key count.
        cu_seqlens_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * capacity
        k, v, max_seqlen_k = keys.flatten(0, 1), values.flatten(0, 1), capacity
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                             seqused_q, seqused_k, config, out)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None, config=None):
    """qkv (total, 3, nheads, headdim), one cu_seqlens for queries and keys. As flash_attn_varlen_func."""
    _reject_dropout(dropout_p)
    if qkv.dim() != 4 or qkv.size(1) != 3:
        raise ValueError(f"flashop: qkv must have shape (total, 3, nheads, headdim), got {list(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                             None, None, config)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    learnable_sink=None, config=None):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim). As flash_attn_varlen_func."""
    _reject_dropout(dropout_p)
    if kv.dim() != 4 or kv.size(1) != 2:
        raise ValueError(f"flashop: kv must have shape (total_k, 2, nheads_k, headdim), got {list(kv.shape)}")
    k, v = kv.unbind(1)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                             None, None, config)


# ---------------------------------------------------------------- torch.nn.functional-style API

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` on flashop kernels.

    Layout (batch, nheads, seqlen, headdim), as torch's. is_causal follows torch: the mask is aligned to the
    top-left corner (query i sees keys j <= i), also when seqlen_q != seqlen_k.
    """
    if attn_mask is not None:
        raise NotImplementedError("flashop.scaled_dot_product_attention: attn_mask is not supported yet "
                                  "(use is_causal for causal masking)")
    if dropout_p != 0.0:
        raise NotImplementedError(f"flashop.scaled_dot_product_attention: dropout_p={dropout_p} is not supported yet")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"flashop.scaled_dot_product_attention: {name} must be a 4-D tensor "
                             f"(batch, nheads, seqlen, headdim), got a {t.dim()}-D tensor")
    if query.size(1) != key.size(1) and not enable_gqa:
        raise ValueError(f"flashop.scaled_dot_product_attention: query has {query.size(1)} heads and key "
                         f"{key.size(1)}; pass enable_gqa=True for grouped-query attention")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    seqlen_q, seqlen_k = q.size(1), k.size(1)
    if not is_causal or seqlen_q == seqlen_k:
        out, _ = forward_op(q, k, v, scale, is_causal, None)
    elif seqlen_q < seqlen_k:
        # Top-left: no query sees keys past seqlen_q - 1, so the square top-left block is the whole problem.
        out, _ = forward_op(q, k[:, :seqlen_q], v[:, :seqlen_q], scale, True, None)
    else:
        # Top-left with more queries than keys: the first seqlen_k queries are a square causal problem,
        # the rest see every key.
        head, _ = forward_op(q[:, :seqlen_k], k, v, scale, True, None)
        tail, _ = forward_op(q[:, seqlen_k:], k, v, scale, False, None)
        out = torch.cat([head, tail], dim=1)
    return out.transpose(1, 2)
