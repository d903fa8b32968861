"""Packed (variable-length) batches: flash_attn_varlen_* against the float64 reference run sequence by
sequence, with empty sequences, seqused, GQA, Sq != Sk per sequence and the attention variants; argument
errors; compile with changing batch composition; opcheck; the modules."""
import pytest
import torch

import flashop
from conftest import DEVICES
from reference import (assert_close_to_reference, assert_grad_close_to_reference, attention_reference,
                       sink_grad_from_output)
from test_forward import DTYPES


def cu_seqlens(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def packed_inputs(lens_q, lens_k, heads_q, heads_k, headdim, dtype, device):
    q = torch.randn(sum(lens_q), heads_q, headdim, dtype=dtype, device=device)
    k, v = (torch.randn(sum(lens_k), heads_k, headdim, dtype=dtype, device=device) for _ in range(2))
    return q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)


def per_sequence_reference(q, k, v, cu_q, cu_k, used_q, used_k, upcast, **variant):
    """out (total_q, H, D) and lse (H, total_q) from the dense reference on each sequence's used tokens; the other
    rows 0 and -inf. Differentiable in q, k, v and the sink."""
    outs, lses = [], []
    slopes = variant.pop("alibi_slopes", None)
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        n_q, n_k = int(used_q[b]), int(used_k[b])
        seq_slopes = None if slopes is None else (slopes[b] if slopes.dim() == 2 else slopes)
        out, lse = attention_reference(q[None, q0:q0 + n_q], k[None, k0:k0 + n_k], v[None, k0:k0 + n_k],
                                       upcast=upcast, alibi_slopes=seq_slopes, **variant)
        pad = q1 - q0 - n_q
        outs += [out[0], out.new_zeros(pad, *out.shape[2:])]
        lses += [lse[0], lse.new_full((lse.size(1), pad), float("-inf"))]
    return torch.cat(outs), torch.cat(lses, dim=1)


CASES = [  # (lens_q, lens_k, heads_q, heads_k, headdim, causal, window, softcap, alibi, sink, seqused)
    ([37, 0, 90, 1], [37, 5, 90, 64], 4, 2, 64, True, (-1, -1), 0.0, None, False, False),
    ([70, 129, 3], [200, 40, 3], 2, 2, 40, False, (-1, -1), 0.0, None, False, False),
    ([64, 80], [64, 150], 4, 1, 32, True, (24, -1), 0.0, "batch", True, False),
    ([50, 17, 33], [50, 30, 99], 2, 1, 59, False, (9, 4), 15.0, "head", False, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}seqs-d{c[4]}")
def test_varlen_matches_per_sequence_reference(device, dtype, case):
    lens_q, lens_k, hq, hk, d, causal, window, softcap, alibi, sink, seqused = case
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hk, d, dtype, device)
    batch = len(lens_q)
    slopes = {None: None, "head": torch.rand(hq, device=device), "batch": torch.rand(batch, hq, device=device)}[alibi]
    sinks = torch.randn(hq, device=device) if sink else None
    used_q = torch.tensor([n // 2 for n in lens_q], dtype=torch.int32, device=device) if seqused else None
    used_k = torch.tensor([n - n // 3 for n in lens_k], dtype=torch.int32, device=device) if seqused else None
    args = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)

    def ours(q, k, v, sinks):
        return flashop.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True,
                                              learnable_sink=sinks, seqused_q=used_q, seqused_k=used_k, **args)

    if device == "cuda":  # the CUDA kernels take no packed batches yet: a clear refusal, not a wrong answer
        with pytest.raises(NotImplementedError, match="packed batches \\(cu_seqlens\\) run on the CPU backend only"):
            ours(q, k, v, sinks)
        return

    def reference(q, k, v, sinks, upcast):
        return per_sequence_reference(q, k, v, cu_q, cu_k, used_q if seqused else torch.tensor(lens_q),
                                      used_k if seqused else torch.tensor(lens_k), upcast, learnable_sink=sinks,
                                      **dict(args))

    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sink else [])
    out, lse, _ = ours(q, k, v, sinks)
    assert out.shape == q.shape and lse.shape == (hq, q.size(0))
    ref_out, ref_lse = reference(q, k, v, sinks, True)
    lowp_out, _ = reference(q, k, v, sinks, False)
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=1e-3, rtol=1e-3)

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    lowp_grads = torch.autograd.grad(lowp_out, leaves, dout)
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_grad_close_to_reference(g, r, lp, name)
    if sink:
        if dtype == torch.float32:
            assert_grad_close_to_reference(grads[3], ref_grads[3], lowp_grads[3], "dsink")
        else:
            torch.testing.assert_close(grads[3].double(), sink_grad_from_output(dout, out, ref_lse, sinks),
                                       rtol=1e-3, atol=1e-5)


