"""Every bad input gets a clear error naming the argument and the expectation, in eager mode and at
trace time under torch.compile (from the fake kernel), with the same message."""
import pytest
import torch

import flashop

# Inline expected messages; machines without expecttest (an offline GPU box) skip this module.
expecttest = pytest.importorskip("expecttest")


def qkv(b=1, sq=8, sk=8, hq=2, hk=2, d=16, dtype=torch.float32):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, d, dtype=dtype))


def backward_args(**changes):
    q, k, v = qkv()
    out, lse = torch.ops.flashop.forward(q, k, v)
    args = dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, softmax_lse=lse)
    args.update(changes)
    return args


def forward_op(*args, **kwargs):
    return torch.ops.flashop.forward(*args, **kwargs)


def backward_op(*args, **kwargs):
    return torch.ops.flashop.backward(*args, **kwargs)


def strided_last_dim(t):
    return t.repeat_interleave(2, dim=-1)[..., ::2]


class TestOpErrors(expecttest.TestCase):
    def check(self, op, args, kwargs, expected):
        """The eager message is checked inline; the compiled (fake-kernel) one must carry the same text."""
        with self.assertRaises(RuntimeError) as eager:
            op(*args, **kwargs)
        message = str(eager.exception).splitlines()[0]
        self.assertExpectedInline(message, expected, skip=1)
        compiled = torch.compile(op, backend="aot_eager", fullgraph=True)
        with self.assertRaises(Exception) as traced:
            compiled(*args, **kwargs)
        self.assertIn(message, str(traced.exception))
        torch._dynamo.reset()

    def test_q_rank(self):
        q, k, v = qkv()
        self.check(forward_op, (q[0], k, v), {}, """flashop: q must be a 4-D tensor (batch, seqlen, nheads, headdim), got a 3-D tensor""")

    def test_k_rank(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k[None], v), {}, """flashop: k must be a 4-D tensor (batch, seqlen, nheads, headdim), got a 5-D tensor""")

    def test_v_rank(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k, v[0, 0]), {}, """flashop: v must be a 4-D tensor (batch, seqlen, nheads, headdim), got a 2-D tensor""")

    def test_integer_dtype(self):
        q, k, v = qkv()
        self.check(forward_op, (q.long(), k.long(), v.long()), {}, """flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int64""")

    def test_int32_dtype(self):
        q, k, v = qkv()
        self.check(forward_op, (q.int(), k, v), {}, """flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.int32""")

    def test_float64_dtype(self):
        q, k, v = qkv(dtype=torch.float64)
        self.check(forward_op, (q, k, v), {}, """flashop: q must have dtype torch.float32, torch.float16 or torch.bfloat16, got torch.float64""")

    def test_k_dtype_mismatch(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k.half(), v), {}, """flashop: k must have the dtype of q (torch.float32), got torch.float16""")

    def test_v_dtype_mismatch(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k, v.bfloat16()), {}, """flashop: v must have the dtype of q (torch.float32), got torch.bfloat16""")

    def test_kv_shape_mismatch(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k, v[:, :5]), {}, """flashop: k and v must have the same shape (batch, seqlen_k, nheads_k, headdim), got k [1, 8, 2, 16] and v [1, 5, 2, 16]""")

    def test_batch_mismatch(self):
        q, _, _ = qkv(b=2)
        _, k, v = qkv(b=3)
        self.check(forward_op, (q, k, v), {}, """flashop: k must have the batch size of q (2), got 3""")

    def test_headdim_mismatch(self):
        q, _, _ = qkv(d=32)
        _, k, v = qkv(d=16)
        self.check(forward_op, (q, k, v), {}, """flashop: k must have the headdim of q (32), got 16""")

    def test_headdim_too_large(self):
        self.check(forward_op, qkv(d=257), {}, """flashop: headdim must be between 1 and 256, got 257""")

    def test_headdim_zero(self):
        self.check(forward_op, qkv(d=0), {}, """flashop: headdim must be between 1 and 256, got 0""")

    def test_heads_not_multiple(self):
        self.check(forward_op, qkv(hq=6, hk=4), {}, """flashop: the number of query heads (6) must be a multiple of the number of key/value heads (4)""")

    def test_q_last_dim_strided(self):
        q, k, v = qkv()
        self.check(forward_op, (strided_last_dim(q), k, v), {}, """flashop: q must be contiguous in its last dimension (stride 1), got stride 2""")

    def test_v_last_dim_strided(self):
        q, k, v = qkv()
        self.check(forward_op, (q, k, strided_last_dim(v)), {}, """flashop: v must be contiguous in its last dimension (stride 1), got stride 2""")

    def test_softmax_scale_nan(self):
        self.check(forward_op, qkv(), {"softmax_scale": float("nan")}, """flashop: softmax_scale must be a finite number, got nan""")

    def test_bad_config_string(self):
        self.check(forward_op, qkv(), {"config": "bf16.d128.br128.bc64.w4"}, """flashop.forward: config 'bf16.d128.br128.bc64.w4' is not a CPU kernel config; the CPU backend has one kernel, config=None or 'cpu'""")

    def test_backward_dout_shape(self):
        args = backward_args()
        args["dout"] = args["dout"][:, :4]
        self.check(backward_op, (), args, """flashop: dout must have the shape of q [1, 8, 2, 16], got [1, 4, 2, 16]""")

    def test_backward_out_dtype(self):
        args = backward_args()
        args["out"] = args["out"].half()
        self.check(backward_op, (), args, """flashop: out must have the dtype of q (torch.float32), got torch.float16""")

    def test_backward_lse_shape(self):
        args = backward_args()
        args["softmax_lse"] = args["softmax_lse"].transpose(1, 2)
        self.check(backward_op, (), args, """flashop: softmax_lse must have shape (batch, nheads, seqlen_q) = [1, 2, 8], got [1, 8, 2]""")

    def test_backward_lse_dtype(self):
        args = backward_args()
        args["softmax_lse"] = args["softmax_lse"].double()
        self.check(backward_op, (), args, """flashop: softmax_lse must have dtype torch.float32, got torch.float64""")

    def test_backward_dout_last_dim_strided(self):
        args = backward_args()
        args["dout"] = strided_last_dim(args["dout"])
        self.check(backward_op, (), args, """flashop: dout must be contiguous in its last dimension (stride 1), got stride 2""")

    def test_backward_bad_config(self):
        self.check(backward_op, (), dict(backward_args(), config="fast"), """flashop.backward: config 'fast' is not a CPU kernel config; the CPU backend has one kernel, config=None or 'cpu'""")


