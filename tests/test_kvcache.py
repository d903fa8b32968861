"""flash_attn_with_kvcache (flashop/kvcache.py, the op flashop::forward_kvcache): values against the float64
reference run sequence by sequence on the cache as it should be after the append; the append itself checked
element by element (and every other cache element untouched); contiguous and paged caches (page sizes 16, 64,
256), cache_batch_idx, cache_leftpad, rotary (interleaved and not) against a reference written from its
definition, GQA, windows, softcap, ALiBi, sinks, LSE; bad arguments named in eager mode and under compile."""
import math

import pytest
import torch

import flashop
from conftest import DEVICES, capture_cuda_graph, cuda_cannot_run
from reference import (assert_close_to_reference, assert_grad_close_to_reference, attention_reference,
                       stored_output_slack)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rotary_reference(x, cos, sin, positions, interleaved):
    """x (B, S, H, D) rotated in float64 at positions (B, S): pairs (x[2i], x[2i+1]) (interleaved) or
    (x[i], x[i + r/2]) turned by the angle whose cos/sin are at row `position`, column i."""
    x = x.double().clone()
    half = cos.size(1)
    for b in range(x.size(0)):
        for s in range(x.size(1)):
            c, sn = cos[positions[b, s]].double(), sin[positions[b, s]].double()
            first = x[b, s, :, 0:2 * half:2] if interleaved else x[b, s, :, :half]
            second = x[b, s, :, 1:2 * half:2] if interleaved else x[b, s, :, half:2 * half]
            a, bb = first.clone(), second.clone()
            first.copy_(a * c - bb * sn)
            second.copy_(a * sn + bb * c)
    return x


def paged(cache, page_size, num_blocks, generator):
    """A paged copy of cache (B, S, H, D): (num_blocks, page_size, H, D) pages in random order and a block
    table (B, ceil(S / page_size)) int32; unused pages hold noise."""
    batch, seqlen = cache.shape[:2]
    pages_per_seq = math.ceil(seqlen / page_size)
    order = torch.randperm(num_blocks, generator=generator)[:batch * pages_per_seq]
    table = order.view(batch, pages_per_seq).to(torch.int32)
    store = torch.randn(num_blocks, page_size, *cache.shape[2:], generator=generator).to(cache.dtype)
    padded = torch.zeros(batch, pages_per_seq * page_size, *cache.shape[2:], dtype=cache.dtype)
    padded[:, :seqlen] = cache
    store[table.long().flatten()] = padded.view(-1, page_size, *cache.shape[2:])
    return store, table