def test_varlen_deterministic_and_packed_variants():
    q, k, v, cu_q, cu_k = packed_inputs([30, 70], [30, 70], 4, 2, 64, torch.bfloat16, "cpu")
    kv = torch.stack([k, v], dim=1)
    qkv = torch.stack([q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)], dim=1)
    dense = flashop.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=True, deterministic=True)
    assert torch.equal(dense, flashop.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 70, 70, causal=True))
    expanded = flashop.flash_attn_varlen_func(q, qkv[:, 1], qkv[:, 2], cu_q, cu_q, 70, 70, causal=True)
    assert torch.equal(expanded, flashop.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 70, causal=True))
    # One sequence of a packed batch is the dense problem on its rows.
    one = flashop.flash_attn_func(q[None, 30:], k[None, 30:], v[None, 30:], causal=True)[0]
    torch.testing.assert_close(dense[30:], one, atol=0, rtol=0)


BAD = [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 8])), "cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    (dict(cu_seqlens_q=torch.tensor([[0, 4, 8]], dtype=torch.int32)), "cu_seqlens_q must have shape"),
    (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), "cu_seqlens_k must have shape \\(batch \\+ 1,\\) = "
                                                                 "\\(3,\\), got \\[2\\]"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 4], dtype=torch.int32), max_seqlen_q=None),
     "cu_seqlens_q must not decrease, got 5 then 4"),
    (dict(cu_seqlens_q=torch.tensor([1, 4, 8], dtype=torch.int32)), "cu_seqlens_q must start at 0, got 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32), max_seqlen_k=5), "the last entry of cu_seqlens_k \\(9\\) must be "
                                                                    "the number of tokens \\(8\\)"),
    (dict(max_seqlen_q=3), "max_seqlen_q \\(3\\) is smaller than sequence 0's length 4"),
    (dict(seqused_k=torch.tensor([5, 1], dtype=torch.int32)), "seqused_k\\[0\\] \\(5\\) must be between 0 and the "
                                                              "sequence's length 4"),
    (dict(seqused_q=torch.tensor([1], dtype=torch.int32)), "seqused_q must have shape \\(batch,\\) = \\(2,\\)"),
    (dict(cu_seqlens_k=None), "cu_seqlens_q and cu_seqlens_k must be given together"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_cu_seqlens_are_named(change, message):
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.flashop.forward(q, q, q, **args)


def test_bad_packed_tensors_fail_at_trace_time_too():
    q4 = torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)

    def call(q, cu):
        return torch.ops.flashop.forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)

    for fn in (call, torch.compile(call, fullgraph=True, backend="eager")):
        with pytest.raises(Exception, match="with cu_seqlens, q must be a 3-D tensor \\(total_q, nheads, headdim\\)"):
            fn(q4, cu)
        with pytest.raises(Exception, match="cu_seqlens_q must have dtype torch.int32"):
            fn(q4[0], cu.long())


def test_compile_varlen_no_recompile_as_the_batch_changes():
    counts = torch._dynamo.utils.counters
    counts.clear()

    def step(q, k, v, cu, max_seqlen):
        out = flashop.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lengths in ([40, 24], [7, 90, 33], [128], [5, 5, 5, 70]):
        q, k, v, cu, _ = packed_inputs(lengths, lengths, 4, 2, 32, torch.float32, "cpu")
        q.requires_grad_()
        loss = compiled(q, k, v, cu, max(lengths))
        loss.backward()
        torch.testing.assert_close(loss, step(q.detach(), k, v, cu, max(lengths)))
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


def test_opcheck_varlen():
    q, k, v, cu_q, cu_k = packed_inputs([20, 0, 33], [25, 3, 33], 4, 2, 32, torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_()
    sink = torch.randn(4, requires_grad=True)
    used = torch.tensor([10, 0, 33], dtype=torch.int32)
    args = (q, k, v, None, True, None, False, 8, -1, 0.0, None, sink, cu_q, cu_k, 33, 33, used, None)
    torch.library.opcheck(torch.ops.flashop.forward.default, args)
    out, lse = torch.ops.flashop.forward(*args)
    torch.library.opcheck(torch.ops.flashop.backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, True,
                           None, False, 8, -1, 0.0, None, cu_q, cu_k, 33, 33, used, None))


def test_modules_take_cu_seqlens():
    torch.manual_seed(0)
    lengths = [12, 30, 5]
    cu = cu_seqlens(lengths, "cpu")
    for heads_kv in (4, 2):
        mha = flashop.modules.MHA(64, 4, num_heads_kv=heads_kv, causal=True)
        x = torch.randn(sum(lengths), 64)
        packed = mha(x, cu_seqlens=cu, max_seqlen=max(lengths))
        for b, n in enumerate(lengths):
            start = int(cu[b])
            torch.testing.assert_close(packed[start:start + n], mha(x[None, start:start + n])[0], atol=1e-5, rtol=1e-5)
