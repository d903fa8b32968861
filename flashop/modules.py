"""nn.Module drop-ins with the constructor and forward signatures of
flash_attn.modules.mha (FlashSelfAttention, FlashCrossAttention, MHA), so a
model swaps an import. Parameter names match too, so state dicts load."""
from __future__ import annotations

import math

import torch
from torch import nn

from .ops import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func,
                  flash_attn_varlen_qkvpacked_func)


def alibi_slopes(nheads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes, float32 (nheads,): the geometric sequence 2^(-8/n), 2^(-16/n), ...
    for n a power of two; otherwise those of the closest smaller power of two followed by every other
    slope of the next power of two."""
    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(nheads))
    slopes = power_of_two(closest)
    if closest != nheads:
        slopes += power_of_two(2 * closest)[0::2][: nheads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class _AttentionBase(nn.Module):
    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False, softcap=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.window_size = tuple(window_size)
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
        self.deterministic = deterministic
        self.softcap = softcap

    def _options(self, causal, learnable_sink):
        return dict(
            dropout_p=self.drop.p if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal if causal is None else causal,
            window_size=self.window_size,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            deterministic=self.deterministic,
            learnable_sink=learnable_sink,
        )


class FlashSelfAttention(_AttentionBase):
    """Scaled dot-product self-attention over packed qkv (batch, seqlen, 3, nheads, headdim), or with
    cu_seqlens (int32 (batch + 1,)) and max_seqlen a packed batch qkv (total, 3, nheads, headdim).
    learnable_sink: optional float32 (nheads,) attention sinks (e.g. the owning layer's parameter)."""

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None, learnable_sink=None):
        if cu_seqlens is not None:
            return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **self._options(causal, learnable_sink))
        return flash_attn_qkvpacked_func(qkv, **self._options(causal, learnable_sink))


class FlashCrossAttention(_AttentionBase):
    """Attention of q (batch, seqlen_q, nheads, headdim) over kv (batch, seqlen_k, 2, nheads_k, headdim), or
    with cu_seqlens / cu_seqlens_k a packed batch: q (total_q, nheads, headdim), kv (total_k, 2, nheads_k,
    headdim). learnable_sink: optional float32 (nheads,) attention sinks."""

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None,
                learnable_sink=None):
        if cu_seqlens is not None:
            return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                   **self._options(causal, learnable_sink))
        return flash_attn_kvpacked_func(q, kv, **self._options(causal, learnable_sink))


class MHA(nn.Module):
    """Multi-head (and grouped-query) attention layer: projections + flashop attention + output projection.

    use_alibi: the ALiBi paper's slopes per head (alibi_slopes). Beyond flash_attn's MHA: softcap (Gemma 2's
    logit soft-capping) and use_sinks, a learnable float32 attention sink per head (`sinks`, gpt-oss's),
    initialised to zero."""

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None,
                 rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), fused_bias_fc=False,
                 use_flash_attn=True, return_residual=False, checkpointing=False, device=None, dtype=None,
                 softcap=0.0, use_sinks=False):
        super().__init__()
        unsupported = {"dwconv": dwconv, "rotary_emb_dim": rotary_emb_dim,
                       "fused_bias_fc": fused_bias_fc, "return_residual": return_residual,
                       "checkpointing": checkpointing}
        for name, value in unsupported.items():
            if value:
                raise NotImplementedError(f"flashop.modules.MHA: {name}={value!r} is not supported yet")
        self.num_heads_kv = num_heads_kv if num_heads_kv is not None else num_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"flashop.modules.MHA: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % self.num_heads_kv != 0:
            raise ValueError(f"flashop.modules.MHA: num_heads ({num_heads}) must be a multiple of num_heads_kv "
                             f"({self.num_heads_kv})")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.head_dim = embed_dim // num_heads
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        factory = {"device": device, "dtype": dtype}
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, embed_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, embed_dim + kv_dim, bias=qkv_proj_bias, **factory)
        slopes = alibi_slopes(num_heads).to(device) if use_alibi else None
        attention = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                         window_size=window_size, alibi_slopes=slopes, softcap=softcap)
        self.inner_attn = FlashSelfAttention(**attention)
        self.inner_cross_attn = FlashCrossAttention(**attention)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device)) if use_sinks else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
                inference_params=None, **kwargs):
        """x (batch, seqlen, embed_dim), or (total, embed_dim) with cu_seqlens (int32 (batch + 1,)) and
        max_seqlen; x_kv (batch, seqlen_k, embed_dim) with cross_attn."""
        if cu_seqlens is not None and self.cross_attn:
            raise NotImplementedError("flashop.modules.MHA: cu_seqlens with cross_attn is not supported")
        packed = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen) if cu_seqlens is not None else {}
        for name, value in (("key_padding_mask", key_padding_mask), ("mixer_subset", mixer_subset),
                            ("inference_params", inference_params)):
            if value is not None:
                raise NotImplementedError(f"flashop.modules.MHA: {name} is not supported yet")
        hd = self.head_dim
        if self.cross_attn:
            if x_kv is None:
                raise ValueError("flashop.modules.MHA: cross_attn=True needs x_kv")
            q = self.Wq(x).unflatten(-1, (self.num_heads, hd))
            kv = self.Wkv(x_kv).unflatten(-1, (2, self.num_heads_kv, hd))
            context = self.inner_cross_attn(q, kv, learnable_sink=self.sinks)
        else:
            qkv = self.Wqkv(x)
            if self.num_heads_kv == self.num_heads:
                context = self.inner_attn(qkv.unflatten(-1, (3, self.num_heads, hd)), learnable_sink=self.sinks,
                                          **packed)
            else:
                q = qkv[..., : self.embed_dim].unflatten(-1, (self.num_heads, hd))
                kv = qkv[..., self.embed_dim:].unflatten(-1, (2, self.num_heads_kv, hd))
                if packed:
                    packed.update(cu_seqlens_k=cu_seqlens, max_seqlen_k=max_seqlen)
                context = self.inner_cross_attn(q, kv, learnable_sink=self.sinks, **packed)
        return self.out_proj(context.flatten(-2))