def run_case(device, dtype, seqlen_q=3, seqlen_cache=70, seqlen_new=3, heads=(4, 2), d=40, causal=True,
             window=(-1, -1), softcap=0.0, alibi=False, sink=False, rotary=0, interleaved=True, leftpad=False,
             batch_idx=False, page_size=None, append=True, num_splits=0, seed=0):
    batch = 3
    hq, hk = heads
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    q = randn(batch, seqlen_q, hq, d)
    batch_cache = batch + 2 if batch_idx else batch
    cache_k, cache_v = randn(batch_cache, seqlen_cache, hk, d), randn(batch_cache, seqlen_cache, hk, d)
    k = randn(batch, seqlen_new, hk, d) if append else None
    v = randn(batch, seqlen_new, hk, d) if append else None
    room = seqlen_cache - (seqlen_new if append else 0)
    lens = torch.randint(0, room + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = room  # one sequence fills its cache to the end
    idx = torch.randperm(batch_cache, generator=gen)[:batch].to(torch.int32) if batch_idx else None
    end = lens + (seqlen_new if append else 0)
    pad = torch.stack([torch.randint(0, int(e) + 1, (), generator=gen) for e in end]).to(torch.int32) if leftpad else None
    cos = sin = None
    if rotary:
        angle = torch.rand(seqlen_cache + seqlen_q, rotary // 2, generator=gen) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slopes = torch.rand(batch, hq, generator=gen) * 0.3 if alibi else None
    sinks = torch.randn(hq, generator=gen) if sink else None

    # The expected cache after the append, and each sequence's attention on its visible keys.
    rows = idx.long() if batch_idx else torch.arange(batch)
    expect_k, expect_v = cache_k.clone(), cache_v.clone()
    rotates_every_query = causal or window != (-1, -1)
    k_new = k
    if append:
        positions = lens.long()[:, None] + torch.arange(seqlen_new)
        if rotary:
            k_new = rotary_reference(k, cos, sin, positions, interleaved).to(dtype)
        for b in range(batch):
            expect_k[rows[b], lens[b]:end[b]] = k_new[b]
            expect_v[rows[b], lens[b]:end[b]] = v[b]
    q_ro = q
    if rotary:
        steps = torch.arange(seqlen_q) if rotates_every_query else torch.zeros(seqlen_q, dtype=torch.long)
        q_ro = rotary_reference(q, cos, sin, lens.long()[:, None] + steps, interleaved)

    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    if page_size:
        num_blocks = batch * math.ceil(seqlen_cache / page_size) + 3
        store_k, table = paged(cache_k, page_size, num_blocks, gen)
        store_v = torch.randn(num_blocks, page_size, hk, d, generator=gen).to(dtype)
        padded_v = torch.zeros(batch, table.size(1) * page_size, hk, d, dtype=dtype)
        padded_v[:, :seqlen_cache] = cache_v
        store_v[table.long().flatten()] = padded_v.view(-1, page_size, hk, d)
        k_cache, v_cache, block_table = store_k.clone().to(device), store_v.clone().to(device), table.to(device)
    else:
        k_cache, v_cache, block_table = cache_k.clone().to(device), cache_v.clone().to(device), None
    out, lse = flashop.flash_attn_with_kvcache(
        to(q), k_cache, v_cache, to(k), to(v), rotary_cos=to(cos), rotary_sin=to(sin), cache_seqlens=to(lens),
        cache_batch_idx=to(idx), cache_leftpad=to(pad), block_table=block_table, causal=causal, window_size=window,
        softcap=softcap, rotary_interleaved=interleaved, alibi_slopes=to(slopes), num_splits=num_splits,
        return_softmax_lse=True, learnable_sink=to(sinks))
    assert out.shape == q.shape and lse.shape == (batch, hq, seqlen_q) and lse.dtype == torch.float32

    # The append, element by element; nothing else in the cache changed. A rotated key may differ from the
    # float64 rotation by the rounding of its dtype.
    if page_size:
        untouched = torch.ones(k_cache.size(0), dtype=torch.bool)
        untouched[table.long().flatten()] = False
        assert torch.equal(k_cache.cpu()[untouched], store_k[untouched])
        assert torch.equal(v_cache.cpu()[untouched], store_v[untouched])
        got_k, got_v = (c.cpu()[table.long()].flatten(1, 2)[:, :seqlen_cache] for c in (k_cache, v_cache))
    else:
        got_k, got_v = k_cache.cpu(), v_cache.cpu()
    assert torch.equal(got_v, expect_v)
    rounding = 0.0 if not rotary else (1e-5 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(got_k.double(), expect_k.double(), atol=rounding, rtol=0)

    for b in range(batch):
        lo = int(pad[b]) if leftpad else 0
        keys, values = expect_k[rows[b], lo:end[b]][None], expect_v[rows[b], lo:end[b]][None]
        variant = dict(causal=causal, window_size=window, softcap=softcap, learnable_sink=sinks,
                       alibi_slopes=None if slopes is None else slopes[b])
        ref_out, ref_lse = attention_reference(q_ro[b:b + 1].to(dtype), keys, values, upcast=True, **variant)
        lowp_out, _ = attention_reference(q_ro[b:b + 1].to(dtype), keys, values, upcast=False, **variant)
        assert_close_to_reference(out[b:b + 1].cpu(), ref_out, lowp_out, f"out[{b}]", factor=3 if alibi else 2)
        empty = torch.isneginf(ref_lse[0])
        assert torch.equal(torch.isneginf(lse[b].cpu()), empty)
        torch.testing.assert_close(lse[b].cpu()[~empty], ref_lse[0][~empty].float(), atol=2e-3, rtol=2e-3)


CASES = {  # name: run_case keyword arguments
    "decode": dict(seqlen_q=1, seqlen_new=1),
    "prefill_chunk": dict(seqlen_q=5, seqlen_new=5),
    "no_append": dict(append=False, seqlen_q=2),
    "not_causal": dict(causal=False),
    "more_queries_than_new": dict(seqlen_q=4, seqlen_new=2),
    "window": dict(window=(9, 0)),
    "local_both_sides": dict(causal=False, window=(5, 2)),
    "softcap_alibi_sink": dict(softcap=8.0, alibi=True, sink=True),
    "rotary_interleaved": dict(rotary=32, interleaved=True),
    "rotary_halves": dict(rotary=16, interleaved=False, causal=False),
    "leftpad": dict(leftpad=True),
    "batch_idx": dict(batch_idx=True, rotary=16),
    "paged16": dict(page_size=16),
    "paged64_rotary_leftpad": dict(page_size=64, rotary=32, leftpad=True),
    "paged256": dict(page_size=256, seqlen_cache=300),
    "mqa_headdim_59": dict(heads=(4, 1), d=59),
    # On CUDA these run the split-KV decode kernels (at most 8 query rows per KV head), keys split over CTAs.
    "decode_splits_sink": dict(seqlen_q=1, seqlen_new=1, seqlen_cache=300, num_splits=5, sink=True),
    "decode_paged_splits_alibi_window": dict(seqlen_q=2, seqlen_new=1, page_size=16, seqlen_cache=200, num_splits=7,
                                             alibi=True, window=(50, 0)),
    "decode_gqa8_d128_softcap": dict(seqlen_q=1, seqlen_new=1, heads=(8, 1), d=128, num_splits=3, softcap=5.0),
    "decode_d256_leftpad": dict(seqlen_q=2, seqlen_new=2, d=256, leftpad=True, num_splits=2),
    "decode_batch_idx_d64": dict(seqlen_q=1, seqlen_new=1, d=64, batch_idx=True, causal=False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kvcache_matches_reference(device, dtype, case):
    if cuda_cannot_run(device, dtype, CASES[case].get("d", 40)):
        pytest.skip("CUDA kernels take float16/bfloat16")
    run_case(device, dtype, seed=int(torch.randint(0, 2**31, ())), **CASES[case])


def test_decode_kernels_are_chosen_for_few_rows_per_kv_head():
    """The split-KV decode kernels take CUDA fp16/bf16 calls with at most 8 query rows per KV head and a headdim
    that is a multiple of 8; the packed-batch forward takes the rest (and every CPU call)."""
    if not (flashop._C.WITH_CUDA and torch.cuda.is_available()):
        pytest.skip("needs a CUDA build and a CUDA device")
    cache = torch.zeros(2, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
    assert flashop._C.decode_supported(q, cache, cache)
    assert not flashop._C.decode_supported(torch.zeros(2, 3, 8, 64, dtype=torch.bfloat16, device="cuda"), cache, cache)
    assert not flashop._C.decode_supported(q[..., :60], cache[..., :60], cache[..., :60])
    assert not flashop._C.decode_supported(q.float(), cache.float(), cache.float())


def test_cache_seqlens_as_int_and_whole_cache_without_it():
    q, cache = torch.randn(2, 1, 4, 32), torch.randn(2, 10, 2, 32)
    k, v = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    k_cache, v_cache = cache.clone(), cache.clone()
    out = flashop.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=6, causal=True)
    assert torch.equal(k_cache[:, 6:7], k) and torch.equal(v_cache[:, 6:7], v)
    ref, _ = attention_reference(q, k_cache[:, :7], v_cache[:, :7], causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out = flashop.flash_attn_with_kvcache(q, k_cache, v_cache)  # no cache_seqlens: the whole cache
    ref, _ = attention_reference(q, k_cache, v_cache)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _bad_calls():
    q, cache = torch.randn(2, 1, 4, 32), torch.randn(2, 16, 2, 32)
    new = torch.randn(2, 1, 2, 32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    angles = torch.randn(20, 8)
    return {  # name: (keyword arguments of flash_attn_with_kvcache, the message)
        "cache rank": (dict(q=q, k_cache=cache[0], v_cache=cache[0]), "k_cache must be a 4-D tensor"),
        "cache dtype": (dict(q=q, k_cache=cache.half(), v_cache=cache.half()), "k_cache must have the dtype of q"),
        "k without v": (dict(q=q, k_cache=cache, v_cache=cache, k=new, cache_seqlens=lens),
                        "k and v \\(the new keys and values\\) must be given together"),
        "k shape": (dict(q=q, k_cache=cache, v_cache=cache, k=new[:, :, :1], v=new[:, :, :1], cache_seqlens=lens),
                    "k must have shape \\(batch, seqlen_new, nheads_k, headdim\\)"),
        "append needs seqlens": (dict(q=q, k_cache=cache, v_cache=cache, k=new, v=new),
                                 "appending k and v needs cache_seqlens"),
        "seqlens dtype": (dict(q=q, k_cache=cache, v_cache=cache, cache_seqlens=lens.long()),
                          "cache_seqlens must have dtype torch.int32"),
        "append past the end": (dict(q=q, k_cache=cache, v_cache=cache, k=new, v=new,
                                     cache_seqlens=torch.tensor([3, 16], dtype=torch.int32)),
                                "cache_seqlens \\+ seqlen_new must lie in \\[0, 16\\]"),
        "leftpad past the keys": (dict(q=q, k_cache=cache, v_cache=cache, cache_seqlens=lens,
                                       cache_leftpad=torch.tensor([0, 7], dtype=torch.int32)),
                                  "cache_leftpad must lie in"),
        "batch idx range": (dict(q=q, k_cache=cache, v_cache=cache, cache_batch_idx=torch.tensor([0, 2],
                                                                                               dtype=torch.int32)),
                            "cache_batch_idx must index k_cache's 2 rows"),
        "paged append past the end": (dict(q=q, k_cache=cache, v_cache=cache, k=new, v=new,
                                           cache_seqlens=torch.tensor([3, 16], dtype=torch.int32),
                                           block_table=torch.tensor([[0], [1]], dtype=torch.int32)),
                                      "cache_seqlens \\+ seqlen_new must lie in \\[0, 16\\] \\(the positions of a "
                                      "sequence's block_table pages"),
        "page size": (dict(q=q, k_cache=cache[:, :10], v_cache=cache[:, :10],
                           block_table=torch.zeros(2, 2, dtype=torch.int32)),
                      "the page size \\(k_cache.size\\(1\\)\\) must be a multiple of 16"),
        "block table range": (dict(q=q, k_cache=cache, v_cache=cache, cache_seqlens=lens,
                                   block_table=torch.tensor([[0], [2]], dtype=torch.int32)),
                              "block_table entries of the pages in use must index k_cache's 2 blocks"),
        "rotary without k": (dict(q=q, k_cache=cache, v_cache=cache, rotary_cos=angles, rotary_sin=angles),
                             "rotary_cos/rotary_sin rotate the new keys: they need k and v"),
        "rotary dim": (dict(q=q, k_cache=cache, v_cache=cache, k=new, v=new, cache_seqlens=lens,
                            rotary_cos=angles[:, :5], rotary_sin=angles[:, :5]),
                       "rotary_dim \\(2 \\* rotary_cos.size\\(1\\) = 10\\) must be a multiple of 16"),
        "rotary too short": (dict(q=q, k_cache=cache, v_cache=cache, k=new, v=new, cache_seqlens=lens,
                                  rotary_cos=angles[:4], rotary_sin=angles[:4]),
                             "rotary_cos/rotary_sin have 4 positions; the new keys and queries need 6"),
        "window": (dict(q=q, k_cache=cache, v_cache=cache, window_size=(-2, 0)), "window_size_left must be -1"),
        "num_splits": (dict(q=q, k_cache=cache, v_cache=cache, num_splits=-1), "num_splits must be >= 0"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_are_named(case):
    kwargs, message = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=message):
        flashop.flash_attn_with_kvcache(**kwargs)


@pytest.mark.parametrize("case", ["cache dtype", "k shape", "append needs seqlens", "rotary dim", "window"])
def test_bad_arguments_are_named_under_compile(case):
    kwargs, message = _bad_calls()[case]
    compiled = torch.compile(lambda kw: flashop.flash_attn_with_kvcache(**kw), fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(kwargs)


def test_compiled_decode_step_appends_in_place():
    """torch.compile(fullgraph=True): the cache mutation survives functionalisation, and new cache lengths
    and new step positions do not recompile."""
    counts = torch._dynamo.utils.counters
    counts.clear()
    q, cache = torch.randn(2, 1, 4, 32), torch.randn(2, 16, 2, 32)
    k_cache, v_cache = cache.clone(), cache.clone()

    @torch.compile(fullgraph=True, dynamic=True)
    def step(q, k, v, lens):
        return flashop.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)

    for t in range(3):
        k, v = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
        lens = torch.tensor([4 + t, 9 + t], dtype=torch.int32)
        out = step(q, k, v, lens)
        for b in range(2):
            n = int(lens[b])
            assert torch.equal(k_cache[b, n], k[b, 0]) and torch.equal(v_cache[b, n], v[b, 0])
            ref, _ = attention_reference(q[b:b + 1], k_cache[b:b + 1, :n + 1], v_cache[b:b + 1, :n + 1], causal=True)
            torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


def test_opcheck():
    q, cache = torch.randn(2, 2, 4, 32), torch.randn(2, 16, 2, 32)
    k, v = torch.randn(2, 2, 2, 32), torch.randn(2, 2, 2, 32)
    angles = torch.rand(20, 8)
    args = (q, cache.clone(), cache.clone(), k, v, angles.cos(), angles.sin(), torch.tensor([3, 9], dtype=torch.int32),
            None, torch.tensor([1, 0], dtype=torch.int32), None, None, True, -1, -1, 0.0, True, None, None, 0, None)
    torch.library.opcheck(torch.ops.flashop.forward_kvcache.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.flashop.forward_kvcache.with_out, (q, cache.clone(), cache.clone()) + args[3:],
                          {"out": torch.empty_like(q)},
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_q", [1, 6], ids=["decode", "prefill"])  # on CUDA: the decode kernels, the packed path
def test_preallocated_out(device, seqlen_q):
    """out= receives the output (the same tensor object comes back, a strided view too), equal to the call
    without it; a wrong shape or dtype is named, under torch.compile too."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(2, seqlen_q, 4, 64, dtype=dtype, device=device)
    cache = torch.randn(2, 40, 2, 64, dtype=dtype, device=device)
    new = torch.randn(2, 1, 2, 64, dtype=dtype, device=device)
    lens = torch.tensor([7, 30], dtype=torch.int32, device=device)
    expected, expected_lse = flashop.flash_attn_with_kvcache(q, cache.clone(), cache.clone(), new, new,
                                                             cache_seqlens=lens, causal=True, return_softmax_lse=True)
    storage = torch.full((2, seqlen_q, 4, 80), float("nan"), dtype=dtype, device=device)
    out = storage[..., :64]  # rows of 80 elements: the kernels write at out's own strides
    got, lse = flashop.flash_attn_with_kvcache(q, cache.clone(), cache.clone(), new, new, cache_seqlens=lens,
                                               causal=True, return_softmax_lse=True, out=out)
    assert got is out
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)
    assert torch.isnan(storage[..., 64:]).all()
    with pytest.raises(RuntimeError, match="out must have the shape of q"):
        flashop.flash_attn_with_kvcache(q, cache, cache, out=out[:1])
    compiled = torch.compile(flashop.flash_attn_with_kvcache, fullgraph=True)
    with pytest.raises(Exception, match="out must have the dtype of q"):
        compiled(q, cache, cache, out=out.double())


DECODE_VARIANTS = {  # flash_attn_func keyword arguments
    "dense": dict(),
    "causal_window": dict(causal=True, window_size=(40, 0)),
    "softcap_alibi": dict(softcap=6.0, alibi=True),
    "sink": dict(causal=True, sink=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 1, 8, 2, 1, 64), (2, 1, 8, 1, 777, 128), (2, 2, 8, 4, 300, 256),
                                   (1, 4, 4, 2, 2000, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", list(DECODE_VARIANTS))
def test_flash_attn_func_with_few_query_rows(device, dtype, shape, variant):
    """flash_attn_func with at most 8 query rows per KV head (on CUDA: the split-KV decode kernels) against the
    float64 reference: out, lse, and the gradients through the backward from that lse."""
    batch, seqlen_q, hq, hk, seqlen_k, d = shape
    args = dict(DECODE_VARIANTS[variant])
    alibi, sink = args.pop("alibi", False), args.pop("sink", False)
    q = torch.randn(batch, seqlen_q, hq, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, hk, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    slopes = torch.rand(batch, hq, device=device) * 0.3 if alibi else None
    sinks = torch.randn(hq, device=device) if sink else None
    out, lse, _ = flashop.flash_attn_func(q, k, v, alibi_slopes=slopes, learnable_sink=sinks, return_attn_probs=True,
                                          **args)
    variant_args = dict(args, alibi_slopes=slopes, learnable_sink=sinks)
    ref, ref_lse = attention_reference(q, k, v, upcast=True, **variant_args)
    lowp, _ = attention_reference(q, k, v, upcast=False, **variant_args)
    assert_close_to_reference(out, ref, lowp, "out")
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=2e-3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowp_grads = torch.autograd.grad(lowp, (q, k, v), dout)
    dq_slack, dk_slack = stored_output_slack(q, k, out, ref, dout)
    for name, g, r, lp, slack in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads, (dq_slack, dk_slack, 0.0)):
        assert_grad_close_to_reference(g, r, lp, name, slack)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_decode_step_replays_in_a_cuda_graph():
    """A decode step (append one token, rotary, attend) captured once and replayed with new cache lengths, new
    tokens and new queries written into its static inputs: each replay appends where cache_seqlens says and
    matches the float64 reference."""
    dtype, device = torch.bfloat16, "cuda"
    batch, hq, hk, d, seqlen_cache = 3, 8, 2, 128, 512
    k_cache, v_cache = (torch.randn(batch, seqlen_cache, hk, d, dtype=dtype, device=device) for _ in range(2))
    angle = torch.rand(seqlen_cache, 32, device=device) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q, k, v = (torch.randn(batch, 1, h, d, dtype=dtype, device=device) for h in (hq, hk, hk))
    lens = torch.tensor([5, 100, 300], dtype=torch.int32, device=device)

    def step():
        return flashop.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=lens, causal=True)

    graph, out = capture_cuda_graph(step)
    for t in range(3):
        new_lens = torch.tensor([6 + t, 200 + 7 * t, 400 + t], dtype=torch.int32, device=device)
        lens.copy_(new_lens)
        for static in (q, k, v):
            static.copy_(torch.randn_like(static))
        graph.replay()
        torch.cuda.synchronize()
        for b in range(batch):
            n = int(new_lens[b])
            position = torch.tensor([[n]], device=device)
            k_rot = flashop.kvcache.apply_rotary(k[b:b + 1], cos, sin, position, True)
            assert torch.equal(k_cache[b, n], k_rot[0, 0]) and torch.equal(v_cache[b, n], v[b, 0])
            q_rot = flashop.kvcache.apply_rotary(q[b:b + 1], cos, sin, position, True)
            ref, _ = attention_reference(q_rot, k_cache[b:b + 1, :n + 1], v_cache[b:b + 1, :n + 1], causal=True)
            lowp, _ = attention_reference(q_rot, k_cache[b:b + 1, :n + 1], v_cache[b:b + 1, :n + 1], causal=True,
                                          upcast=False)
            assert_close_to_reference(out[b:b + 1], ref, lowp, f"out[{b}] at step {t}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_index_values_unchecked_stay_inside_the_cache(monkeypatch):
    """On CUDA the index values are the caller's contract (no host sync per call): out-of-range cache_seqlens,
    cache_batch_idx, cache_leftpad and block table entries are clamped, so the call returns finite values and
    the process goes on; with FLASHOP_CHECK_INDICES=1 (flashop.kvcache.CUDA_INDEX_CHECKS "all") they are named."""
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(2, 1, 4, 64, dtype=dtype, device=device)
    cache = torch.randn(2, 64, 2, 64, dtype=dtype, device=device)
    new = torch.randn(2, 1, 2, 64, dtype=dtype, device=device)
    bad = torch.tensor([5, 1000], dtype=torch.int32, device=device)
    calls = {
        "cache_seqlens": dict(k=new, v=new, cache_seqlens=bad),
        "cache_batch_idx": dict(cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32, device=device)),
        "cache_leftpad": dict(cache_seqlens=bad.clamp(max=60), cache_leftpad=torch.tensor([-3, 90], dtype=torch.int32,
                                                                                        device=device)),
        "block_table": dict(cache_seqlens=bad.clamp(max=60),
                            block_table=torch.tensor([[0, 99], [1, -4]], dtype=torch.int32, device=device),
                            k_cache=cache.view(4, 32, 2, 64), v_cache=cache.view(4, 32, 2, 64)),
    }
    for name, kwargs in calls.items():
        kwargs = dict(dict(q=q, k_cache=cache.clone(), v_cache=cache.clone()), **kwargs)
        for few_rows in (True, False):  # the decode kernels, and the packed-batch forward (10 query rows per head)
            call = dict(kwargs, q=q if few_rows else q.expand(2, 5, 4, 64).contiguous())
            monkeypatch.setattr(flashop.kvcache, "CUDA_INDEX_CHECKS", "none")
            try:
                out = flashop.flash_attn_with_kvcache(**call)
                assert torch.isfinite(out.float()).all(), name
            except RuntimeError as err:  # the packed-batch path checks its cu_seqlens on the host
                assert "cu_seqlens" in str(err) or "seqused" in str(err), (name, str(err))
            monkeypatch.setattr(flashop.kvcache, "CUDA_INDEX_CHECKS", "all")
            with pytest.raises(RuntimeError, match=name):
                flashop.flash_attn_with_kvcache(**call)
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("append", [False, True], ids=["cache-only", "append"])
def test_cuda_paged_call_past_its_block_table(monkeypatch, append):
    """FlashAttention-2's one host read, the default on CUDA: a paged call whose cache_seqlens + seqlen_new passes
    its block table's positions is refused, naming block_table. With FLASHOP_CHECK_INDICES=0
    (CUDA_INDEX_CHECKS "none") nothing is read: the kernels clamp, and the call returns finite values."""
    device, dtype = "cuda", torch.float16
    pages = torch.randn(4, 16, 1, 64, dtype=dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)  # 16 positions
    q = torch.randn(1, 1, 1, 64, dtype=dtype, device=device)
    new = torch.randn(1, 1, 1, 64, dtype=dtype, device=device) if append else None
    lens = torch.full((1,), 16 if append else 17, dtype=torch.int32, device=device)
    call = dict(k=new, v=new, cache_seqlens=lens, block_table=table)
    monkeypatch.setattr(flashop.kvcache, "CUDA_INDEX_CHECKS", "paged")
    with pytest.raises(RuntimeError, match="block_table"):
        flashop.flash_attn_with_kvcache(q, pages.clone(), pages.clone(), **call)
    monkeypatch.setattr(flashop.kvcache, "CUDA_INDEX_CHECKS", "none")
    out = flashop.flash_attn_with_kvcache(q, pages.clone(), pages.clone(), **call)
    assert torch.isfinite(out.float()).all()