class TestApiErrors(expecttest.TestCase):
    def check(self, exc_type, fn, expected):
        with self.assertRaises(exc_type) as caught:
            fn()
        self.assertExpectedInline(str(caught.exception), expected, skip=1)

    def test_dropout(self):
        self.check(NotImplementedError, lambda: flashop.flash_attn_func(*qkv(), dropout_p=0.1), """flashop: dropout_p=0.1 is not supported yet (only 0.0)""")

    def test_window(self):
        self.check(RuntimeError, lambda: flashop.flash_attn_func(*qkv(), window_size=(-3, 0)), """flashop: window_size_left must be -1 (unbounded) or >= 0, got -3""")

    def test_window_pair(self):
        self.check(ValueError, lambda: flashop.flash_attn_func(*qkv(), window_size=(4, 0, 1)), """flashop: window_size must be a pair (left, right), got (4, 0, 1)""")

    def test_softcap(self):
        self.check(RuntimeError, lambda: flashop.flash_attn_func(*qkv(), softcap=-30.0), """flashop: softcap must be a finite number >= 0 (0 is off), got -30""")

    def test_alibi_shape(self):
        self.check(RuntimeError, lambda: flashop.flash_attn_func(*qkv(), alibi_slopes=torch.ones(3)), """flashop: alibi_slopes must have shape (nheads,) = (2,) or (batch, nheads) = (1, 2), got [3]""")

    def test_sink_shape(self):
        self.check(RuntimeError, lambda: flashop.flash_attn_func(*qkv(), learnable_sink=torch.ones(1, 2)), """flashop: learnable_sink must have shape (nheads,) = (2,), got [1, 2]""")

    def test_qkvpacked_shape(self):
        self.check(ValueError, lambda: flashop.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 16)), """flashop: qkv must have shape (batch, seqlen, 3, nheads, headdim), got [1, 8, 2, 2, 16]""")

    def test_sdpa_attn_mask(self):
        q = torch.randn(1, 2, 8, 16)
        self.check(NotImplementedError,
                   lambda: flashop.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool)),
                   """flashop.scaled_dot_product_attention: attn_mask is not supported yet (use is_causal for causal masking)""")

    def test_sdpa_gqa_needs_flag(self):
        q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
        self.check(ValueError, lambda: flashop.scaled_dot_product_attention(q, k, k), """flashop.scaled_dot_product_attention: query has 4 heads and key 2; pass enable_gqa=True for grouped-query attention""")

    def test_sdpa_rank(self):
        q = torch.randn(2, 8, 16)
        self.check(ValueError, lambda: flashop.scaled_dot_product_attention(q, q, q), """flashop.scaled_dot_product_attention: query must be a 4-D tensor (batch, nheads, seqlen, headdim), got a 3-D tensor""")

    def test_module_varlen_cu_seqlens_dtype(self):
        module = flashop.modules.FlashSelfAttention()
        self.check(RuntimeError,
                   lambda: module(torch.randn(8, 3, 2, 16), cu_seqlens=torch.tensor([0, 8]), max_seqlen=8), """flashop: cu_seqlens_q must have dtype torch.int32, got torch.int64""")

    def test_varlen_cu_seqlens_end(self):
        q = torch.randn(8, 2, 16)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        self.check(RuntimeError, lambda: flashop.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4), """flashop: the last entry of cu_seqlens_q (7) must be the number of tokens (8)""")


