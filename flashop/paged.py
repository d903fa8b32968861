"""Paged KV caches: k and v (num_blocks, page_size, nheads_k, headdim) with a block table (batch, max_blocks) int32;
position p of sequence b is row p % page_size of page block_table[b, p // page_size]. One sequence's pages hold
capacity = max_blocks * page_size positions.

The helpers here are shared by flash_attn_with_kvcache (flashop/kvcache.py) and flash_attn_varlen_func with
block_table: both gather each sequence's pages into a contiguous (batch, capacity, nheads_k, headdim) copy and run
the packed-batch forward over it, each sequence a packed sequence of capacity rows of which it uses its first
key-count rows. Only the pages a sequence uses must hold valid indices: entries past them may hold anything (vLLM
leaves them stale), so the table is clamped into the cache before the gather and those rows are never attended.

flashop::gather_paged_kv is that gather for flash_attn_varlen_func: an op, so that its argument rules
(meta.check_paged_varlen_inputs) run in its eager kernel and in its fake kernel alike, and its index values are
checked on the host in eager (and compiled) calls. Its gradient scatters the gathered rows' gradients back into
the pages (summed where sequences share a page); rows past a sequence's key count get none.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import meta

_check = meta._check


def clamped_table(block_table, num_blocks):
    """The block table with every entry inside the cache's pages (checked in eager for the pages in use; the
    entries past them may hold anything and are never read)."""
    return block_table.clamp(0, num_blocks - 1)


def gather_pages(cache, table):
    """(batch, max_blocks * page_size, nheads_k, headdim): each sequence's pages in order, copied. table: a
    clamped block table."""
    pages = cache.index_select(0, table.flatten().long())
    return pages.view(table.size(0), table.size(1) * cache.size(1), *cache.shape[2:])


def bad_pages(block_table, num_blocks, page_size, used):
    """(batch, max_blocks) bool: the entries of the pages each sequence uses (its first ceil(used[b] / page_size))
    that do not index one of the cache's num_blocks pages. Computed where the tensors are."""
    pages = (used.long() + page_size - 1) // page_size
    in_use = torch.arange(block_table.size(1), device=block_table.device)[None] < pages[:, None]
    return in_use & ((block_table < 0) | (block_table >= num_blocks))


def check_pages_in_use(block_table, bad, num_blocks, cache_name):
    """Raises, naming the first bad entry, where bad (from bad_pages) holds one."""
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        _check(False, f"flashop: block_table entries of the pages in use must index {cache_name}'s {num_blocks} "
               f"blocks, got block_table[{b}, {i}] = {int(block_table[b, i])}")


# ---------------------------------------------------------------- flashop::gather_paged_kv

def key_counts(cu_seqlens_k, seqused_k):
    """Each sequence's key count: seqused_k[b] when given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    (FlashAttention-2's paged varlen call: seqused_k overrides cu_seqlens_k, whose offsets place nothing)."""
    return seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]


def check_paged_varlen_values(k, block_table, cu_seqlens_k, seqused_k, max_seqlen_k, capacity):
    """The index values (eager; one transfer of three flags to the host when they are fine): every key count in
    [0, capacity] and at most max_seqlen_k, every page a sequence uses inside the cache."""
    counts = key_counts(cu_seqlens_k, seqused_k)
    count_bad = (counts < 0) | (counts > capacity)
    over_max = counts > max_seqlen_k if max_seqlen_k is not None else torch.zeros_like(count_bad)
    bad = bad_pages(block_table, k.size(0), k.size(1), counts.clamp(0, capacity))
    flags = torch.stack([count_bad.any(), over_max.any(), bad.any()]).tolist()
    name = "seqused_k" if seqused_k is not None else "cu_seqlens_k[b + 1] - cu_seqlens_k[b]"
    if flags[0]:
        b = int(count_bad.nonzero()[0, 0])
        _check(False, f"flashop: with block_table, each sequence's key count ({name}) must lie in [0, {capacity}] "
               f"(max_blocks * page_size, the positions of its block_table pages), got {int(counts[b])} at b = {b}")
    if flags[1]:
        b = int(over_max.nonzero()[0, 0])
        _check(False, f"flashop: max_seqlen_k ({max_seqlen_k}) is smaller than sequence {b}'s key count "
               f"{int(counts[b])} ({name})")
    if flags[2]:
        check_pages_in_use(block_table, bad, k.size(0), "k")


@torch.library.custom_op("flashop::gather_paged_kv", mutates_args=())
def gather_paged_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor],
                    seqused_k: Optional[torch.Tensor],
                    max_seqlen_k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, key counts): each sequence's pages of k and v gathered into (batch, capacity, nheads_k,
    headdim), and its key count (int32 (batch,), clamped into [0, capacity]). q and cu_seqlens_q are read for
    their shapes, dtype and device (the rules of the whole call are checked here)."""
    _, capacity = meta.check_paged_varlen_inputs(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        _check(False, "flashop: flash_attn_varlen_func with block_table cannot run inside a CUDA graph (it reads "
               "the index values and cu_seqlens on the host)")
    check_paged_varlen_values(k, block_table, cu_seqlens_k, seqused_k, max_seqlen_k, capacity)
    table = clamped_table(block_table, k.size(0))
    return (gather_pages(k, table), gather_pages(v, table),
            key_counts(cu_seqlens_k, seqused_k).clamp(0, capacity).to(torch.int32))


@gather_paged_kv.register_fake
def _gather_paged_kv_fake(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_k):
    batch, capacity = meta.check_paged_varlen_inputs(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k)
    rows = (batch, capacity, k.size(2), k.size(3))
    return k.new_empty(rows), v.new_empty(rows), cu_seqlens_q.new_empty((batch,))


def _setup_context(ctx, inputs, output):
    _, k, _, block_table, _, _, _, _ = inputs
    ctx.save_for_backward(block_table, output[2])
    ctx.cache_shape = k.shape


def _backward(ctx, dkeys, dvalues, _dcounts):
    """The gathered rows' gradients scattered back into the pages they came from: summed over the sequences
    that share a page; rows past a sequence's key count (stale table entries included) add nothing."""
    block_table, counts = ctx.saved_tensors
    num_blocks, page_size = ctx.cache_shape[:2]
    table = clamped_table(block_table, num_blocks).flatten().long()
    capacity = block_table.size(1) * page_size

    def scatter(rows):
        if rows is None:
            return None
        used = torch.arange(capacity, device=rows.device)[None] < counts[:, None]
        rows = torch.where(used[..., None, None], rows, rows.new_zeros(()))
        return rows.new_zeros(ctx.cache_shape).index_add_(0, table, rows.reshape(-1, *ctx.cache_shape[1:]))

    return None, scatter(dkeys), scatter(dvalues), None, None, None, None, None


gather_paged_kv.register_autograd(_backward, setup_context=_setup_context)
