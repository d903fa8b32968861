"""Packed (variable-length) batches: flash_attn_varlen_* against the float64 reference run sequence by
sequence, with empty sequences, seqused, GQA, Sq != Sk per sequence and the attention variants; argument
errors; compile with changing batch composition; opcheck; the modules."""
import pytest
import torch

import flashop
from conftest import CUDA, DEVICES, assert_cuda_refuses
from flashop import dispatch
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

    if device == "cuda" and dtype == torch.float32:
        assert_cuda_refuses(lambda: ours(q, k, v, sinks))
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


# ---------------------------------------------------------------- CUDA (mma.sync kernels)

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


def check_packed(lens_q, lens_k, hq, hk, d, dtype, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                 sink=False, seqused=False, deterministic=False, config=None, bwd_config=None, grads=True):
    """A packed batch on CUDA against the float64 reference sequence by sequence: out, lse and (grads) dq,
    dk, dv (and dsink). Returns the gradients."""
    device = "cuda"
    q, k, v, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hk, d, dtype, device)
    batch = len(lens_q)
    slopes = {None: None, "head": torch.rand(hq, device=device),
              "batch": torch.rand(batch, hq, device=device)}[alibi]
    sinks = torch.randn(hq, device=device) if sink else None
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    used_q = (torch.tensor([int(torch.randint(0, n + 1, (), generator=gen)) for n in lens_q], dtype=torch.int32)
              if seqused else torch.tensor(lens_q, dtype=torch.int32))
    used_k = (torch.tensor([int(torch.randint(0, n + 1, (), generator=gen)) for n in lens_k], dtype=torch.int32)
              if seqused else torch.tensor(lens_k, dtype=torch.int32))
    args = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sink else [])

    out, lse = torch.ops.flashop.forward(
        q, k, v, None, causal, config, deterministic, *window, softcap, slopes, sinks, cu_q, cu_k, max(lens_q),
        max(lens_k), used_q.to(device) if seqused else None, used_k.to(device) if seqused else None)
    assert out.shape == q.shape and lse.shape == (hq, q.size(0))
    ref_out, ref_lse = per_sequence_reference(q, k, v, cu_q, cu_k, used_q, used_k, True, learnable_sink=sinks,
                                              **dict(args))
    lowp_out, _ = per_sequence_reference(q, k, v, cu_q, cu_k, used_q, used_k, False, learnable_sink=sinks,
                                         **dict(args))
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty].float(), atol=1e-3, rtol=1e-3)
    if not grads:
        return None
    dout = torch.randn_like(out)
    dq, dk, dv = torch.ops.flashop.backward(
        dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, causal, bwd_config, deterministic,
        *window, softcap, slopes, cu_q, cu_k, max(lens_q), max(lens_k), used_q.to(device) if seqused else None,
        used_k.to(device) if seqused else None)
    ref_grads = torch.autograd.grad(ref_out, leaves[:3], dout.double(), retain_graph=True)
    lowp_grads = torch.autograd.grad(lowp_out, leaves[:3], dout)
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, lowp_grads):
        assert_grad_close_to_reference(g, r, lp, name)
    if sink:  # through autograd: the op's sink gradient
        out2 = flashop.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), learnable_sink=sinks,
                                              seqused_q=used_q.to(device) if seqused else None,
                                              seqused_k=used_k.to(device) if seqused else None,
                                              deterministic=deterministic, **args)
        dsink = torch.autograd.grad(out2, sinks, dout)[0]
        torch.testing.assert_close(dsink.double(), sink_grad_from_output(dout, out2, ref_lse, sinks),
                                   rtol=1e-3, atol=1e-4)
    return dq, dk, dv


def mixed_lengths(batch, zero=True):
    """Lengths 1..300, one of them 0 (zero=True)."""
    lens = torch.randint(1, 301, (batch,)).tolist()
    if zero:
        lens[int(torch.randint(0, batch, ()))] = 0
    return lens


CUDA_VARIANTS = {  # name: check_packed keyword arguments
    "dense": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(40, 7)),
    "causal_left": dict(causal=True, window=(33, 0)),
    "softcap": dict(softcap=20.0),
    "alibi_batch": dict(alibi="batch", causal=True),
    "alibi_head": dict(alibi="head"),
    "sink": dict(sink=True, causal=True),
    "seqused": dict(seqused=True),
    "seqused_causal_sink": dict(seqused=True, causal=True, sink=True),
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("headdim", [59, 64, 128, 256])
@pytest.mark.parametrize("variant", list(CUDA_VARIANTS))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_varlen_cuda_matches_reference(dtype, headdim, variant, gqa):
    lens_q = mixed_lengths(5)
    lens_k = [n if i % 2 else int(torch.randint(1, 301, ())) for i, n in enumerate(lens_q)]
    hq, hk = (6, 2) if gqa else (3, 3)
    check_packed(lens_q, lens_k, hq, hk, headdim, dtype, **CUDA_VARIANTS[variant])


@needs_cuda
@pytest.mark.parametrize("variant", ["dense", "causal", "window", "seqused_causal_sink"])
def test_varlen_cuda_deterministic_is_bit_identical(variant):
    lens = mixed_lengths(4)
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    state = torch.cuda.get_rng_state(), torch.get_rng_state()
    first = check_packed(lens, lens, 4, 2, 128, torch.bfloat16, deterministic=True, **CUDA_VARIANTS[variant])
    torch.cuda.set_rng_state(state[0])
    torch.set_rng_state(state[1])
    second = check_packed(lens, lens, 4, 2, 128, torch.bfloat16, deterministic=True, **CUDA_VARIANTS[variant])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_cuda
