"""Fake (meta) kernels: output shapes and the argument rules, for tracing.

Every rule and message here mirrors csrc/checks.cpp, so a bad input fails the
same way under torch.compile / torch.export as in eager mode.
"""
import torch

from . import dispatch

MAX_HEADDIM = 256
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(cond, message):
    """torch._check, with a fast path for a plain True (eager calls); message: a string or, where it formats
    values, a callable that builds it only on failure."""
    if cond is True:
        return
    torch._check(cond, message if callable(message) else lambda: message)


def _rank4(t, name):
    _check(t.dim() == 4,
           lambda: f"flashop: {name} must be a 4-D tensor (batch, seqlen, nheads, headdim), got a {t.dim()}-D tensor")


def _same_dtype_device(t, name, q):
    _check(t.dtype == q.dtype, lambda: f"flashop: {name} must have the dtype of q ({q.dtype}), got {t.dtype}")
    _check(t.device == q.device, lambda: f"flashop: {name} must be on the device of q ({q.device}), got {t.device}")


def _last_dim_contiguous(t, name):
    _check(t.size(-1) <= 1 or t.stride(-1) == 1,
           lambda: f"flashop: {name} must be contiguous in its last dimension (stride 1), got stride {t.stride(-1)}")


def check_forward_inputs(q, k, v):
    """Returns (batch, seqlen_q, seqlen_k, heads_q, heads_k, headdim)."""
    _rank4(q, "q")
    _rank4(k, "k")
    _rank4(v, "v")
    _check(q.dtype in _FLOAT_DTYPES,
           lambda: f"flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got {q.dtype}")
    _same_dtype_device(k, "k", q)
    _same_dtype_device(v, "v", q)
    _check(k.shape == v.shape,
           lambda: ("flashop: k and v must have the same shape (batch, seqlen_k, nheads_k, headdim), "
           f"got k {list(k.shape)} and v {list(v.shape)}"))
    _check(k.size(0) == q.size(0), lambda: f"flashop: k must have the batch size of q ({q.size(0)}), got {k.size(0)}")
    _check(k.size(3) == q.size(3), lambda: f"flashop: k must have the headdim of q ({q.size(3)}), got {k.size(3)}")
    headdim = q.size(3)
    _check(1 <= headdim <= MAX_HEADDIM, lambda: f"flashop: headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    heads_q, heads_k = q.size(2), k.size(2)
    _check(heads_k >= 1 and heads_q % heads_k == 0,
           lambda: f"flashop: the number of query heads ({heads_q}) must be a multiple of the number of key/value heads ({heads_k})")
    _last_dim_contiguous(q, "q")
    _last_dim_contiguous(k, "k")
    _last_dim_contiguous(v, "v")
    return q.size(0), q.size(1), k.size(1), heads_q, heads_k, headdim


def check_backward_inputs(dout, q, out, softmax_lse, dims, packed=False):
    """dout and out shaped like q; softmax_lse (batch, nheads, seqlen_q), or (nheads, total_q) for a packed
    batch (dims from check_varlen_inputs)."""
    batch, seqlen_q, _, heads_q, _, _ = dims
    _check(dout.shape == q.shape,
           lambda: f"flashop: dout must have the shape of q {list(q.shape)}, got {list(dout.shape)}")
    _check(out.shape == q.shape,
           lambda: f"flashop: out must have the shape of q {list(q.shape)}, got {list(out.shape)}")
    _same_dtype_device(dout, "dout", q)
    _same_dtype_device(out, "out", q)
    _last_dim_contiguous(out, "out")
    _last_dim_contiguous(dout, "dout")
    _last_dim_contiguous(out, "out")
    lse_shape, lse_dims = ([heads_q, seqlen_q], "(nheads, total_q)") if packed else \
        ([batch, heads_q, seqlen_q], "(batch, nheads, seqlen_q)")
    _check(list(softmax_lse.shape) == lse_shape,
           lambda: f"flashop: softmax_lse must have shape {lse_dims} = {lse_shape}, got {list(softmax_lse.shape)}")
    _check(softmax_lse.dtype == torch.float32,
           lambda: f"flashop: softmax_lse must have dtype torch.float32, got {softmax_lse.dtype}")
    _check(softmax_lse.device == q.device,
           lambda: f"flashop: softmax_lse must be on the device of q ({q.device}), got {softmax_lse.device}")


def _index_tensor(t, name, q, size, what):
    _check(t.dtype == torch.int32, lambda: f"flashop: {name} must have dtype torch.int32, got {t.dtype}")
    _check(t.device == q.device, lambda: f"flashop: {name} must be on the device of q ({q.device}), got {t.device}")
    _check(t.dim() == 1 and t.size(0) == size,
           lambda: f"flashop: {name} must have shape {what} = ({size},), got {list(t.shape)}")


def _rank3(t, name, rows):
    _check(t.dim() == 3, lambda: (f"flashop: with cu_seqlens, {name} must be a 3-D tensor ({rows}, nheads, headdim), "
           f"got a {t.dim()}-D tensor"))


def is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k):
    """Whether a call is a packed (variable-length) batch (csrc/cpu/attention_cpu.cpp VarlenOptions::packed)."""
    _check((cu_seqlens_q is None) == (cu_seqlens_k is None),
           "flashop: cu_seqlens_q and cu_seqlens_k must be given together")
    _check(cu_seqlens_q is not None or all(a is None for a in (max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)),
           "flashop: max_seqlen_q/k and seqused_q/k need cu_seqlens_q and cu_seqlens_k")
    return cu_seqlens_q is not None


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """The tensor rules of a packed batch (csrc/checks.cpp check_varlen_inputs); dims with batch = number of
    sequences and seqlen_q / seqlen_k = total tokens."""
    _rank3(q, "q", "total_q")
    _rank3(k, "k", "total_k")
    _rank3(v, "v", "total_k")
    _, total_q, total_k, heads_q, heads_k, headdim = check_forward_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    _check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.size(0) >= 1,
           lambda: f"flashop: cu_seqlens_q must have shape (batch + 1,), got {list(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.size(0) - 1
    _index_tensor(cu_seqlens_q, "cu_seqlens_q", q, batch + 1, "(batch + 1,)")
    _index_tensor(cu_seqlens_k, "cu_seqlens_k", q, batch + 1, "(batch + 1,)")
    if seqused_q is not None:
        _index_tensor(seqused_q, "seqused_q", q, batch, "(batch,)")
    if seqused_k is not None:
        _index_tensor(seqused_k, "seqused_k", q, batch, "(batch,)")
    return batch, total_q, total_k, heads_q, heads_k, headdim


