"""Small shapes for compute-sanitizer (memcheck, racecheck): built CUDA configs on tails, causal,
GQA and rows with no keys, at the config's tile width W and at narrower head dimensions (W - 8, read
in place with the last 16-byte chunk of the width unused, and W - 27, odd: padded to W - 24 by the
op). Also checks values, so a run that reads garbage fails.

    compute-sanitizer --tool memcheck python3 tools/sanitize_cases.py ['bf16.*' ...]

Arguments are fnmatch patterns over config names (default: every built bf16 config); "decode" adds the split-KV
decode kernels' cases; --variants-only keeps only the attention-variant cases (windows, softcap, ALiBi, sinks),
forward and backward, and --few-shapes only the shapes of a few tiles (FEW_SHAPES), each for a tool as slow as
racecheck, printing each case as it starts (a run stopped by a timeout shows where it was).
"""
import fnmatch
import sys

import torch

import flashop
from flashop.configs import HopperBackwardConfig

SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_k)
    (1, 1, 1, 1, 1),
    (1, 70, 33, 2, 1),
    (2, 33, 150, 4, 2),
    (3, 40, 2100, 4, 2),  # 17 key tiles of 128: the backward lpt block groups (csrc/cuda/bwd_config.h)
    (1, 256, 300, 2, 1),  # two query tiles (B_r 128 or 192): the ".mc" kernels run as a cluster pair (non-causal)
    (1, 520, 200, 64, 8),  # 320 query tiles (B_r 128), more than the SMs: a persistent CTA walks 2-3 tiles
]
NARROWER_SHAPES = SHAPES[1:3] + SHAPES[4:5]  # tails, GQA, rows with no keys, a cluster pair
# --few-shapes: the shapes of a few tiles each (tails, GQA, rows with no keys, a cluster pair), for a tool as slow as
# racecheck, which spends minutes on one launch of the many-tile shapes.
FEW_SHAPES = SHAPES[:3] + SHAPES[4:5]  # and the first two variant shapes
# Attention variants at the tile width on the tail/GQA shapes: (window_left, window_right, softcap, alibi, sinks);
# windows that leave rows without keys, both bounds, and everything at once.
VARIANTS = [(0, 0, 0.0, False, False), (17, -1, 0.0, False, True), (-1, 5, 20.0, True, False), (9, 3, 30.0, True, True)]
VARIANT_SHAPES = SHAPES[1:4]
# Packed batches (cu_seqlens), on configs that run them (dispatch.runs_packed): (lens_q, lens_k, heads_q, heads_k,
# seqused): an empty sequence, single tokens, tile tails, Sq != Sk per sequence, seqused cutting tiles.
PACKED = [([37, 0, 90, 1], [37, 5, 90, 64], 4, 2, False), ([70, 129, 3], [200, 40, 3], 2, 2, True),
          ([1, 300], [300, 1], 2, 1, True)]