def test_varlen_cuda_edge_lengths():
    """Every sequence empty in q or k, single tokens, lengths at tile edges, one query with many keys."""
    for lens_q, lens_k in (([0, 0], [5, 0]), ([1, 1, 1], [1, 300, 0]), ([64, 128, 129, 127], [64, 128, 129, 127]),
                           ([1], [300]), ([300], [1])):
        for causal in (False, True):
            check_packed(lens_q, lens_k, 2, 1, 64, torch.float16, causal=causal)


def _built_mma_sync(direction):
    return [n for n in dispatch.built_configs(direction) if not n.startswith("sm90.")]


@needs_cuda
@pytest.mark.parametrize("config", _built_mma_sync("forward") if CUDA else [])
def test_varlen_cuda_every_mma_sync_forward_config(config):
    dtype_code, width = dispatch.dtype_and_headdim(config)
    dtype = torch.float16 if dtype_code == "fp16" else torch.bfloat16
    lens = mixed_lengths(3)
    for kwargs in (dict(causal=True, seqused=True), dict(window=(20, 3), sink=True)):
        check_packed(lens, lens[::-1], 2, 1, width - 8 if width > 32 else width, dtype, config=config, grads=False,
                     **kwargs)


@needs_cuda
@pytest.mark.parametrize("config", _built_mma_sync("backward") if CUDA else [])
def test_varlen_cuda_every_mma_sync_backward_config(config):
    dtype_code, width = dispatch.dtype_and_headdim(config)
    dtype = torch.float16 if dtype_code == "fp16" else torch.bfloat16
    lens = mixed_lengths(3)
    for deterministic in (False, True):
        check_packed(lens, lens[::-1], 2, 1, width, dtype, causal=True, seqused=True, bwd_config=config,
                     deterministic=deterministic)


# ---------------------------------------------------------------- dispatch

def test_packed_problems_go_to_configs_that_run_them(monkeypatch):
    """A packed batch rules out the kernels without packed batches (supports_packed: the Hopper forward
    configs without a variants build, the Hopper backward B_c = 96 ones) in the policy's pick, and a named one is refused with its name (eager and fake kernels share
    check_config)."""
    from test_dispatch import ALL_BUILT, ALL_BUILT_BACKWARD, DEVICES as PARTS
    for direction, built in (("forward", ALL_BUILT), ("backward", ALL_BUILT_BACKWARD)):
        for seqlen in (128, 4096):
            for causal in (False, True):
                problem = dispatch.Problem("bf16", 128, seqlen, seqlen, 64, causal, direction, packed=True)
                name, _ = dispatch.choose_config(PARTS["H100"], problem, built)
                assert dispatch.runs_packed(dispatch.parse_config(name)), name
        refusing = [n for n in built if not dispatch.runs_packed(dispatch.parse_config(n))
                    and dispatch.dtype_and_headdim(n) == ("bf16", 128)]
        runs = [n for n in built if dispatch.runs_packed(dispatch.parse_config(n))
                and dispatch.dtype_and_headdim(n) == ("bf16", 128)]
        assert runs
        monkeypatch.setattr(dispatch, "_built", lambda _direction, built=built: built)
        for name in refusing:
            with pytest.raises(RuntimeError, match=f"'{name}' does not run packed batches"):
                dispatch.check_config(name, torch.device("cuda"), torch.bfloat16, 128, direction, packed=True)
            dispatch.check_config(name, torch.device("cuda"), torch.bfloat16, 128, direction)  # dense: fine
        for name in runs:
            dispatch.check_config(name, torch.device("cuda"), torch.bfloat16, 128, direction, packed=True)


def test_packed_backward_takes_the_wgmma_kernel_on_hopper():
    """On compute capability 9.0 a packed backward goes to the Hopper backward as a dense one does (same width,
    causal or not, GQA); at d192 to B_c = 64, the B_c = 96 build (the dense default) having no packed build.
    Elsewhere it stays on mma.sync."""
    from test_dispatch import ALL_BUILT_BACKWARD, DEVICES as PARTS
    for headdim in dispatch.HOPPER_BACKWARD_HEADDIMS:
        for causal in (False, True):
            for dtype in ("bf16", "fp16"):
                dense = dispatch.Problem(dtype, headdim, 2048, 2048, 16, causal, "backward")
                packed = dispatch.Problem(dtype, headdim, 2048, 2048, 16, causal, "backward", packed=True)
                dense_name = dispatch.choose_config(PARTS["H100"], dense, ALL_BUILT_BACKWARD)[0]
                name = dispatch.choose_config(PARTS["H100"], packed, ALL_BUILT_BACKWARD)[0]
                assert name.startswith("sm90.bwd.") and dispatch.runs_packed(dispatch.parse_config(name)), name
                expected = dense_name.replace(".bc96", ".bc64")
                assert name == expected, (name, dense_name)
                assert dispatch.choose_config(PARTS["A100"], packed, ALL_BUILT_BACKWARD)[0].startswith("bwd.")