def _variant_tensor(t, name, q, shapes, shape_text):
    _check(t.dtype == torch.float32, lambda: f"flashop: {name} must have dtype torch.float32, got {t.dtype}")
    _check(t.device == q.device, lambda: f"flashop: {name} must be on the device of q ({q.device}), got {t.device}")
    _check(list(t.shape) in shapes, lambda: f"flashop: {name} must have shape {shape_text}, got {list(t.shape)}")
    _check(t.is_contiguous(), lambda: f"flashop: {name} must be contiguous")


def check_variants(dims, q, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink=None):
    """The variant arguments' rules (csrc/checks.cpp check_variants)."""
    batch, _, _, heads_q, _, _ = dims
    _check(window_size_left >= -1,
           lambda: f"flashop: window_size_left must be -1 (unbounded) or >= 0, got {window_size_left}")
    _check(window_size_right >= -1,
           lambda: f"flashop: window_size_right must be -1 (unbounded) or >= 0, got {window_size_right}")
    _check(softcap == softcap and abs(softcap) != float("inf") and softcap >= 0,
           lambda: f"flashop: softcap must be a finite number >= 0 (0 is off), got {softcap}")
    if alibi_slopes is not None:
        _variant_tensor(alibi_slopes, "alibi_slopes", q, [[heads_q], [batch, heads_q]],
                        f"(nheads,) = ({heads_q},) or (batch, nheads) = ({batch}, {heads_q})")
    if learnable_sink is not None:
        _variant_tensor(learnable_sink, "learnable_sink", q, [[heads_q]], f"(nheads,) = ({heads_q},)")


def variants_requested(causal, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink=None):
    """Whether the arguments, as given, ask for more than dense or causal attention (before the window is
    normalised against the sequence lengths, so eager and traced calls judge a named config alike)."""
    return (window_size_left >= 0 or (window_size_right > 0 and not causal) or softcap > 0
            or alibi_slopes is not None or learnable_sink is not None)


