"""flashop::forward_kvcache: attention of new queries over a KV cache that new keys and values are appended to
in place (FlashAttention-2's flash_attn_with_kvcache), contiguous or paged.

The op appends k/v at each sequence's cache_seqlens (rotary applied to the new keys), rotates q, then
attends over each sequence's visible keys, [cache_leftpad, cache_seqlens + seqlen_new): on CUDA with few
query rows per KV head (decoding) by the split-KV decode kernels (csrc/cuda/decode/), which read the cache
in place, paged or not; otherwise by the packed-batch forward (flashop::forward with cu_seqlens), in place
in a contiguous cache, with a paged cache or a cache_batch_idx first gathered into a contiguous copy of the
rows the batch reads (the paged-cache helpers are flashop/paged.py's, shared with flash_attn_varlen_func).

The rules of every argument live in flashop/meta.py check_kvcache_arguments (shapes, dtypes, devices: the eager
kernel and the fake kernel alike) and check_kvcache_values here (index values: eager, on the CPU, and on CUDA
as CUDA_INDEX_CHECKS says).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import _C, meta, paged

_check = meta._check
forward_op = torch.ops.flashop.forward.default
# Reading index values on the host stops the CPU until the GPU catches up, every decoding step of every layer,
# so on CUDA they are the caller's contract (as in FlashAttention): every index is clamped into the cache, and
# a bad one reaches a wrong row, never memory outside it. FLASHOP_CHECK_INDICES picks what is read on CUDA:
#   unset  FlashAttention-2's one read: a paged call's longest sequence, refused past its block table;
#   1      every index value (debugging);
#   0      none (serving loops that never sync; a CUDA graph never reads them either).
CUDA_INDEX_CHECKS = {"1": "all", "0": "none"}.get(os.environ.get("FLASHOP_CHECK_INDICES", ""), "paged")


def _host(t):
    return None if t is None else t.cpu()


def _check_lengths(lens, seqlen_new, capacity, paged):
    """lens (host): cache_seqlens + seqlen_new of every sequence inside its cache (for a paged cache: inside the
    positions its block_table row holds)."""
    holds = ("the positions of a sequence's block_table pages, max_blocks * page_size" if paged
             else "the cache's positions per sequence")
    _check(bool(((lens >= 0) & (lens + seqlen_new <= capacity)).all()),
           lambda: (f"flashop: cache_seqlens + seqlen_new must lie in [0, {capacity}] ({holds}), got cache_seqlens "
                    f"{lens.tolist()} with seqlen_new {seqlen_new}"))


def check_kvcache_values(k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                         capacity, seqlen_q, rotates_every_query):
    """The index values (eager only; they are read on the host): every write and read stays inside the cache."""
    seqlen_new = 0 if k is None else k.size(1)
    lens, leftpad = _host(cache_seqlens), _host(cache_leftpad)
    if lens is not None:
        _check_lengths(lens, seqlen_new, capacity, block_table is not None)
    if leftpad is not None:
        end = lens + seqlen_new if lens is not None else torch.full_like(leftpad, capacity)
        _check(bool(((leftpad >= 0) & (leftpad <= end)).all()),
               lambda: f"flashop: cache_leftpad must lie in [0, cache_seqlens + seqlen_new], got {leftpad.tolist()}")
    if cache_batch_idx is not None:
        idx = _host(cache_batch_idx)
        _check(bool(((idx >= 0) & (idx < k_cache.size(0))).all()),
               lambda: f"flashop: cache_batch_idx must index k_cache's {k_cache.size(0)} rows, got {idx.tolist()}")
    if block_table is not None:
        table = _host(block_table)
        used = lens + seqlen_new if lens is not None else torch.full((table.size(0),), capacity, dtype=torch.int32)
        paged.check_pages_in_use(table, paged.bad_pages(table, k_cache.size(0), k_cache.size(1), used),
                                 k_cache.size(0), "k_cache")
    if rotary_cos is not None:
        last_key = int((lens + seqlen_new).max()) if lens.numel() else 0
        last_query = int(lens.max()) + (seqlen_q if rotates_every_query else 1) if lens.numel() else 0
        _check(max(last_key, last_query) <= rotary_cos.size(0),
               lambda: (f"flashop: rotary_cos/rotary_sin have {rotary_cos.size(0)} positions; the new keys and queries need "
               f"{max(last_key, last_query)}"))


def apply_rotary(x, cos, sin, positions, interleaved):
    """x (batch, seqlen, nheads, headdim) with its first rotary_dim = 2 * cos.size(1) columns rotated by the
    angles at positions (batch, seqlen): GPT-J's interleaved pairs (x0, x1), (x2, x3), ... or GPT-NeoX's halves.
    Computed in float32, returned in x's dtype."""
    rotary_dim = 2 * cos.size(1)
    positions = positions.clamp(0, cos.size(0) - 1)  # checked in eager; inside a CUDA graph, kept in the table
    c = cos[positions].float()[:, :, None]  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin[positions].float()[:, :, None]
    rot = x[..., :rotary_dim].float()
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, dim=-1)
    o1, o2 = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def _cache_rows(cache, cache_batch_idx, block_table, capacity):
    """The cache as (batch_or_rows, capacity, nheads_k, headdim) per sequence of the batch: the cache itself when
    it is contiguous and indexed directly, else the gathered rows (block_table's pages, cache_batch_idx's rows).
    block_table: clamped (paged.clamped_table)."""
    if block_table is not None:
        return paged.gather_pages(cache, block_table)
    if cache_batch_idx is not None:
        return cache.index_select(0, cache_batch_idx.long().clamp(0, cache.size(0) - 1))  # unchecked on CUDA
    return cache


