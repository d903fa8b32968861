"""flashop as an attention implementation of Hugging Face transformers.

    import flashop.integrations.transformers      # registers "flashop"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashop")
    model.set_attn_implementation("flashop")      # or switch a loaded model

Importing this module registers `attention_forward` with transformers' `AttentionInterface` and transformers'
FlashAttention mask function with `AttentionMaskInterface` under the name "flashop": models then hand it
`(batch, heads, seq, dim)` tensors and at most a 2-D padding mask, and it calls flashop's kernels
(CPU or CUDA, as the tensors are):

- no mask: `flash_attn_func`, causal as the layer says, aligned bottom-right (decoding with a cache);
- a 2-D padding mask: the padding is dropped and the real tokens run as a packed batch
  (`flash_attn_varlen_func`), so no kernel spends time on padding and padded rows give zeros;
- packed sequences, given as `cu_seq_lens_q/k` and `max_length_q/k` keyword arguments or as `position_ids`
  that restart within one row: a packed batch too, so no token attends across sequences;
- `sliding_window`, `softcap`, `s_aux` (gpt-oss's attention sinks), `scaling`, `is_causal` and grouped-query
  heads map to flashop's arguments.
"""
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .. import ops

NAME = "flashop"
_REGISTERED = set()


def _window(sliding_window, causal):
    """transformers' sliding windows as flashop's (left, right): causal layers see the sliding_window keys up to
    their own position (`kv_idx > q_idx - sliding_window`), bidirectional ones the keys within sliding_window of
    it (`|q_idx - kv_idx| <= sliding_window`), as transformers' mask functions define them."""
    if sliding_window is None:
        return (-1, -1)
    if causal:
        return (int(sliding_window) - 1, 0)
    return (int(sliding_window), int(sliding_window))


def _cu_seqlens(lengths):
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids, tokens):
    """(cu_seqlens, max_seqlen) of sequences packed in one row, read off position_ids that restart (each
    sequence counts up by one from its first position), or None when the row holds one sequence."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.size(0) != 1 or tokens <= 1:
        return None
    if position_ids.size(1) != tokens:
        return None
    ids = position_ids[0]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1] + 1
    if int(starts.sum()) == 1:  # one sequence (a host read, as in transformers' own FlashAttention path)
        return None
    bounds = torch.cat([starts.nonzero().flatten(), ids.new_tensor([tokens])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
    return ops.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      **options)


def _padded_batch(q, k, v, key_mask, options):
    """Attention over a batch whose keys are masked by key_mask (batch, seqlen_k): the real tokens as a packed
    batch, the output scattered back with zeros on padded query rows. The queries are the last seqlen_q
    positions of the mask (decoding appends them after the cached keys)."""
    batch, seqlen_q, seqlen_k = q.size(0), q.size(1), k.size(1)
    key_mask = key_mask.to(device=q.device, dtype=torch.bool)
    query_mask = key_mask[:, -seqlen_q:] if seqlen_q <= seqlen_k else None
    if query_mask is None or query_mask.shape != (batch, seqlen_q):
        raise ValueError(f"flashop (transformers): a padding mask of shape {list(key_mask.shape)} does not cover "
                         f"{seqlen_q} queries and {seqlen_k} keys")
    keys = key_mask.flatten().nonzero().flatten()
    queries = query_mask.flatten().nonzero().flatten()
    lengths_k, lengths_q = key_mask.sum(1), query_mask.sum(1)
    out = _varlen(q.flatten(0, 1).index_select(0, queries), k.flatten(0, 1).index_select(0, keys),
                  v.flatten(0, 1).index_select(0, keys), _cu_seqlens(lengths_q), _cu_seqlens(lengths_k),
                  lengths_q.max(), lengths_k.max(), options)
    full = out.new_zeros(batch * seqlen_q, *out.shape[1:])
    return full.index_copy(0, queries, out).unflatten(0, (batch, seqlen_q))


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention interface: query (batch, heads, seqlen_q, dim), key/value (batch, kv_heads,
    seqlen_k, dim), attention_mask None or a 2-D padding mask (what flash_attention_mask makes). Returns
    (output (batch, seqlen_q, heads, dim), None): flashop computes no attention weights."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"flashop (transformers): takes a 2-D padding mask (batch, seqlen_k), got a "
                         f"{attention_mask.dim()}-D attention_mask; custom masks need attn_implementation='sdpa'")
    # (batch, seq, heads, dim) views: the kernels read strided inputs, nothing is copied.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out_dtype = q.dtype
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # float32 reaches attention under autocast when a layer norm was kept in float32 (as PEFT does).
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    value_dim = v.size(-1)
    if value_dim != q.size(-1):  # MLA-style models: values narrower than queries; zero columns add nothing
        v = F.pad(v, (0, q.size(-1) - value_dim))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    options = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=_window(sliding_window, causal),
                   softcap=float(softcap or 0.0), deterministic=torch.are_deterministic_algorithms_enabled(),
                   learnable_sink=None if s_aux is None else s_aux.float())

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is not None:
        out = _padded_batch(q, k, v, attention_mask, options)
    elif cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        out = _varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q.to(torch.int32), cu_k.to(torch.int32),
                      max_q, max_k, options).unflatten(0, q.shape[:2])
    elif q.size(0) == 1 and q.size(1) == k.size(1) and (
            packed := _packed_from_position_ids(kwargs.get("position_ids"), q.size(1))):
        cu, longest = packed
        out = _varlen(q[0], k[0], v[0], cu, cu, longest, longest, options)[None]
    else:
        out = ops.flash_attn_func(q, k, v, **options)
    if value_dim != out.size(-1):
        out = out[..., :value_dim]
    return out.to(out_dtype), None


def _accept_as_selected(name):
    """transformers takes every implementation whose name contains "flash" for a FlashAttention package: when a
    model selects one it imports that package, and a model that lists the FlashAttention builds it works with
    (gpt-oss: those with sinks) swaps any other for one of them (PreTrainedModel._check_and_adjust_attn_implementation).
    flashop is no package to import and runs every feature those models need, so its names are taken as given."""
    _REGISTERED.add(name)
    check = PreTrainedModel._check_and_adjust_attn_implementation
    if getattr(check, "_flashop", False):
        return

    def check_and_adjust(self, attn_implementation, *args, **kwargs):
        if attn_implementation in _REGISTERED:
            return attn_implementation
        return check(self, attn_implementation, *args, **kwargs)

    check_and_adjust._flashop = True
    PreTrainedModel._check_and_adjust_attn_implementation = check_and_adjust


def register(name: str = NAME):
    """Registers flashop with transformers under `name` (done for "flashop" on import)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    if "flash" in name:
        _accept_as_selected(name)


register()