def normalize_window(causal, window_size_left, window_size_right, seqlen_q, seqlen_k):
    """(causal, left, right) as the kernels take them (csrc/checks.cpp check_variants): causal sets the
    right bound to 0, a bound that excludes no key becomes -1, causal is exactly the (-1, 0) window."""
    if causal:
        window_size_right = 0
    if window_size_left >= seqlen_k - 1:
        window_size_left = -1
    if window_size_right >= seqlen_q - 1:
        window_size_right = -1
    return window_size_left < 0 and window_size_right == 0, window_size_left, window_size_right


def check_softmax_scale(softmax_scale):
    if softmax_scale is not None:
        _check(softmax_scale == softmax_scale and abs(softmax_scale) != float("inf"),
               lambda: f"flashop: softmax_scale must be a finite number, got {softmax_scale}")


@torch.library.register_fake("flashop::forward")
def forward_fake(q, k, v, softmax_scale=None, causal=False, config=None, deterministic=False,
                 window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, learnable_sink=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                 seqused_k=None):
    packed = is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    dims = (check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if packed
            else check_forward_inputs(q, k, v))
    batch, seqlen_q, _, heads_q, _, headdim = dims
    check_variants(dims, q, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink)
    check_softmax_scale(softmax_scale)
    dispatch.check_config(config, q.device, q.dtype, headdim, "forward", variants=variants_requested(
        causal, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink), packed=packed)
    out = q.new_empty(q.shape)
    lse_shape = (heads_q, seqlen_q) if packed else (batch, heads_q, seqlen_q)  # packed: (nheads, total_q)
    softmax_lse = q.new_empty(lse_shape, dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flashop::backward")
def backward_fake(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, config=None,
                  deterministic=False, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                  seqused_k=None):
    packed = is_packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k)
    if packed:
        dims = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        check_backward_inputs(dout, q, out, softmax_lse, dims, packed=True)
    else:
        dims = check_forward_inputs(q, k, v)
        check_backward_inputs(dout, q, out, softmax_lse, dims)
    check_variants(dims, q, window_size_left, window_size_right, softcap, alibi_slopes)
    check_softmax_scale(softmax_scale)
    dispatch.check_config(config, q.device, q.dtype, dims[5], "backward", deterministic, variants=variants_requested(
        causal, window_size_left, window_size_right, softcap, alibi_slopes), packed=packed)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---------------------------------------------------------------- paged KV caches (flashop/paged.py)

def check_block_table(block_table, cache, cache_name, q, batch):
    """The rules of a block table (batch, max_blocks) int32 over a paged cache (num_blocks, page_size, nheads_k,
    headdim), shared by flash_attn_with_kvcache and flash_attn_varlen_func. Returns the positions one sequence's
    pages hold, max_blocks * page_size."""
    _check(block_table.dtype == torch.int32, f"flashop: block_table must have dtype torch.int32, got "
           f"{block_table.dtype}")
    _check(block_table.device == q.device, f"flashop: block_table must be on the device of q ({q.device}), got "
           f"{block_table.device}")
    _check(block_table.dim() == 2 and block_table.size(0) == batch, f"flashop: block_table must have shape "
           f"(batch, max_blocks) with batch = {batch}, got {list(block_table.shape)}")
    page_size = cache.size(1)
    _check(page_size % 16 == 0 and page_size > 0, f"flashop: with block_table, the page size ({cache_name}.size(1)) "
           f"must be a multiple of 16 (16, 32, ...), got {page_size}")
    _check(cache.size(0) >= 1 or block_table.size(1) == 0, f"flashop: with block_table, {cache_name} must hold at "
           f"least one page ({cache_name}.size(0) >= 1)")
    return block_table.size(1) * page_size


