"""Packed (variable-length) batches on the Hopper (sm_90a) forward and backward kernels, called through
flashop._C_sm90 with each config that supports them (HopperConfig / HopperBackwardConfig.supports_packed),
against the float64 reference run sequence by sequence: mixed lengths 1..300 with an empty sequence, Sq != Sk
per sequence, GQA, causal, windows, softcap, ALiBi, sinks and seqused (with NaN in the unused query and key
rows, which must not leak).

Skipped unless a GPU of compute capability 9.0 is present and the module is built.
"""
import pytest
import torch

import flashop
from reference import assert_close_to_reference, assert_grad_close_to_reference, attention_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a compute capability 9.0 GPU")

sm90 = None
if HOPPER:
    try:
        import flashop._C_sm90 as sm90
    except ImportError as e:  # pragma: no cover
        pytestmark = pytest.mark.skip(reason=f"flashop._C_sm90 not built: {e}")

PACKED_CONFIGS = [c for c in flashop.configs.HOPPER_FORWARD_CONFIGS if c.supports_packed]
REFUSING_CONFIGS = [c.name for c in flashop.configs.HOPPER_FORWARD_CONFIGS if not c.supports_packed]
PACKED_BWD_CONFIGS = [c for c in flashop.configs.HOPPER_BACKWARD_CONFIGS if c.supports_packed]
REFUSING_BWD_CONFIGS = [c.name for c in flashop.configs.HOPPER_BACKWARD_CONFIGS if not c.supports_packed]