def packed_case(lens_q, lens_k, hq, hk, seqused, width, dtype):
    """Tensors on CUDA and the keyword arguments of flashop.forward for a packed batch."""
    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), hq, width, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(lens_k), hk, width, device="cuda", dtype=dtype) for _ in range(2))
    used = dict(seqused_q=torch.tensor([n // 2 for n in lens_q], dtype=torch.int32, device="cuda"),
                seqused_k=torch.tensor([n - n // 3 for n in lens_k], dtype=torch.int32, device="cuda")) if seqused else {}
    return q, k, v, dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q),
                         max_seqlen_k=max(lens_k), **used)


def on_cpu(kwargs):
    return {key: val.cpu() if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}


def grad_error(grads, ref):
    """The largest gradient error relative to 1 + |reference|: a sum over hundreds of rows (one key seen by a
    whole packed sequence) reaches magnitudes where half a bfloat16 ulp exceeds any fixed absolute bound."""
    return max(((g.cpu().float() - r).abs() / (1 + r.abs())).max().item() for g, r in zip(grads, ref))


def variant_args(variant, batch, heads):
    left, right, softcap, alibi, sinks = variant
    slopes = torch.rand(batch, heads, device="cuda") if alibi else None
    sink = torch.randn(heads, device="cuda") if sinks else None
    return left, right, softcap, slopes, sink


def cases(width, few_shapes=False):
    """(headdim, shape) pairs a config of this tile width runs."""
    narrower = sorted({d for d in (width - 8, width - 27) if d >= 1})
    if few_shapes:
        return [(width, s) for s in FEW_SHAPES] + [(narrower[0], NARROWER_SHAPES[0])]
    return [(width, s) for s in SHAPES] + [(d, s) for d in narrower for s in NARROWER_SHAPES]


def backward_matches_cpu(name, dtype, headdim, shape, causal, deterministic):
    """The backward config `name` on fresh inputs of `shape` (batch, seqlen_q, seqlen_k, heads_q, heads_k) against
    the CPU kernels' gradients; prints a FAIL line when they differ."""
    b, sq, sk, hq, hk = shape
    q = torch.randn(b, sq, hq, headdim, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, sk, hk, headdim, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = torch.ops.flashop.forward(q, k, v, None, causal)
    dout = torch.randn_like(out)
    grads = torch.ops.flashop.backward(dout, q, k, v, out, lse, None, causal, name, deterministic)
    cpu = [t.cpu().float() for t in (dout, q, k, v, out)]
    err = grad_error(grads, torch.ops.flashop.backward(*cpu, lse.cpu(), None, causal))
    if not err < 5e-2:
        print(f"FAIL {name} d{headdim} {shape} causal={causal}: max relative grad error {err:.3e}")
        return False
    return True


def tail_split_names():
    """Built Hopper backward configs that split a last wave (csrc/cuda/sm90/bwd_tail.h: the plain builds up to W 128)."""
    names = flashop.dispatch.built_configs("backward")
    return [n for n in names if n.startswith("sm90.bwd.") and not n.endswith(".lpt")
            and flashop.dispatch.dtype_and_headdim(n)[1] <= 128]


def tail_split_shape(name):
    """One batch entry of 3 key tiles x (one wave / 3 + 1) kv heads and 64 query tiles, as
    tests/test_sm90_backward.py's tail-split shape."""
    config = HopperBackwardConfig.parse(name)
    wave = torch.cuda.get_device_properties(0).multi_processor_count * (2 if config.block_n == 64 else 1)
    heads_k = wave // 3 + 1
    return 1, 64 * config.block_m - 21, 3 * config.block_n - 37, heads_k, heads_k


def decode_cases():
    """The split-KV decode kernels (flash_attn_with_kvcache) at every tile width and a narrower head dimension:
    contiguous and paged caches (pages of 16 with stale table entries past the pages in use), leftpad, empty
    sequences, forced splits, GQA rows; checked against the CPU kernel. Returns the failures."""
    failures = 0
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for headdim in (64, 40, 128, 72, 256, 200):
            for page_size, splits in ((0, 0), (16, 3)):
                lens, leftpad = torch.tensor([0, 1, 77, 300], dtype=torch.int32), torch.tensor([0, 0, 5, 130],
                                                                                              dtype=torch.int32)
                q = torch.randn(4, 2, 8, headdim, generator=gen).to(dtype)
                cache_k, cache_v = (torch.randn(4, 304, 2, headdim, generator=gen).to(dtype) for _ in range(2))
                kwargs = dict(cache_seqlens=lens, cache_leftpad=leftpad, causal=True, num_splits=splits)
                ref = flashop.flash_attn_with_kvcache(q.float(), cache_k.float(), cache_v.float(), **kwargs)
                if page_size:
                    pages = 304 // page_size
                    order = torch.randperm(4 * pages, generator=gen)
                    table = torch.full((4, pages + 2), 10**6, dtype=torch.int32)  # stale columns never read
                    table[:, :pages] = order.view(4, pages).to(torch.int32)
                    k_pages, v_pages = (torch.empty_like(c.view(4 * pages, page_size, 2, headdim)) for c in (cache_k, cache_v))
                    k_pages[order], v_pages[order] = (c.view(4 * pages, page_size, 2, headdim) for c in (cache_k, cache_v))
                    cache_k, cache_v, kwargs["block_table"] = k_pages, v_pages, table
                on_gpu = {key: val.cuda() if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
                out = flashop.flash_attn_with_kvcache(q.cuda(), cache_k.cuda(), cache_v.cuda(), **on_gpu)
                err = (out.float().cpu() - ref).abs().max().item()
                if not err < 2e-2:
                    failures += 1
                    print(f"FAIL decode {dtype} d{headdim} page {page_size} splits {splits}: max error {err:.3e}")
    return failures


def main(patterns, variants_only=False, few_shapes=False):
    failures = 0
    names = [n for n in flashop.dispatch.built_configs("forward") if any(fnmatch.fnmatch(n, p) for p in patterns)]
    for name in [] if variants_only else names:
        dtype_code, width = flashop.dispatch.dtype_and_headdim(name)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_code]
        for headdim, (b, sq, sk, hq, hk) in cases(width, few_shapes):
            for causal in (False, True):
                if few_shapes:
                    print(f"case {name} d{headdim} {(b, sq, sk, hq, hk)} causal={causal}", flush=True)
                q = torch.randn(b, sq, hq, headdim, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, sk, hk, headdim, device="cuda", dtype=dtype) for _ in range(2))
                out, lse = torch.ops.flashop.forward(q, k, v, None, causal, name)
                ref = flashop.ops.forward_op(q.cpu().float(), k.cpu().float(), v.cpu().float(), None, causal, None)[0]
                err = (out.cpu().float() - ref).abs().max().item()
                if not err < 2e-2:
                    failures += 1
                    print(f"FAIL {name} d{headdim} {(b, sq, sk, hq, hk)} causal={causal}: max error {err:.3e}")
    # Variants: forward configs built with them (dispatch.runs_variants), at their tile width.
    for name in names:
        if not flashop.dispatch.runs_variants(flashop.dispatch.parse_config(name)):
            continue
        dtype_code, width = flashop.dispatch.dtype_and_headdim(name)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_code]
        for variant in VARIANTS:
            for b, sq, sk, hq, hk in VARIANT_SHAPES[:2] if few_shapes else VARIANT_SHAPES:
                q = torch.randn(b, sq, hq, width, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, sk, hk, width, device="cuda", dtype=dtype) for _ in range(2))
                args = variant_args(variant, b, hq)
                out, _ = torch.ops.flashop.forward(q, k, v, None, False, name, False, *args)
                cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
                ref = torch.ops.flashop.forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), None, False, None,
                                                False, *cpu_args)[0]
                err = (out.cpu().float() - ref).abs().max().item()
                if not err < 2e-2:
                    failures += 1
                    print(f"FAIL {name} {variant} {(b, sq, sk, hq, hk)}: max error {err:.3e}")
        print(f"checked {name}: variants", flush=True)
    # Packed batches: forward configs that run them, causal or not, with and without seqused.
    for name in [] if variants_only else names:
        if not flashop.dispatch.runs_packed(flashop.dispatch.parse_config(name)):
            continue
        dtype_code, width = flashop.dispatch.dtype_and_headdim(name)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_code]
        for case in PACKED:
            for causal in (False, True):
                q, k, v, packed = packed_case(*case, width, dtype)
                out, _ = torch.ops.flashop.forward(q, k, v, None, causal, name, **packed)
                ref = torch.ops.flashop.forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), None, causal,
                                                **on_cpu(packed))[0]
                err = (out.cpu().float() - ref).abs().max().item()
                if not err < 2e-2:
                    failures += 1
                    print(f"FAIL {name} packed {case} causal={causal}: max error {err:.3e}")
    # Backward: each matching backward config (names bwd.<dtype>.d<D>...), gradients against the CPU kernels.
    bwd_names = [n for n in flashop.dispatch.built_configs("backward")
                 if any(fnmatch.fnmatch(n.removeprefix("bwd."), p) for p in patterns)]
    for name in bwd_names:
        dtype_code, width = flashop.dispatch.dtype_and_headdim(name)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_code]
        for headdim, (b, sq, sk, hq, hk) in [] if variants_only else cases(width, few_shapes):
            # The wgmma backward (sm90.bwd.*) has no deterministic mode.
            for causal, deterministic in ((False, False), (True, not name.startswith("sm90.bwd."))):
                if few_shapes:
                    print(f"case {name} d{headdim} {(b, sq, sk, hq, hk)} causal={causal}", flush=True)
                failures += not backward_matches_cpu(name, dtype, headdim, (b, sq, sk, hq, hk), causal, deterministic)
        if not few_shapes and name in tail_split_names():
            # A last wave of 1-3 blocks after a full one, blocks of 64 query tiles: the tail split's pieces run.
            failures += not backward_matches_cpu(name, dtype, width, tail_split_shape(name), False, False)
        if not flashop.dispatch.runs_variants(flashop.dispatch.parse_config(name)):
            continue
        for variant in VARIANTS:
            for b, sq, sk, hq, hk in VARIANT_SHAPES[:2] if few_shapes else VARIANT_SHAPES:
                q = torch.randn(b, sq, hq, width, device="cuda", dtype=dtype)
                k, v = (torch.randn(b, sk, hk, width, device="cuda", dtype=dtype) for _ in range(2))
                left, right, softcap, slopes, sink = variant_args(variant, b, hq)
                out, lse = torch.ops.flashop.forward(q, k, v, None, False, None, False, left, right, softcap, slopes,
                                                     sink)
                dout = torch.randn_like(out)
                deterministic = not name.startswith("sm90.bwd.")
                grads = torch.ops.flashop.backward(dout, q, k, v, out, lse, None, False, name, deterministic, left,
                                                   right, softcap, slopes)
                cpu = [t.cpu().float() for t in (dout, q, k, v, out)]
                ref = torch.ops.flashop.backward(*cpu, lse.cpu(), None, False, None, False, left, right, softcap,
                                                 slopes.cpu() if slopes is not None else None)
                err = grad_error(grads, ref)
                if not err < 5e-2:
                    failures += 1
                    print(f"FAIL {name} {variant} {(b, sq, sk, hq, hk)}: max relative grad error {err:.3e}")
        print(f"checked {name}: variants", flush=True)
    # Packed batches: backward configs that run them, deterministic when the config has the mode.
    for name in [] if variants_only else bwd_names:
        if not flashop.dispatch.runs_packed(flashop.dispatch.parse_config(name)):
            continue
        dtype_code, width = flashop.dispatch.dtype_and_headdim(name)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_code]
        for case in PACKED:
            for causal, deterministic in ((False, False), (True, not name.startswith("sm90.bwd."))):
                q, k, v, packed = packed_case(*case, width, dtype)
                out, lse = torch.ops.flashop.forward(q, k, v, None, causal, **packed)
                dout = torch.randn_like(out)
                grads = torch.ops.flashop.backward(dout, q, k, v, out, lse, None, causal, name, deterministic,
                                                   **packed)
                cpu = [t.cpu().float() for t in (dout, q, k, v, out)]
                ref = torch.ops.flashop.backward(*cpu, lse.cpu(), None, causal, **on_cpu(packed))
                err = grad_error(grads, ref)
                if not err < 5e-2:
                    failures += 1
                    print(f"FAIL {name} packed {case} causal={causal}: max relative grad error {err:.3e}")
    failures += decode_cases() if "decode" in patterns and not variants_only else 0
    torch.cuda.synchronize()
    print(f"sanitize cases done: {len(names)} forward and {len(bwd_names)} backward configs, {failures} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    options = ("--variants-only", "--few-shapes")
    args = [a for a in sys.argv[1:] if a not in options]
    main(args or ["bf16.*"], variants_only="--variants-only" in sys.argv[1:], few_shapes="--few-shapes" in sys.argv[1:])