def check_paged_varlen_inputs(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """The rules of flash_attn_varlen_func with block_table (the op flashop::gather_paged_kv: its eager kernel and
    fake kernel both call this): q (total_q, nheads, headdim), k and v (num_blocks, page_size, nheads_k, headdim),
    block_table (batch, max_blocks), cu_seqlens_q (batch + 1,), and each sequence's key count from seqused_k
    (batch,) or cu_seqlens_k (batch + 1,). Returns (batch, capacity), capacity = max_blocks * page_size."""
    _rank3(q, "q", "total_q")
    for name, t in (("k", k), ("v", v)):
        _check(t.dim() == 4, f"flashop: with block_table, {name} must be a 4-D tensor (num_blocks, page_size, "
               f"nheads_k, headdim), got a {t.dim()}-D tensor")
    _check(q.dtype in _FLOAT_DTYPES,
           f"flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got {q.dtype}")
    _same_dtype_device(k, "k", q)
    _same_dtype_device(v, "v", q)
    _check(k.shape == v.shape, "flashop: k and v must have the same shape (num_blocks, page_size, nheads_k, "
           f"headdim), got k {list(k.shape)} and v {list(v.shape)}")
    heads_q, headdim = q.size(1), q.size(2)
    _check(k.size(3) == headdim, f"flashop: k must have the headdim of q ({headdim}), got {k.size(3)}")
    _check(1 <= headdim <= MAX_HEADDIM, f"flashop: headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    heads_k = k.size(2)
    _check(heads_k >= 1 and heads_q % heads_k == 0,
           f"flashop: the number of query heads ({heads_q}) must be a multiple of the number of key/value heads ({heads_k})")
    _last_dim_contiguous(q, "q")
    _last_dim_contiguous(k, "k")
    _last_dim_contiguous(v, "v")
    _check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.size(0) >= 1,
           f"flashop: cu_seqlens_q must have shape (batch + 1,), got {list(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.size(0) - 1
    _index_tensor(cu_seqlens_q, "cu_seqlens_q", q, batch + 1, "(batch + 1,)")
    capacity = check_block_table(block_table, k, "k", q, batch)
    _check(seqused_k is not None or cu_seqlens_k is not None, "flashop: with block_table, each sequence's key count "
           "comes from seqused_k (or from cu_seqlens_k, as FlashAttention-2 takes it): give one of them")
    if cu_seqlens_k is not None:
        _index_tensor(cu_seqlens_k, "cu_seqlens_k", q, batch + 1, "(batch + 1,)")
    if seqused_k is not None:
        _index_tensor(seqused_k, "seqused_k", q, batch, "(batch,)")
    return batch, capacity


# ---------------------------------------------------------------- flashop::forward_kvcache (flashop/kvcache.py)

def _int32_vector(t, name, q, size):
    _check(t.dtype == torch.int32, lambda: f"flashop: {name} must have dtype torch.int32, got {t.dtype}")
    _check(t.device == q.device, lambda: f"flashop: {name} must be on the device of q ({q.device}), got {t.device}")
    _check(t.dim() == 1 and t.size(0) == size, lambda: (f"flashop: {name} must have shape (batch,) = ({size},), got "
           f"{list(t.shape)}"))


def check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table):
    """Returns (batch, seqlen_q, heads_q, heads_k, headdim, capacity): capacity is the positions one sequence's
    cache holds (seqlen_cache, or max_blocks * page_size for a paged cache)."""
    _rank4(q, "q")
    batch, seqlen_q, heads_q, headdim = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(cache.dim() == 4, lambda: (f"flashop: {name} must be a 4-D tensor (batch_cache, seqlen_cache, nheads_k, "
               f"headdim), or (num_blocks, page_size, nheads_k, headdim) with block_table, got a {cache.dim()}-D tensor"))
        _same_dtype_device(cache, name, q)
        _last_dim_contiguous(cache, name)
    _check(q.dtype in _FLOAT_DTYPES,
           lambda: f"flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got {q.dtype}")
    _check(k_cache.shape == v_cache.shape,
           lambda: (f"flashop: k_cache and v_cache must have the same shape, got k_cache "
           f"{list(k_cache.shape)} and v_cache {list(v_cache.shape)}"))
    heads_k = k_cache.size(2)
    _check(k_cache.size(3) == headdim,
           lambda: f"flashop: k_cache must have the headdim of q ({headdim}), got {k_cache.size(3)}")
    _check(1 <= headdim <= MAX_HEADDIM, lambda: f"flashop: headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    _check(heads_k >= 1 and heads_q % heads_k == 0,
           lambda: (f"flashop: the number of query heads ({heads_q}) must be a "
           f"multiple of the number of key/value heads ({heads_k})"))
    _last_dim_contiguous(q, "q")
    if block_table is not None:
        capacity = check_block_table(block_table, k_cache, "k_cache", q, batch)
        _check(cache_batch_idx is None, "flashop: cache_batch_idx cannot be combined with block_table (the block "
               "table already maps each sequence to its pages)")
    else:
        capacity = k_cache.size(1)
        if cache_batch_idx is None:
            _check(k_cache.size(0) == batch,
                   lambda: (f"flashop: k_cache must have the batch size of q ({batch}) unless "
                   f"cache_batch_idx selects its rows, got {k_cache.size(0)}"))
    _check((k is None) == (v is None), "flashop: k and v (the new keys and values) must be given together")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check(t.dim() == 4 and t.size(0) == batch and t.size(2) == heads_k and t.size(3) == headdim,
                   lambda: (f"flashop: {name} must have shape (batch, seqlen_new, nheads_k, headdim) = ({batch}, seqlen_new, "
                   f"{heads_k}, {headdim}), got {list(t.shape)}"))
            _same_dtype_device(t, name, q)
        _check(k.shape == v.shape, lambda: (f"flashop: k and v must have the same shape, got k {list(k.shape)} and v "
               f"{list(v.shape)}"))
        _check(cache_seqlens is not None, "flashop: appending k and v needs cache_seqlens (where each sequence's "
               "new keys go)")
    _check((rotary_cos is None) == (rotary_sin is None), "flashop: rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        _check(k is not None, "flashop: rotary_cos/rotary_sin rotate the new keys: they need k and v")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check(t.dim() == 2,
                   lambda: (f"flashop: {name} must be a 2-D tensor (seqlen_rotary, rotary_dim / 2), got a "
                   f"{t.dim()}-D tensor"))
            _same_dtype_device(t, name, q)
        _check(rotary_cos.shape == rotary_sin.shape,
               lambda: (f"flashop: rotary_cos and rotary_sin must have the same shape, "
               f"got {list(rotary_cos.shape)} and {list(rotary_sin.shape)}"))
        rotary_dim = 2 * rotary_cos.size(1)
        _check(rotary_dim <= headdim and rotary_dim % 16 == 0,
               lambda: (f"flashop: rotary_dim (2 * rotary_cos.size(1) = "
               f"{rotary_dim}) must be a multiple of 16 and at most headdim ({headdim})"))
    if cache_seqlens is not None:
        _int32_vector(cache_seqlens, "cache_seqlens", q, batch)
    if cache_batch_idx is not None:
        _int32_vector(cache_batch_idx, "cache_batch_idx", q, batch)
    if cache_leftpad is not None:
        _int32_vector(cache_leftpad, "cache_leftpad", q, batch)
    return batch, seqlen_q, heads_q, heads_k, headdim, capacity


def check_kvcache_arguments(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, window_size_left, window_size_right, softcap,
                            alibi_slopes, learnable_sink, num_splits):
    """Every rule of flashop::forward_kvcache that shapes, dtypes and devices decide (its eager kernel and fake
    kernel both call this). Returns check_kvcache_inputs' dims."""
    dims = check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table)
    batch, seqlen_q, heads_q, heads_k, headdim, capacity = dims
    _check(num_splits >= 0, lambda: f"flashop: num_splits must be >= 0 (0: chosen by a heuristic), got {num_splits}")
    check_variants((batch, seqlen_q, capacity, heads_q, heads_k, headdim), q, window_size_left, window_size_right,
                   softcap, alibi_slopes, learnable_sink)
    check_softmax_scale(softmax_scale)
    return dims