def _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Writes k and v (batch, seqlen_new, nheads_k, headdim) at positions cache_seqlens[b] + t, in place. The
    positions and rows are clamped into the cache (checked in eager; inside a CUDA graph they cannot be)."""
    batch, seqlen_new = k.shape[:2]
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=k.device)  # (batch, seqlen_new)
    if block_table is not None:
        page_size = k_cache.size(1)
        positions = positions.clamp(0, block_table.size(1) * page_size - 1)
        rows = block_table.long().gather(1, positions // page_size)
        index = (rows, positions % page_size)
    else:
        positions = positions.clamp(0, k_cache.size(1) - 1)
        batch_rows = (cache_batch_idx.long().clamp(0, k_cache.size(0) - 1) if cache_batch_idx is not None
                      else torch.arange(batch, device=k.device))[:, None].expand(batch, seqlen_new)
        index = (batch_rows, positions)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def forward_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                    window_size_left=-1, window_size_right=-1, softcap=0.0, rotary_interleaved=True,
                    alibi_slopes=None, learnable_sink=None, num_splits=0, config=None, out=None):
    """The op's kernel on every backend: the cache is appended to in place, then the decode kernels or the
    packed-batch forward attend over it. With `out` (the with_out overload) the output is written there: by
    the decode kernels directly, by a copy after the packed-batch forward."""
    batch, seqlen_q, heads_q, heads_k, headdim, capacity = meta.check_kvcache_arguments(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink, num_splits)
    if out is not None:
        meta.check_kvcache_out(out, q)
    rotates_every_query = causal or window_size_left >= 0 or window_size_right >= 0
    decode = config is None and _C.WITH_CUDA and _C.decode_supported(q, k_cache, v_cache)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        # A CUDA graph cannot read the index values on the host. Only the decode kernels read them on the
        # device alone (the packed-batch path reads cu_seqlens on the host).
        _check(decode, "flashop: flash_attn_with_kvcache inside a CUDA graph needs the decode kernels: CUDA fp16/bf16, "
               "at most 8 query rows per KV head, a headdim that is a multiple of 8, config=None")
    elif not q.is_cuda or CUDA_INDEX_CHECKS == "all":
        check_kvcache_values(k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                             capacity, seqlen_q, rotates_every_query)
    elif block_table is not None and cache_seqlens is not None and CUDA_INDEX_CHECKS == "paged":
        # FlashAttention-2 reads the longest sequence of a paged call to refuse one past its block table
        # (flash_api.cpp, mha_fwd_kvcache); so does flashop, with the same one read (the rest stays clamped).
        _check_lengths(cache_seqlens.max().view(1).cpu(), 0 if k is None else k.size(1), capacity, True)
    if block_table is not None and (k is not None or not decode):
        block_table = paged.clamped_table(block_table, k_cache.size(0))  # the decode kernels clamp their reads

    seqlen_new = 0
    if k is not None:
        seqlen_new = k.size(1)
        if rotary_cos is not None:
            positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=q.device)
            k = apply_rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    if rotary_cos is not None:
        # FlashAttention's positions: query i at cache_seqlens + i when it is causal or local, else every query
        # at cache_seqlens (they all follow the cache).
        steps = torch.arange(seqlen_q, device=q.device) if rotates_every_query else q.new_zeros(seqlen_q, dtype=torch.long)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens.long()[:, None] + steps, rotary_interleaved)

    if decode:
        # Few query rows per KV head: the split-KV decode kernels read the cache in place, paged or not, up to
        # cache_seqlens + seqlen_new.
        _, left, right = meta.normalize_window(causal, window_size_left, window_size_right, seqlen_q, capacity)
        scale = softmax_scale if softmax_scale is not None else headdim ** -0.5
        return _C.decode_forward(q, k_cache, v_cache, cache_leftpad, cache_seqlens, seqlen_new, cache_batch_idx,
                                 block_table, scale, left, right, float(softcap), alibi_slopes, learnable_sink,
                                 num_splits, out)

    end = cache_seqlens + seqlen_new if cache_seqlens is not None else None

    # Each sequence's visible keys: [leftpad, cache_seqlens + seqlen_new) of its cache rows, as a packed batch
    # over the (batch, capacity) rows: sequence b starts at b * capacity + leftpad and uses its first
    # end - leftpad rows. A leading empty sequence (no queries) owns the rows before the first one's leftpad,
    # since a packed batch starts at row 0.
    keys = _cache_rows(k_cache, cache_batch_idx, block_table, capacity)
    values = _cache_rows(v_cache, cache_batch_idx, block_table, capacity)
    if end is None:
        end = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    leftpad = cache_leftpad if cache_leftpad is not None else torch.zeros_like(end)
    starts = torch.arange(batch, dtype=torch.int32, device=q.device) * capacity + leftpad
    cu_seqlens_k = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([batch * capacity])])
    cu_seqlens_q = torch.cat([starts.new_zeros(1), torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q])
    seqused_k = torch.cat([starts.new_zeros(1), end - leftpad])
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = torch.cat([alibi_slopes.new_zeros(1, heads_q), alibi_slopes])
    packed_out, lse = forward_op(
        q.reshape(batch * seqlen_q, heads_q, headdim), keys.reshape(batch * capacity, heads_k, headdim),
        values.reshape(batch * capacity, heads_k, headdim), softmax_scale, causal, config, False, window_size_left,
        window_size_right, softcap, alibi_slopes, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqlen_q, 2 * capacity,
        None, seqused_k)
    result = packed_out.view(batch, seqlen_q, heads_q, headdim)
    if out is not None:
        result = out.copy_(result)
    return result, lse.view(heads_q, batch, seqlen_q).transpose(0, 1).contiguous()


def forward_kvcache_with_out(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                             cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                             softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                             rotary_interleaved=True, alibi_slopes=None, learnable_sink=None, num_splits=0,
                             config=None, *, out):
    return forward_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size_left, window_size_right,
                           softcap, rotary_interleaved, alibi_slopes, learnable_sink, num_splits, config, out)[1]


for _device in ("cpu", "cuda"):
    torch.library.register_kernel("flashop::forward_kvcache", _device)(forward_kvcache)
    torch.library.register_kernel("flashop::forward_kvcache.with_out", _device)(forward_kvcache_with_out)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            learnable_sink=None, config=None, out=None):
    """FlashAttention-2's flash_attn_with_kvcache. q (batch, seqlen_q, nheads, headdim); k_cache/v_cache
    (batch_cache, seqlen_cache, nheads_k, headdim), or (num_blocks, page_size, nheads_k, headdim) with block_table
    (batch, max_blocks) int32 (page_size a multiple of 16). k/v (batch, seqlen_new, nheads_k, headdim), if given,
    are written into the cache in place at cache_seqlens (int or int32 (batch,)), rotated first by rotary_cos/sin
    (seqlen_rotary, rotary_dim / 2) when given (q too: at cache_seqlens + i when causal or local, else at
    cache_seqlens). Each sequence attends to its cache positions [cache_leftpad, cache_seqlens + seqlen_new) of
    row cache_batch_idx[b] (default b); causal and windows align bottom-right there. The other arguments as in
    flash_attn_func; num_splits is a hint (0: the heuristic's). `out`, if given (q's shape and dtype), receives the
    output. Returns out (batch, seqlen_q, nheads, headdim), and softmax_lse (batch, nheads, seqlen_q) with
    return_softmax_lse."""
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.size(0),), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = window_size
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, int(left), int(right), float(softcap), rotary_interleaved,
            alibi_slopes, learnable_sink, num_splits, config)
    if out is None:
        out, softmax_lse = torch.ops.flashop.forward_kvcache(*args)
    else:
        softmax_lse = torch.ops.flashop.forward_kvcache.with_out(*args, out=out)
    return (out, softmax_lse) if return_softmax_lse else out
