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

    assert_packed_call_matches(ours, reference, q, k, v, sinks, ("dq", "dk", "dv"))


def assert_packed_call_matches(ours, reference, q, k, v, sinks, grad_names, out_factor=2):
    """ours(q, k, v, sinks) -> (out, lse, _) of a packed batch against reference(q, k, v, sinks, upcast): out,
    lse (-inf exactly where the reference's is), and the gradients of q, k, v (named grad_names) and the sinks."""
    dtype, hq = q.dtype, q.size(1)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    out, lse, _ = ours(q, k, v, sinks)
    assert out.shape == q.shape and lse.shape == (hq, q.size(0))
    ref_out, ref_lse = reference(q, k, v, sinks, True)
    lowp_out, _ = reference(q, k, v, sinks, False)
    assert_close_to_reference(out, ref_out, lowp_out, "out", factor=out_factor)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty].float(), atol=1e-3, rtol=1e-3)

    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
    lowp_grads = torch.autograd.grad(lowp_out, leaves, dout)
    for name, g, r, lp in zip(grad_names, grads, ref_grads, lowp_grads):
        assert_grad_close_to_reference(g, r, lp, name)
    if sinks is not None:
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


# ---------------------------------------------------------------- paged KV cache (block_table)

def paged_kv(lens_k, heads_k, headdim, page_size, dtype, device, spare_slots=1, stale=True):
    """A paged cache holding sequences of lens_k keys: k and v (num_blocks, page_size, nheads_k, headdim) with the
    pages in random order (three more pages than the sequences use, holding noise), a block table (batch,
    max_blocks) int32 with spare_slots entries past the longest sequence's pages, every entry past a sequence's
    pages stale (outside the cache, negative or too large) when stale, else a valid page. Also returns the
    (page, row) of every sequence's positions in order, packed (total_k,) each."""
    pages = [-(-n // page_size) for n in lens_k]
    max_blocks = max(pages, default=0) + spare_slots
    num_blocks = sum(pages) + 3
    k, v = (torch.randn(num_blocks, page_size, heads_k, headdim, dtype=dtype, device=device) for _ in range(2))
    order = torch.randperm(num_blocks)
    table = torch.randint(0, num_blocks, (len(lens_k), max_blocks))
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start:start + n]
        start += n
        if stale:
            unused = max_blocks - n
            too_large = num_blocks + torch.randint(0, 1000, (unused,))
            table[b, n:] = torch.where(torch.rand(unused) < 0.5, -1 - torch.randint(0, 1000, (unused,)), too_large)
    positions = [torch.arange(n) for n in lens_k]
    page_of = torch.cat([table[b, p // page_size] for b, p in enumerate(positions)]).long().to(device)
    row_of = torch.cat([p % page_size for p in positions]).to(device)
    return k, v, table.to(torch.int32).to(device), page_of, row_of


PAGED_CASES = {  # name: (lens_q, lens_k, heads_q, heads_k, headdim, page_size, keyword arguments)
    # seqused_k: a partial last page (33, 50), exactly one page (16), no key at all (0) with queries, Sq != Sk.
    "page16_gqa_causal": ([1, 7, 3, 20], [33, 16, 0, 50], 4, 2, 64, 16, dict(causal=True)),
    # The key counts from cu_seqlens_k (FlashAttention-2's form), not seqused_k.
    "page64_cu_seqlens_k": ([10, 5, 1], [100, 64, 7], 2, 2, 40, 64, dict(from_cu_seqlens_k=True)),
    "page256_mqa_causal": ([30, 2], [300, 256], 6, 1, 32, 256, dict(causal=True)),
    "page16_window_softcap": ([12, 40], [70, 40], 4, 2, 32, 16, dict(window_size=(17, 3), softcap=10.0)),
    "page64_alibi_causal": ([9, 1, 20], [130, 1, 20], 4, 2, 64, 64, dict(causal=True, alibi=True)),
    "page16_sink_seqused_q": ([16, 8], [40, 8], 2, 1, 32, 16, dict(causal=True, window_size=(10, 0), sink=True,
                                                                  seqused_q=True)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_varlen_matches_per_sequence_reference(device, dtype, case):
    """flash_attn_varlen_func over a paged cache with shuffled pages and stale unused table entries: out, lse and
    the gradients of q, the pages of k and v (and the sinks) against the float64 reference on each sequence's
    keys read from its pages."""
    lens_q, lens_k, hq, hk, d, page_size, kwargs = PAGED_CASES[case]
    kwargs = dict(kwargs)
    from_cu, alibi, sink, seqused = (kwargs.pop(n, False) for n in ("from_cu_seqlens_k", "alibi", "sink", "seqused_q"))
    batch = len(lens_q)
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=device)
    k, v, table, page_of, row_of = paged_kv(lens_k, hk, d, page_size, dtype, device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    used_k = torch.tensor(lens_k, dtype=torch.int32, device=device)
    used_q = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32, device=device) if seqused else None
    slopes = torch.rand(batch, hq, device=device) if alibi else None
    sinks = torch.randn(hq, device=device) if sink else None
    variant = dict(kwargs, alibi_slopes=slopes)

    def ours(q, k, v, sinks):
        return flashop.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k if from_cu else None, max(lens_q), max(lens_k), return_attn_probs=True,
            block_table=table, learnable_sink=sinks, seqused_q=used_q, seqused_k=None if from_cu else used_k,
            **variant)

    if device == "cuda" and dtype == torch.float32:
        assert_cuda_refuses(lambda: ours(q, k, v, sinks))
        return

    def reference(q, k, v, sinks, upcast):
        keys, values = k[page_of, row_of], v[page_of, row_of]  # each sequence's positions, packed
        return per_sequence_reference(q, keys, values, cu_q, cu_k, used_q if seqused else torch.tensor(lens_q),
                                      torch.tensor(lens_k), upcast, learnable_sink=sinks, **dict(variant))

    assert_packed_call_matches(ours, reference, q, k, v, sinks, ("dq", "dk_pages", "dv_pages"),
                               out_factor=3 if alibi else 2)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_varlen_seqused_k_overrides_cu_seqlens_k_and_takes_a_strided_table(device):
    """seqused_k decides the key counts when cu_seqlens_k is given too (FlashAttention-2); cu_seqlens_k=None with
    seqused_k (vLLM's call); a column slice of a wider table (vLLM's cascade suffix) reads the same pages as its
    contiguous copy; stale entries never change the result."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens_q, lens_k = [3, 1, 6], [40, 17, 6]
    q = torch.randn(sum(lens_q), 4, 64, dtype=dtype, device=device)
    k, v, table, _, _ = paged_kv(lens_k, 2, 64, 16, dtype, device, spare_slots=2)
    cu_q, used = cu_seqlens(lens_q, device), torch.tensor(lens_k, dtype=torch.int32, device=device)
    call = lambda table, cu_k, used: flashop.flash_attn_varlen_func(  # noqa: E731
        q, k, v, cu_q, cu_k, max(lens_q), None, causal=True, block_table=table, seqused_k=used)
    expected = call(table, None, used)
    assert torch.equal(call(table, cu_seqlens([0, 0, 0], device), used), expected)
    assert torch.equal(call(table, cu_seqlens(lens_k, device), None), expected)
    wider = torch.cat([torch.full_like(table[:, :2], 10**6), table], dim=1)
    assert not wider[:, 2:].is_contiguous()
    assert torch.equal(call(wider[:, 2:], None, used), expected)
    restaled = table.clone()
    restaled[:, -2:] = -7
    assert torch.equal(call(restaled, None, used), expected)


def _paged_bad_calls():
    q = torch.randn(8, 4, 32)
    pages = torch.randn(4, 16, 2, 32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    used = torch.tensor([20, 5], dtype=torch.int32)
    base = dict(q=q, k=pages, v=pages, cu_seqlens_q=cu, cu_seqlens_k=None, max_seqlen_q=4, max_seqlen_k=32,
                block_table=table, seqused_k=used)
    return base, {  # name: (changed keyword arguments, the message)
        "table dtype": (dict(block_table=table.long()), "block_table must have dtype torch.int32, got torch.int64"),
        "table batch": (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)),
                        "block_table must have shape \\(batch, max_blocks\\) with batch = 2, got \\[3, 2\\]"),
        "table rank": (dict(block_table=table.flatten()), "block_table must have shape \\(batch, max_blocks\\)"),
        "page size": (dict(k=pages[:, :8], v=pages[:, :8]),
                      "with block_table, the page size \\(k.size\\(1\\)\\) must be a multiple of 16"),
        "k rank": (dict(k=pages.flatten(0, 1), v=pages.flatten(0, 1)),
                   "with block_table, k must be a 4-D tensor \\(num_blocks, page_size, nheads_k, headdim\\), got a "
                   "3-D tensor"),
        "k dtype": (dict(k=pages.half()), "k must have the dtype of q \\(torch.float32\\), got torch.float16"),
        "v shape": (dict(v=pages[:3]), "k and v must have the same shape \\(num_blocks, page_size, nheads_k, "
                                       "headdim\\)"),
        "headdim": (dict(k=pages[..., :16], v=pages[..., :16]), "k must have the headdim of q \\(32\\), got 16"),
        "heads": (dict(k=torch.randn(4, 16, 3, 32), v=torch.randn(4, 16, 3, 32)),
                  "the number of query heads \\(4\\) must be a multiple of the number of key/value heads \\(3\\)"),
        "no key counts": (dict(seqused_k=None), "with block_table, each sequence's key count comes from seqused_k"),
        "seqused_k dtype": (dict(seqused_k=used.long()), "seqused_k must have dtype torch.int32, got torch.int64"),
        "seqused_k shape": (dict(seqused_k=used[:1]), "seqused_k must have shape \\(batch,\\) = \\(2,\\), got \\[1\\]"),
        "cu_seqlens_k shape": (dict(cu_seqlens_k=cu[:2]), "cu_seqlens_k must have shape \\(batch \\+ 1,\\) = \\(3,\\)"),
        "cu_seqlens_q dtype": (dict(cu_seqlens_q=cu.long()), "cu_seqlens_q must have dtype torch.int32"),
        # Index values: eager (and at run time of a compiled call), where they can be read.
        "seqused_k past the pages": (dict(seqused_k=torch.tensor([33, 5], dtype=torch.int32)),
                                     "each sequence's key count \\(seqused_k\\) must lie in \\[0, 32\\] \\(max_blocks "
                                     "\\* page_size, the positions of its block_table pages\\), got 33 at b = 0"),
        "negative cu_seqlens_k count": (dict(seqused_k=None, cu_seqlens_k=torch.tensor([0, 9, 4], dtype=torch.int32)),
                                        "key count \\(cu_seqlens_k\\[b \\+ 1\\] - cu_seqlens_k\\[b\\]\\) must lie in "
                                        "\\[0, 32\\] .*got -5 at b = 1"),
        "max_seqlen_k": (dict(max_seqlen_k=19), "max_seqlen_k \\(19\\) is smaller than sequence 0's key count 20"),
        "page out of range": (dict(block_table=torch.tensor([[0, 1], [4, 3]], dtype=torch.int32)),
                              "block_table entries of the pages in use must index k's 4 blocks, got "
                              "block_table\\[1, 0\\] = 4"),
        "negative page": (dict(block_table=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)),
                          "must index k's 4 blocks, got block_table\\[0, 1\\] = -1"),
        "cu_seqlens_q values": (dict(cu_seqlens_q=torch.tensor([1, 4, 8], dtype=torch.int32)),
                                "cu_seqlens_q must start at 0, got 1"),
    }


@pytest.mark.parametrize("case", list(_paged_bad_calls()[1]))
def test_paged_varlen_bad_arguments_are_named(case):
    base, cases = _paged_bad_calls()
    change, message = cases[case]
    with pytest.raises(RuntimeError, match=message):
        flashop.flash_attn_varlen_func(**dict(base, **change))


@pytest.mark.parametrize("case", ["table dtype", "table batch", "page size", "k rank", "k dtype", "headdim", "heads",
                                  "no key counts", "seqused_k shape", "cu_seqlens_k shape", "page out of range"])
def test_paged_varlen_bad_arguments_are_named_under_compile(case):
    """The shape rules from the fake kernel at trace time, with eager's message; the index values when the
    compiled call runs."""
    base, cases = _paged_bad_calls()
    change, message = cases[case]
    compiled = torch.compile(lambda kw: flashop.flash_attn_varlen_func(**kw), fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(dict(base, **change))


def test_paged_varlen_compiles_fullgraph_without_recompiling():
    """torch.compile(fullgraph=True, dynamic=True): forward and backward match eager as the batch, the page count
    and the table width change, in one graph."""
    counts = torch._dynamo.utils.counters
    counts.clear()

    def step(q, k, v, cu_q, table, used, max_seqlen_q):
        out = flashop.flash_attn_varlen_func(q, k, v, cu_q, None, max_seqlen_q, None, causal=True, block_table=table,
                                             seqused_k=used, window_size=(30, 0))
        return out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    # No duck sizing: sizes that happen to be equal in the first call (heads and table width) stay apart.
    no_duck = torch.fx.experimental._config.patch(use_duck_shape=False)
    for lens_q, lens_k in (([3, 9], [40, 9]), ([1, 1, 30], [70, 0, 33]), ([17, 4], [17, 50]), ([2, 5, 5, 1], [2, 80, 5, 47])):
        q = torch.randn(sum(lens_q), 4, 32, requires_grad=True)
        k, v, table, _, _ = paged_kv(lens_k, 2, 32, 16, torch.float32, "cpu")
        k.requires_grad_()
        args = (cu_seqlens(lens_q, "cpu"), table, torch.tensor(lens_k, dtype=torch.int32), max(lens_q))
        with no_duck:
            loss = compiled(q, k, v, *args)
        grads = torch.autograd.grad(loss, (q, k))
        eager_loss = step(q, k, v, *args)
        eager_grads = torch.autograd.grad(eager_loss, (q, k))
        torch.testing.assert_close(loss, eager_loss)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


def test_paged_varlen_opcheck():
    lens_k = [20, 0, 33]
    k, v, table, _, _ = paged_kv(lens_k, 2, 32, 16, torch.float32, "cpu")
    q = torch.randn(9, 4, 32)
    k.requires_grad_()
    v.requires_grad_()
    cu_q = cu_seqlens([4, 2, 3], "cpu")
    for cu_k, used in ((None, torch.tensor(lens_k, dtype=torch.int32)), (cu_seqlens(lens_k, "cpu"), None)):
        torch.library.opcheck(torch.ops.flashop.gather_paged_kv.default, (q, k, v, table, cu_q, cu_k, used, 33))


@needs_cuda
def test_paged_varlen_refuses_cuda_graph_capture():
    q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    k, v, table, _, _ = paged_kv([20, 3], 1, 64, 16, torch.bfloat16, "cuda")
    cu_q, used = cu_seqlens([1, 3], "cuda"), torch.tensor([20, 3], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func with block_table cannot run inside a CUDA graph"):
        with torch.cuda.graph(graph):
            flashop.flash_attn_varlen_func(q, k, v, cu_q, None, 3, 20, block_table=table, seqused_k=used)


def test_packed_backward_takes_the_wgmma_kernel_on_hopper():
    """On compute capability 9.0 a packed backward goes to the Hopper backward as a dense one does (same width,
    causal or not, GQA), with the builds that have no packed build left out: at d192 to B_c = 64 and at d256 to
    the column split (not B_c = 96, the role split), at d64 from 2k not to B_r = 128. Elsewhere it stays on
    mma.sync."""
    from test_dispatch import ALL_BUILT_BACKWARD, DEVICES as PARTS
    packable = [n for n in ALL_BUILT_BACKWARD
                if not n.startswith("sm90.bwd.") or dispatch.runs_packed(dispatch.parse_config(n))]
    assert len(packable) < len(ALL_BUILT_BACKWARD)
    for headdim in dispatch.HOPPER_BACKWARD_HEADDIMS:
        for causal in (False, True):
            for dtype in ("bf16", "fp16"):
                dense = dispatch.Problem(dtype, headdim, 2048, 2048, 16, causal, "backward")
                packed = dispatch.Problem(dtype, headdim, 2048, 2048, 16, causal, "backward", packed=True)
                expected = dispatch.choose_config(PARTS["H100"], dense, packable)[0]
                name = dispatch.choose_config(PARTS["H100"], packed, ALL_BUILT_BACKWARD)[0]
                assert name.startswith("sm90.bwd.") and dispatch.runs_packed(dispatch.parse_config(name)), name
                assert name == expected and dispatch.parse_config(name).headdim == headdim, name
                assert dispatch.choose_config(PARTS["A100"], packed, ALL_BUILT_BACKWARD)[0].startswith("bwd.")