@torch.library.register_fake("flashop::forward_kvcache")
def forward_kvcache_fake(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                         cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                         causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         rotary_interleaved=True, alibi_slopes=None, learnable_sink=None, num_splits=0,
                         config=None):
    batch, seqlen_q, heads_q, _, _, _ = check_kvcache_arguments(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, window_size_left, window_size_right, softcap, alibi_slopes, learnable_sink, num_splits)
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def check_kvcache_out(out, q):
    """The preallocated output of forward_kvcache.with_out: q's shape, dtype and device."""
    _check(out.shape == q.shape, lambda: f"flashop: out must have the shape of q {list(q.shape)}, got {list(out.shape)}")
    _same_dtype_device(out, "out", q)


@torch.library.register_fake("flashop::forward_kvcache.with_out")
def forward_kvcache_with_out_fake(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                  cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                  softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
                                  softcap=0.0, rotary_interleaved=True, alibi_slopes=None, learnable_sink=None,
                                  num_splits=0, config=None, *, out):
    check_kvcache_out(out, q)
    _, lse = forward_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                  cache_leftpad, block_table, softmax_scale, causal, window_size_left,
                                  window_size_right, softcap, rotary_interleaved, alibi_slopes, learnable_sink,
                                  num_splits, config)
    return lse