def cu_seqlens(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def per_sequence_reference(q, k, v, cu_q, cu_k, used_q, used_k, upcast, alibi_slopes=None, **variant):
    """out (total_q, H, D) and lse (H, total_q): the dense reference on each sequence's used rows, the other
    rows 0 and -inf."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        n_q, n_k = int(used_q[b]), int(used_k[b])
        slopes = None if alibi_slopes is None else alibi_slopes[b]
        out, lse = attention_reference(q[None, q0:q0 + n_q], k[None, k0:k0 + n_k], v[None, k0:k0 + n_k],
                                       upcast=upcast, alibi_slopes=slopes, **variant)
        pad = q1 - q0 - n_q
        outs += [out[0], out.new_zeros(pad, *out.shape[2:])]
        lses += [lse[0], lse.new_full((lse.size(1), pad), float("-inf"))]
    return torch.cat(outs), torch.cat(lses, dim=1)


# (lens_q, lens_k, heads_q, heads_k, causal, window, softcap, alibi, sinks, seqused, headdim below the width)
CASES = {
    "plain": ([1, 300, 0, 127, 128, 129, 64], [5, 300, 17, 127, 250, 129, 1], 2, 2, False, (-1, -1), 0.0,
              False, False, False, False),
    "causal-gqa": ([37, 0, 200, 1, 129], [37, 5, 150, 64, 300], 4, 2, True, (-1, -1), 0.0, False, False, False,
                   False),
    "window-alibi-sinks": ([64, 80, 255, 3], [64, 150, 255, 0], 4, 1, False, (40, 7), 0.0, True, True, False,
                           True),
    "softcap-seqused": ([50, 17, 300, 0, 131], [50, 30, 99, 8, 260], 2, 1, True, (-1, -1), 15.0, False, True,
                        True, False),
}


def run_case(config, case):
    lens_q, lens_k, hq, hk, causal, window, softcap, alibi, sink, seqused, narrow = CASES[case]
    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float16
    d = config.headdim - 8 if narrow else config.headdim
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(sum(lens_k), hk, d, dtype=dtype, device="cuda") for _ in range(2))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    batch = len(lens_q)
    slopes = torch.rand(batch, hq, device="cuda") if alibi else None
    sinks = torch.randn(hq, device="cuda") if sink else None
    used_q = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32, device="cuda") if seqused else None
    used_k = torch.tensor([n // 2 for n in lens_k], dtype=torch.int32, device="cuda") if seqused else None
    ref_used_q = used_q if seqused else torch.tensor(lens_q)
    ref_used_k = used_k if seqused else torch.tensor(lens_k)
    if seqused:  # rows past seqused hold anything: NaN in q and k must not reach out or lse
        for b in range(batch):
            q[int(cu_q[b]) + int(used_q[b]):int(cu_q[b + 1])] = float("nan")
            k[int(cu_k[b]) + int(used_k[b]):int(cu_k[b + 1])] = float("nan")
    scale = d ** -0.5
    out, lse = sm90.forward(q, k, v, scale, causal, config.name, window[0], window[1], softcap, slopes, sinks,
                            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                            seqused_q=used_q, seqused_k=used_k)
    assert out.shape == q.shape and lse.shape == (hq, q.size(0))
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]  # the reference reads the used rows only
    variant = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                   learnable_sink=sinks)
    ref_out, ref_lse = per_sequence_reference(*clean, cu_q, cu_k, ref_used_q, ref_used_k, True, **variant)
    lowp_out, _ = per_sequence_reference(*clean, cu_q, cu_k, ref_used_q, ref_used_k, False, **variant)
    assert not out.isnan().any()
    assert_close_to_reference(out, ref_out, lowp_out, "out")
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("config", PACKED_CONFIGS, ids=lambda c: c.name)
def test_packed_forward_matches_per_sequence_reference(config, case):
    if config.name not in sm90.built_forward_configs():
        pytest.skip(f"{config.name} not built")
    run_case(config, case)


@pytest.mark.parametrize("name", REFUSING_CONFIGS)
def test_packed_forward_refused_by_configs_without_it(name):
    if name not in sm90.built_forward_configs():
        pytest.skip(f"{name} not built")
    q = torch.randn(10, 2, 128, dtype=torch.bfloat16, device="cuda")
    cu = cu_seqlens([4, 6])
    with pytest.raises(RuntimeError, match="does not run packed batches"):
        sm90.forward(q, q, q, 0.1, False, name, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)


def test_packed_forward_many_sequences_and_persistent_balance():
    """Many short sequences beside one long one (the grid spans max_seqlen_q; the tiles past each sequence's
    rows are skipped), every persistent packed config."""
    lens = [300] + [1, 2, 7, 0, 64, 65, 128, 129] * 8
    for config in PACKED_CONFIGS:
        if config.name not in sm90.built_forward_configs() or config.headdim != 128:
            continue
        dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float16
        q, k, v = (torch.randn(sum(lens), 2, 128, dtype=dtype, device="cuda") for _ in range(3))
        cu = cu_seqlens(lens)
        out, lse = sm90.forward(q, k, v, 128 ** -0.5, True, config.name, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=300, max_seqlen_k=300)
        ones = torch.tensor(lens)
        ref_out, _ = per_sequence_reference(q, k, v, cu, cu, ones, ones, True, softmax_scale=128 ** -0.5, causal=True)
        lowp_out, _ = per_sequence_reference(q, k, v, cu, cu, ones, ones, False, softmax_scale=128 ** -0.5,
                                             causal=True)
        assert_close_to_reference(out, ref_out, lowp_out, config.name)


# ---------------------------------------------------------------- backward (Sm90BwdPacked)

# (lens_q, lens_k, heads_q, heads_k, causal, window, softcap, alibi, seqused, headdim below the width)
BWD_CASES = {
    "plain": ([1, 300, 0, 127, 128, 129, 64], [5, 300, 17, 127, 250, 129, 1], 2, 2, False, (-1, -1), 0.0, False,
              False, False),
    "causal-gqa-seqused": ([37, 0, 200, 1, 129, 65], [37, 5, 150, 64, 300, 200], 4, 2, True, (-1, -1), 0.0, False,
                           True, True),
    "window-alibi": ([64, 80, 255, 3], [64, 150, 255, 0], 4, 1, False, (40, 7), 0.0, True, False, False),
    "causal-window-seqused": ([130, 64, 1, 256], [300, 64, 129, 190], 2, 1, True, (33, 0), 0.0, False, True,
                              False),
    "softcap-seqused": ([50, 17, 300, 0, 131], [50, 30, 99, 8, 260], 2, 1, True, (-1, -1), 15.0, False, True,
                        False),
    "empty-q": ([0, 0], [5, 0], 2, 1, False, (-1, -1), 0.0, False, False, False),
    "single-tokens": ([1, 1, 1], [1, 300, 0], 2, 1, True, (-1, -1), 0.0, False, False, False),
    "one-query-many-keys": ([1, 300], [300, 1], 2, 2, True, (-1, -1), 0.0, False, False, False),
}


def run_backward_case(config, case):
    """dq, dk, dv of sm90.backward on a packed batch against autograd through the per-sequence reference:
    rows past seqused get zero gradients, NaN in the unused q, k and dout rows must not leak."""
    lens_q, lens_k, hq, hk, causal, window, softcap, alibi, seqused, narrow = BWD_CASES[case]
    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float16
    d = config.headdim - 8 if narrow else config.headdim
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(sum(lens_k), hk, d, dtype=dtype, device="cuda") for _ in range(2))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    batch = len(lens_q)
    slopes = torch.rand(batch, hq, device="cuda") if alibi else None
    used_q = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32, device="cuda") if seqused else None
    used_k = torch.tensor([n // 2 for n in lens_k], dtype=torch.int32, device="cuda") if seqused else None
    ref_used_q = used_q.cpu() if seqused else torch.tensor(lens_q)
    ref_used_k = used_k.cpu() if seqused else torch.tensor(lens_k)
    scale = d ** -0.5
    out, lse = torch.ops.flashop.forward(q, k, v, scale, causal, None, False, window[0], window[1], softcap, slopes,
                                         None, cu_q, cu_k, max(lens_q), max(lens_k), used_q, used_k)
    dout = torch.randn_like(out)
    if seqused:  # rows past seqused hold anything (v and out excepted: the forward reads v, writes out = 0)
        for b in range(batch):
            for t, cu, used in ((q, cu_q, used_q), (dout, cu_q, used_q), (k, cu_k, used_k)):
                t[int(cu[b]) + int(used[b]):int(cu[b + 1])] = float("nan")
    dq, dk, dv = sm90.backward(dout, q, k, v, out, lse, scale, causal, False, config.name, window[0], window[1],
                               softcap, slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                               max_seqlen_k=max(lens_k), seqused_q=used_q, seqused_k=used_k)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any(), name
    leaves = [t.nan_to_num(0.0).requires_grad_() for t in (q, k, v)]
    clean_dout = dout.nan_to_num(0.0)
    variant = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    ref_out, _ = per_sequence_reference(*leaves, cu_q, cu_k, ref_used_q, ref_used_k, True, **variant)
    lowp_out, _ = per_sequence_reference(*leaves, cu_q, cu_k, ref_used_q, ref_used_k, False, **variant)
    if ref_out.numel() == 0 or not ref_out.requires_grad:  # no query row anywhere: dk = dv = 0
        ref_grads = lowp_grads = [torch.zeros_like(t, dtype=torch.float64) for t in leaves]
    else:
        ref_grads = torch.autograd.grad(ref_out, leaves, clean_dout.double(), allow_unused=True, retain_graph=True)
        lowp_grads = torch.autograd.grad(lowp_out, leaves, clean_dout, allow_unused=True)
        ref_grads = [torch.zeros_like(t, dtype=torch.float64) if g is None else g for t, g in zip(leaves, ref_grads)]
        lowp_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, lowp_grads)]
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, lowp_grads):
        assert_grad_close_to_reference(g, r, lp, name)
    if seqused:  # exact zeros past seqused
        for b in range(batch):
            assert not dq[int(cu_q[b]) + int(used_q[b]):int(cu_q[b + 1])].any()
            assert not dk[int(cu_k[b]) + int(used_k[b]):int(cu_k[b + 1])].any()
            assert not dv[int(cu_k[b]) + int(used_k[b]):int(cu_k[b + 1])].any()


@pytest.mark.parametrize("case", list(BWD_CASES))
@pytest.mark.parametrize("config", PACKED_BWD_CONFIGS, ids=lambda c: c.name)
def test_packed_backward_matches_per_sequence_reference(config, case):
    if config.name not in sm90.built_backward_configs():
        pytest.skip(f"{config.name} not built")
    if config.longest_first and not BWD_CASES[case][4]:
        pytest.skip("the .lpt order applies to causal problems only")
    run_backward_case(config, case)


@pytest.mark.parametrize("name", REFUSING_BWD_CONFIGS)
def test_packed_backward_refused_by_configs_without_it(name):
    if name not in sm90.built_backward_configs():
        pytest.skip(f"{name} not built")
    q = torch.randn(10, 2, 192, dtype=torch.bfloat16, device="cuda")
    cu = cu_seqlens([4, 6])
    lse = torch.zeros(2, 10, device="cuda")
    with pytest.raises(RuntimeError, match="does not run packed batches"):
        sm90.backward(q, q, q, q, q, lse, 0.1, False, False, name, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                      max_seqlen_k=6)


def test_packed_backward_policy_takes_the_wgmma_kernel():
    """config=None on a packed batch: the policy picks a Hopper backward config that runs packed batches (as
    for a dense batch), and the gradients through flash_attn_varlen_func match the mma.sync backward's."""
    lens = [37, 0, 200, 129]
    cu = cu_seqlens(lens)
    q, k, v = (torch.randn(sum(lens), 4, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))
    name = flashop.dispatch.config_for(q, k, True, "backward", False, (len(lens), max(lens), max(lens)))
    assert name.startswith("sm90.bwd.") and flashop.dispatch.runs_packed(flashop.dispatch.parse_config(name))
    out = flashop.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(flashop.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                             deterministic=True), (q, k, v), dout)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)
