"""Benchmark flashop against torch's scaled_dot_product_attention in one process, and write docs/benchmarks.md.

Regenerate docs/benchmarks.md (this machine's device section; the other devices' sections stay):

    python -m flashop.bench --device cuda --modes fwd bwd fwd+bwd --write-docs docs
    python -m flashop.bench --device cpu --write-docs docs

On the GPU machine `OUT=/tmp/report bash tools/gpu_check.sh build bench` runs the first command into
$OUT/docs/; copy its bench_<device>.json, bench_<device>.png and benchmarks.md into docs/.

--write-docs DIR writes DIR/bench_<device>.json (the results, the source of truth the page is rendered
from), DIR/bench_<device>.png (the plot), and renders DIR/benchmarks.md from every DIR/bench_*.json present.
<device> is a short name of the device (h100, h200, a100, cpu; --slug overrides it).

    python -m flashop.bench --render-docs docs        # re-render docs/benchmarks.md from docs/bench_*.json
    python -m flashop.bench --device cuda --modes fwd --headdims 128          # a report on stdout only
    python -m flashop.bench --device cuda --out-dir /tmp/b   # also /tmp/b/bench_cuda.{md,json,png}

The peers: on the GPU torch's FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION backends (TFLOP/s),
on the CPU torch's own CPU kernel (GFLOP/s). Ratios > 1 mean flashop is faster. How the numbers are taken:
the Method section of docs/benchmarks.md (METHOD in flashop/bench.py).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashop

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("fwd", "bwd", "fwd+bwd")
MODE_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwd+bwd": "Forward + backward"}
PEER_LABELS = {"flash": "FA2", "cudnn": "cuDNN", "torch": "torch"}
REPORT_FORMAT = 1

# Seconds of an implementation's own back-to-back calls before each of its timings (why: METHOD, Timing on the GPU).
SETTLE_SECONDS = 0.3

METHOD = f"""\
## Method

* **Work**: FLOPs = 4·B·Hq·Sq·Sk·D for the forward, halved when causal (Sq = Sk here); the backward
  counts 2.5x the forward, forward + backward 3.5x. Speeds are those FLOPs over the median time.
* **Shapes**: q, k and v of shape (batch, seqlen, heads, headdim) with batch x seqlen = 32768 tokens and
  2048 / headdim heads (rounded down) on the GPU (16 heads at d128), 4096 tokens and 8 heads on the CPU. On
  the GPU every length at d64, d128 and d256 in both dtypes, and bf16 at 4k and 16k for the other head
  dimensions models use (80, 96, 160, 192, 224). The peers see the
  same memory as (batch, heads, seqlen, headdim) views. flashop runs the kernel its policy picks
  (`config=None`), as a user's call would.
* **Modes**: `fwd` is the forward under `torch.no_grad()`; `bwd` the backward alone (`torch.autograd.grad`
  of a forward run once beforehand); `fwd+bwd` the forward and its backward together.
* **Timing on the GPU**: the median of CUDA-event timings by `triton.testing.do_bench` (warm-up 25 ms, 100 ms of
  repetitions and at least 25 calls, the L2 cache flushed before each call), after one untimed call of each
  implementation. The implementations are timed in turn, round after round (3 rounds; round pairs take the order
  and its reverse, rotated by one more each pair, so that each follows each other about equally often), each
  after {SETTLE_SECONDS} s of its own back-to-back calls, and each keeps the median of its rounds, so a stretch
  of higher or lower clock does not fall on one of them only. At the power limit the clock follows the last few hundred ms of
  load: with the order only rotated, the implementation timed after FA2 (which draws less power) gained
  1.5-2.5%. Each device's header names the timing its rows had.
* **Timing on the CPU**: the median of `torch.utils.benchmark.Timer.blocked_autorange` (at least 0.5 s).
* **Peers**, in the same process: on the GPU `torch.nn.functional.scaled_dot_product_attention` with the
  FLASH_ATTENTION backend (FlashAttention-2, "FA2") and the CUDNN_ATTENTION backend ("cuDNN"); on the CPU
  the same function with torch's default CPU kernel ("torch"). A "-" is a shape the peer refused.
* **Attention variants** (`--variants`): causal bf16 d128, 8k tokens, batch 4, 16 heads, with a 1024-key window,
  softcap 30, ALiBi (the paper's slopes) or a sink per head, against FlexAttention (`torch.compile`d
  `flex_attention`, the equivalent block mask and score mod, sinks applied through its lse); FLOPs count the
  visible (query, key) pairs. Beside them the window's cost: causal 32k keys with a 4k window against 32k
  queries over 4k keys, dense.
* **Packed batches** (`--varlen`): 32k tokens of causal sequences with lengths uniform in 128..4096 (a fixed
  seed), bf16 d128, 16 heads, against `torch.nn.attention.varlen.varlen_attn` and flashop's own dense causal
  batch at the mean length; FLOPs of the causal pairs of each sequence.
* **Decode** (`--decode`): one query token per sequence over a full KV cache (32 query / 8 KV heads, d128,
  bf16; batch 1, 8 and 64, 4k to 128k cached tokens): `flash_attn_with_kvcache` on a contiguous cache and on
  pages of 16 and 256 tokens in random order (the paged calls with `FLASHOP_CHECK_INDICES=0`: without
  FlashAttention-2's host read of the longest sequence, as in a CUDA graph), torch's SDPA with the FLASH and
  CUDNN backends on the same memory (`enable_gqa`), and a device-to-device copy of the cache as the bandwidth
  ceiling; GB/s of K/V read (each the median of `--rounds` rounds taken in turn).
* **Per-call overhead** (`--overhead`): batch 1, 128 tokens, 8 heads, d64 (bf16 on the GPU, float32 on the CPU):
  the wall time of 200 back-to-back calls of `flash_attn_func` and of torch's SDPA (default backend), synchronised
  once at the end, per call (median of 7 rounds); the forward alone and with its backward, each called eagerly
  and as a `torch.compile(fullgraph=True)` region.
* **Ratios** are peer time / flashop time: > 1 means flashop is faster. The summary gives the harmonic
  mean of each row's ratios over the sequence lengths.
* Regenerate a device's section with `python -m flashop.bench --device cuda --modes fwd bwd fwd+bwd
  --write-docs docs` (or `--device cpu`); the other devices' sections are kept.
"""


@dataclass
class Case:
    dtype: str
    headdim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    mode: str  # "fwd" | "bwd" | "fwd+bwd"

    def flops(self) -> float:
        """4*B*H*S^2*D forward (halved when causal); backward counts 2.5x forward."""
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.headdim
        f = f / 2 if self.causal else f
        return {"fwd": f, "bwd": 2.5 * f, "fwd+bwd": 3.5 * f}[self.mode]


@dataclass
class Result:
    case: Case
    ms: dict[str, float] = field(default_factory=dict)  # implementation -> median milliseconds (nan: failed)

    def tflops(self, impl: str) -> float:
        return self.case.flops() / (self.ms[impl] * 1e-3) / 1e12

    def ratio(self, impl: str, peer: str) -> float:
        return self.ms[peer] / self.ms[impl]


def spin_up(device: str, seconds: float = 1.0) -> None:
    """Keeps the GPU busy for a moment, so the first timed case does not run while its clock ramps up from idle."""
    if device != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


# do_bench repeats a call for `rep` ms: 100 ms is 4 calls of a 26 ms training step (d128, 16k), whose median
# swings by several percent from one round to the next, so long calls get this many at least.
MIN_TIMED_CALLS = 25


def median_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        rep = max(100.0, MIN_TIMED_CALLS * start.elapsed_time(end))
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    import torch.utils.benchmark as benchmark

    measurement = benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5)
    return measurement.median * 1e3


def make_runner(impl, case: Case, device: str, config=None):
    """A closure running one implementation on fresh random (B, S, H, D) inputs; peers see the same
    memory as (B, H, S, D) views."""
    dtype = DTYPES[case.dtype]
    grad = case.mode != "fwd"
    q, k, v = (torch.randn(case.batch, case.seqlen, case.heads, case.headdim, device=device, dtype=dtype,
                           requires_grad=grad) for _ in range(3))
    dout = torch.randn_like(q)
    if impl == "flashop":
        def attend():
            return flashop.flash_attn_func(q, k, v, causal=case.causal, config=config)
    else:
        backend = {"torch": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

        def attend():
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            if backend is None:
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=case.causal).transpose(1, 2)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=case.causal).transpose(1, 2)

    if case.mode == "fwd":
        def run():
            with torch.no_grad():
                attend()
        return run
    if case.mode == "fwd+bwd":
        def run():
            torch.autograd.grad(attend(), (q, k, v), dout)
        return run
    out = attend()

    def run_backward():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return run_backward


def cpu_cases(args):
    for dtype in args.dtypes or ["fp32", "bf16"]:
        for headdim in args.headdims or [64, 128]:
            for seqlen in args.seqlens or [512, 1024, 2048, 4096]:
                for causal in args.causal:
                    for mode in args.modes or ["fwd", "fwd+bwd"]:
                        batch = max(1, args.tokens // seqlen)
                        yield Case(dtype, headdim, seqlen, batch, args.heads or 8, causal, mode)


# The default GPU sweep: every length at the common head dimensions, and the other widths models use
# (ViT-H and Phi-2 80, 96, 160, 192, 224) at two lengths in bf16.
CUDA_HEADDIMS = (64, 128, 256)
CUDA_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
OTHER_HEADDIMS = (80, 96, 160, 192, 224)
OTHER_SEQLENS = (4096, 16384)


def cuda_cases(args):
    sweeps = [(args.dtypes or ["bf16", "fp16"], args.headdims or CUDA_HEADDIMS, args.seqlens or CUDA_SEQLENS)]
    if not args.headdims:
        sweeps.append(([d for d in args.dtypes or ["bf16"] if d == "bf16"], OTHER_HEADDIMS,
                       args.seqlens or OTHER_SEQLENS))
    for dtypes, headdims, seqlens in sweeps:
        for dtype in dtypes:
            for headdim in headdims:
                for causal in args.causal:
                    for seqlen in seqlens:
                        for mode in args.modes or ["fwd"]:
                            batch = max(1, args.tokens // seqlen)
                            heads = args.heads or max(1, 2048 // headdim)  # 16 heads at d128
                            yield Case(dtype, headdim, seqlen, batch, heads, causal, mode)


def settle(fn, device: str, seconds: float = SETTLE_SECONDS) -> None:
    if device != "cuda" or seconds <= 0:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def timing_orders(impls: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: round pairs take the list and its reverse, each rotated by one more each pair, so
    that over 2n rounds each of n implementations runs first twice and follows each neighbour in the list, on
    either side, equally often (with three, every other one; a plain rotation keeps one predecessor for each)."""
    orders = []
    for r in range(rounds):
        base = impls if r % 2 == 0 else impls[::-1]
        shift = (r // 2) % len(impls)
        orders.append(base[shift:] + base[:shift])
    return orders


def run_case(case: Case, device: str, peers: list[str], config=None, rounds: int = 1,
             settle_seconds: float = SETTLE_SECONDS) -> Result:
    """Each implementation's median time; with rounds > 1 the implementations are timed in turn, round after
    round (`timing_orders`), each after `settle_seconds` of its own calls, and each keeps the median of its
    rounds: the GPU's clock drifts with temperature and power over seconds, and a peer timed in one cool or
    hot stretch would carry that into the ratio."""
    result = Result(case)
    impls = ["flashop"] + peers
    runners, samples = {}, {impl: [] for impl in impls}
    for impl in impls:
        try:
            runners[impl] = make_runner(impl, case, device, config)
            runners[impl]()  # warm-up: kernel selection, autotuned backends, lazy init
        except RuntimeError as err:  # a peer backend that refuses the shape (e.g. cuDNN d256 backward)
            print(f"  {impl} failed on {case}: {str(err).splitlines()[0]}")
            runners.pop(impl, None)
    for order in timing_orders(impls, rounds):
        for impl in order:
            if impl in runners:
                settle(runners[impl], device, settle_seconds)
                samples[impl].append(median_ms(runners[impl], device))
    for impl in impls:
        result.ms[impl] = statistics.median(samples[impl]) if samples[impl] else float("nan")
    del runners
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# --- attention variants against FlexAttention ----------------------------------------------------------------

# name -> (causal, window_size, softcap, alibi, sink). The shapes: bf16, d128, 8k tokens, batch 4, 16 heads.
VARIANT_KINDS = {
    "window 1024": (True, (1024, -1), 0.0, False, False),
    "softcap 30": (True, (-1, -1), 30.0, False, False),
    "ALiBi": (True, (-1, -1), 0.0, True, False),
    "sinks": (True, (-1, -1), 0.0, False, True),
}


@dataclass
class VariantCase:
    variant: str
    dtype: str
    headdim: int
    seqlen_q: int
    seqlen_k: int
    batch: int
    heads: int
    mode: str

    def visible_pairs(self) -> int:
        """(query, key) pairs the mask lets through, summed over the rows (FLOPs count only these)."""
        causal, (left, right), *_ = VARIANT_KINDS.get(self.variant, (False, (-1, -1)))
        return visible_pairs(self.seqlen_q, self.seqlen_k, causal, left, right)

    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.visible_pairs() * self.headdim
        return {"fwd": f, "bwd": 2.5 * f, "fwd+bwd": 3.5 * f}[self.mode]


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, left: int, right: int) -> int:
    rows = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    right = 0 if causal else right
    first = (rows - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    end = (rows + right + 1).clamp(max=seqlen_k) if right >= 0 else torch.full_like(rows, seqlen_k)
    return int((end - first).clamp(min=0).sum())


def _variant_inputs(case: VariantCase, device: str):
    causal, window, softcap, alibi, sink = VARIANT_KINDS[case.variant]
    dtype, grad = DTYPES[case.dtype], case.mode != "fwd"
    q = torch.randn(case.batch, case.seqlen_q, case.heads, case.headdim, device=device, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(case.batch, case.seqlen_k, case.heads, case.headdim, device=device, dtype=dtype,
                        requires_grad=grad) for _ in range(2))
    slopes = flashop.modules.alibi_slopes(case.heads).to(device) if alibi else None
    sinks = torch.randn(case.heads, device=device, requires_grad=grad) if sink else None
    return (q, k, v), dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                           learnable_sink=sinks)


def _flex_attend(case: VariantCase, inputs, args):
    """The same attention through torch's FlexAttention (compiled), with the equivalent mask and score mods;
    sinks rescale its output by its own lse: out * exp(lse - logaddexp(lse, sink))."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    q, k, v = (t.transpose(1, 2) for t in inputs)
    offset = case.seqlen_k - case.seqlen_q
    left, right = args["window_size"]
    right = 0 if args["causal"] else right

    def mask_mod(b, h, q_idx, kv_idx):
        visible = kv_idx >= 0
        if right >= 0:
            visible = visible & (kv_idx <= q_idx + offset + right)
        if left >= 0:
            visible = visible & (kv_idx >= q_idx + offset - left)
        return visible

    softcap, slopes, sinks = args["softcap"], args["alibi_slopes"], args["learnable_sink"]

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap > 0:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[h] * (q_idx + offset - kv_idx).abs()
        return score

    torch._dynamo.reset()  # each case compiles its own mods from scratch (no recompile limit reached)
    block_mask = create_block_mask(mask_mod, None, None, case.seqlen_q, case.seqlen_k, device=q.device)
    flex = torch.compile(flex_attention)

    def attend():
        if sinks is None:
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask).transpose(1, 2)
        out, aux = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        lse = aux.lse
        keep = torch.sigmoid(lse - sinks.view(1, -1, 1))  # exp(lse - logaddexp(lse, sink))
        return (out * keep.unsqueeze(-1).to(out.dtype)).transpose(1, 2)
    return attend


def make_variant_runner(impl: str, case: VariantCase, device: str):
    inputs, args = _variant_inputs(case, device)
    if impl == "flashop":
        def attend():
            return flashop.flash_attn_func(*inputs, **args)
    else:
        attend = _flex_attend(case, inputs, args)
    leaves = [t for t in list(inputs) + [args["learnable_sink"]] if t is not None and t.requires_grad]
    if case.mode == "fwd":
        def run():
            with torch.no_grad():
                attend()
        return run
    dout = torch.randn_like(inputs[0])
    if case.mode == "fwd+bwd":
        return lambda: torch.autograd.grad(attend(), leaves, dout)
    out = attend()
    return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)


def variant_cases(args):
    seqlen = (args.seqlens or [8192])[0]
    for variant in VARIANT_KINDS:
        for mode in args.modes or ["fwd", "fwd+bwd"]:
            yield VariantCase(variant, (args.dtypes or ["bf16"])[0], (args.headdims or [128])[0], seqlen, seqlen,
                              args.batch_variants, args.heads or 16, mode)


def run_variant_cases(args) -> list[dict]:
    """Each variant's median time, flashop and FlexAttention timed in turn (run_case's rounds)."""
    rows = []
    from tqdm import tqdm

    for case in tqdm(list(variant_cases(args)), desc="bench variants"):
        ms = {}
        for r in range(args.rounds):
            for impl in (("flashop", "flex") if r % 2 == 0 else ("flex", "flashop")):
                try:
                    runner = make_variant_runner(impl, case, args.device)
                    runner()
                    ms.setdefault(impl, []).append(median_ms(runner, args.device))
                except (RuntimeError, NotImplementedError) as err:
                    print(f"  {impl} failed on {case}: {str(err).splitlines()[0]}")
        rows.append(dict(asdict(case), flops=case.flops(),
                         ms={impl: _json_ms(statistics.median(t)) for impl, t in ms.items()}))
    return rows


def window_cost_rows(args) -> list[dict]:
    """Cost follows the window: a causal 32k-key problem with a 4k window against a dense problem with 4k keys
    per query (32k queries over 4k keys), both flashop, same batch and heads."""
    seqlen, window = 32768, 4096
    times = {}
    for name, causal, window_size, seqlen_k in (("window 4k", True, (window, -1), seqlen),
                                                ("dense 4k keys", False, (-1, -1), window)):
        q = torch.randn(1, seqlen, args.heads or 16, 128, device=args.device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, seqlen_k, q.size(2), 128, device=args.device, dtype=q.dtype) for _ in range(2))
        try:
            with torch.no_grad():
                fn = lambda: flashop.flash_attn_func(q, k, v, causal=causal, window_size=window_size)  # noqa: E731
                fn()
                times[name] = median_ms(fn, args.device)
        except (RuntimeError, NotImplementedError) as err:
            print(f"  window cost: {name} failed: {str(err).splitlines()[0]}")
    return [dict(case=name, ms=_json_ms(ms)) for name, ms in times.items()]


def variants_section(report: dict, heading: str = "##") -> str:
    u = unit(report)
    lines = [f"{heading}# Attention variants", "",
             "Causal, with a window, softcap, ALiBi or sinks, against FlexAttention (`torch.compile`d "
             "`flex_attention` with the equivalent block mask and score mod; sinks through its lse) in the same "
             f"process. {u} count the visible (query, key) pairs only.", ""]
    head = ["variant", "mode", "dtype", "d", "seqlen", "batch x heads", f"flashop {u}", f"Flex {u}", "vs Flex"]
    rows = []
    per_second = 1e12 if report["device"] == "cuda" else 1e9

    def speed(r, impl):
        ms = r["ms"].get(impl)
        return r["flops"] / (ms * 1e-3) / per_second if ms else None

    for r in report["variants"]:
        ms_ours, ms_flex = r["ms"].get("flashop"), r["ms"].get("flex")
        ratio = ms_flex / ms_ours if ms_ours and ms_flex else None
        rows.append([r["variant"], r["mode"], r["dtype"], str(r["headdim"]), str(r["seqlen_q"]),
                     f"{r['batch']}x{r['heads']}", _fmt(speed(r, "flashop"), ".1f"), _fmt(speed(r, "flex"), ".1f"),
                     _fmt(ratio, ".2f")])
    lines += _table(head, rows) + [""]
    cost = {r["case"]: r["ms"] for r in report.get("window_cost", [])}
    if cost.get("window 4k") and cost.get("dense 4k keys"):
        lines += [f"Cost follows the window: causal 32k keys with a 4k window {cost['window 4k']:.3f} ms, dense "
                  f"32k queries x 4k keys {cost['dense 4k keys']:.3f} ms "
                  f"({cost['window 4k'] / cost['dense 4k keys']:.2f}x).", ""]
    return "\n".join(lines)


# --- packed (variable-length) batches against torch's varlen_attn ---------------------------------------------


def packed_lengths(tokens: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Sequence lengths drawn uniformly from [low, high] (a fixed seed) until `tokens` are filled; the last one
    is cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < tokens:
        n = min(int(torch.randint(low, high + 1, (), generator=gen)), tokens - total)
        lengths.append(n)
        total += n
    return lengths


def _varlen_peer(q, k, v, cu, max_seqlen):
    """torch.nn.attention.varlen.varlen_attn, causal (its signature changed across releases)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **causal)


def run_varlen_cases(args) -> list[dict]:
    """32k tokens of lengths uniform in 128..4096, causal, bf16 d128 16 heads (the first of --dtypes/--headdims,
    --heads), forward and forward + backward: flashop, torch's varlen_attn, and flashop's dense causal problem at
    the mean length. FLOPs: the causal pairs of each sequence, on real tokens."""
    dtype_name, headdim, heads = (args.dtypes or ["bf16"])[0], (args.headdims or [128])[0], args.heads or 16
    dtype, lengths = DTYPES[dtype_name], packed_lengths(args.tokens, 128, 4096)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=args.device)
    max_seqlen, mean = max(lengths), round(sum(lengths) / len(lengths))
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    dense_pairs = (args.tokens // mean) * (mean * (mean + 1) // 2)
    rows = []
    for mode in args.modes or ["fwd", "fwd+bwd"]:
        grad = mode != "fwd"
        q, k, v = (torch.randn(sum(lengths), heads, headdim, device=args.device, dtype=dtype, requires_grad=grad)
                   for _ in range(3))
        dense = [torch.randn(args.tokens // mean, mean, heads, headdim, device=args.device, dtype=dtype,
                             requires_grad=grad) for _ in range(3)]
        attends = {
            "flashop": lambda: flashop.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True),
            "varlen_attn": lambda: _varlen_peer(q, k, v, cu, max_seqlen),
            "dense": lambda: flashop.flash_attn_func(*dense, causal=True),
        }
        ms = {}
        for impl, attend in attends.items():
            leaves = dense if impl == "dense" else [q, k, v]
            if mode == "fwd":
                def run(attend=attend):
                    with torch.no_grad():
                        attend()
            else:
                def run(attend=attend, leaves=leaves):
                    out = attend()
                    torch.autograd.grad(out, leaves, torch.ones_like(out))
            try:
                run()
                ms[impl] = median_ms(run, args.device)
            except (RuntimeError, NotImplementedError, ImportError, TypeError) as err:
                print(f"  varlen: {impl} failed ({mode}): {str(err).splitlines()[0]}")
        factor = {"fwd": 1.0, "fwd+bwd": 3.5}[mode]
        per_pair = 4.0 * heads * headdim * factor
        flops = {"flashop": per_pair * pairs, "varlen_attn": per_pair * pairs, "dense": per_pair * dense_pairs}
        rows.append(dict(mode=mode, dtype=dtype_name, headdim=headdim, heads=heads, sequences=len(lengths),
                         tokens=sum(lengths), mean=mean, max=max_seqlen, flops=flops,
                         ms={impl: _json_ms(t) for impl, t in ms.items()}))
    return rows


def varlen_section(report: dict, heading: str = "##") -> str:
    u = unit(report)
    per_second = 1e12 if report["device"] == "cuda" else 1e9
    lines = [f"{heading}# Packed batches", "",
             "Causal sequences of lengths uniform in 128..4096 packed into one batch, against torch's "
             "`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside torch), and flashop's dense causal "
             f"batch at the mean length. {u} on real tokens.", ""]
    head = ["mode", "dtype", "d", "heads", "sequences (mean, max)", f"flashop {u}", f"varlen_attn {u}",
            "vs varlen_attn", f"dense at the mean {u}", "vs dense"]
    rows = []
    for r in report["varlen"]:
        speed = {impl: r["flops"][impl] / (ms * 1e-3) / per_second for impl, ms in r["ms"].items() if ms}
        ours = speed.get("flashop")
        ratio = {p: ours / speed[p] if ours and speed.get(p) else None for p in ("varlen_attn", "dense")}
        rows.append([r["mode"], r["dtype"], str(r["headdim"]), str(r["heads"]),
                     f"{r['sequences']} ({r['mean']}, {r['max']})", _fmt(ours, ".1f"),
                     _fmt(speed.get("varlen_attn"), ".1f"), _fmt(ratio["varlen_attn"], ".2f"),
                     _fmt(speed.get("dense"), ".1f"), _fmt(ratio["dense"], ".2f")])
    return "\n".join(lines + _table(head, rows) + [""])


# --- decode: one query token over a KV cache, against torch's SDPA and the copy bandwidth ------------------------


DECODE_SHAPES = ((1, (4096, 16384, 65536, 131072)), (8, (4096, 16384, 32768, 131072)), (64, (4096, 16384)))
DECODE_PAGES = (16, 256)


def _paged(cache, page_size, gen):
    """cache (B, L, Hk, D) as pages (B * L / page_size, page_size, Hk, D) in random order, and its block table."""
    batch, length = cache.shape[:2]
    pages = length // page_size
    order = torch.randperm(batch * pages, generator=gen).to(cache.device)
    store = torch.empty(batch * pages, page_size, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    store[order] = cache.reshape(batch * pages, page_size, *cache.shape[2:])
    return store, order.view(batch, pages).to(torch.int32)


def _without_host_index_read(fn, *args, **kwargs):
    """fn called as with FLASHOP_CHECK_INDICES=0: a paged call skips FlashAttention-2's host read (a sync)."""
    saved, flashop.kvcache.CUDA_INDEX_CHECKS = flashop.kvcache.CUDA_INDEX_CHECKS, "none"
    try:
        return fn(*args, **kwargs)
    finally:
        flashop.kvcache.CUDA_INDEX_CHECKS = saved


def run_decode_cases(args) -> list[dict]:
    """One new query token per sequence over a full cache (32 query / 8 KV heads unless --heads, d128, bf16: the
    first of --dtypes/--headdims): flashop.flash_attn_with_kvcache on a contiguous cache and on pages of 16 and 256,
    torch's SDPA (FLASH and CUDNN backends, enable_gqa) on the same memory, and a device-to-device copy of the
    cache. Speed: K/V bytes read per second (the copy: bytes read and written)."""
    dtype_name, headdim = (args.dtypes or ["bf16"])[0], (args.headdims or [128])[0]
    heads_q, heads_k = args.heads or 32, max(1, (args.heads or 32) // 4)
    dtype, gen = DTYPES[dtype_name], torch.Generator().manual_seed(0)
    rows = []
    for batch, lengths in DECODE_SHAPES:
        for length in lengths:
            cache_k, cache_v = (torch.randn(batch, length, heads_k, headdim, device=args.device, dtype=dtype)
                                for _ in range(2))
            q = torch.randn(batch, 1, heads_q, headdim, device=args.device, dtype=dtype)
            lens = torch.full((batch,), length, dtype=torch.int32, device=args.device)
            attends = {"flashop": lambda: flashop.flash_attn_with_kvcache(q, cache_k, cache_v, cache_seqlens=lens)}
            for page_size in DECODE_PAGES:
                (k_pages, table), (v_pages, _) = _paged(cache_k, page_size, gen), _paged(cache_v, page_size, gen)
                attends[f"flashop_page{page_size}"] = (
                    lambda k_pages=k_pages, v_pages=v_pages, table=table: _without_host_index_read(
                        flashop.flash_attn_with_kvcache, q, k_pages, v_pages, cache_seqlens=lens, block_table=table))
            for peer, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa(backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), cache_k.transpose(1, 2),
                                                              cache_v.transpose(1, 2), enable_gqa=True)
                attends[peer] = sdpa
            copy_k = torch.empty_like(cache_k)
            attends["copy"] = lambda copy_k=copy_k: copy_k.copy_(cache_k)
            # Rounds in turn, each implementation keeping the median of its rounds (as the sweep does).
            times = {}
            for _ in range(args.rounds):
                for impl, attend in attends.items():
                    if impl in times and times[impl] is None:
                        continue
                    try:
                        with torch.no_grad():
                            attend()
                            times.setdefault(impl, []).append(median_ms(attend, args.device))
                    except (RuntimeError, NotImplementedError) as err:
                        print(f"  decode: {impl} failed (batch {batch}, {length}): {str(err).splitlines()[0]}")
                        times[impl] = None
            ms = {impl: statistics.median(t) for impl, t in times.items() if t}
            kv_bytes = 2 * batch * length * heads_k * headdim * cache_k.element_size()
            rows.append(dict(batch=batch, seqlen_k=length, heads_q=heads_q, heads_k=heads_k, headdim=headdim,
                             dtype=dtype_name, kv_bytes=kv_bytes, ms={impl: _json_ms(t) for impl, t in ms.items()}))
            del cache_k, cache_v, attends, copy_k
    return rows


def decode_section(report: dict, heading: str = "##") -> str:
    lines = [f"{heading}# Decode", "",
             "One query token per sequence over a full KV cache: GB/s of K/V read (the copy: of the cache's K "
             "read and written), higher is better; ratios: flashop's contiguous cache against the peer.", ""]
    impls = ["flashop", "flashop_page16", "flashop_page256", "flash", "cudnn", "copy"]
    head = ["batch", "cached", "heads q/kv", "d"] + [PEER_LABELS.get(i, i) for i in impls] + ["vs FA2", "vs cuDNN"]
    rows = []
    for r in report["decode"]:
        speed = {}
        for impl in impls:
            ms = r["ms"].get(impl)
            # The copy moves K only, read and written: as many bytes as K and V read.
            speed[impl] = r["kv_bytes"] / (ms * 1e-3) / 1e9 if ms else None
        ours = speed["flashop"]
        ratio = {p: ours / speed[p] if ours and speed.get(p) else None for p in ("flash", "cudnn")}
        rows.append([str(r["batch"]), str(r["seqlen_k"]), f"{r['heads_q']}/{r['heads_k']}", str(r["headdim"])]
                    + [_fmt(speed[i], ".0f") for i in impls] + [_fmt(ratio["flash"], ".2f"), _fmt(ratio["cudnn"], ".2f")])
    return "\n".join(lines + _table(head, rows) + [""])


# --- per-call overhead: wall time of one call on a tiny problem, against torch's SDPA --------------------------

OVERHEAD_SHAPE = (1, 128, 8, 64)  # batch, seqlen, heads, headdim
OVERHEAD_CALLS = 200


def _wall_us_per_call(fn, device: str, rounds: int = 7) -> float:
    """The median over rounds of the wall time of OVERHEAD_CALLS back-to-back calls (synchronised once at the
    end), per call: on a problem this small that is the host's cost of a call."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(OVERHEAD_CALLS):
            fn()
        sync()
        times.append((time.perf_counter() - start) / OVERHEAD_CALLS * 1e6)
    return statistics.median(times)


def run_overhead_cases(args) -> list[dict]:
    """Wall time per call of flashop.flash_attn_func and torch's SDPA (its default backend) on OVERHEAD_SHAPE
    (bf16 on the GPU, float32 on the CPU): the forward and the forward with its backward, called eagerly and
    as a torch.compile(fullgraph=True) region holding the one call."""
    batch, seqlen, heads, headdim = OVERHEAD_SHAPE
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q, k, v = (torch.randn(batch, seqlen, heads, headdim, device=args.device, dtype=dtype) for _ in range(3))
    attends = {"flashop": lambda q, k, v: flashop.flash_attn_func(q, k, v),
               "torch": lambda q, k, v: F.scaled_dot_product_attention(
                   q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)}
    rows = []
    for region in ("eager", "compiled"):
        for mode in ("fwd", "fwd+bwd"):
            us = {}
            for impl, attend in attends.items():
                if region == "compiled":
                    torch._dynamo.reset()
                    attend = torch.compile(attend, fullgraph=True)
                if mode == "fwd":
                    call = lambda attend=attend: attend(q, k, v)  # noqa: E731
                else:
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    grad = torch.randn_like(q)
                    call = lambda attend=attend, leaves=leaves, grad=grad: attend(*leaves).backward(grad)  # noqa: E731
                us[impl] = _wall_us_per_call(call, args.device)
            rows.append(dict(region=region, mode=mode, shape=list(OVERHEAD_SHAPE), dtype=str(dtype).split(".")[-1],
                             us=us))
    return rows


def overhead_section(report: dict, heading: str = "##") -> str:
    batch, seqlen, heads, headdim = OVERHEAD_SHAPE
    lines = [f"{heading}# Per-call overhead", "",
             f"Wall time per call (us, lower is better) on a tiny problem (batch {batch}, {seqlen} tokens, {heads} "
             f"heads, d{headdim}): `flash_attn_func` against torch's SDPA, eagerly and as a compiled region; ratio: "
             "torch's time / flashop's.", ""]
    head = ["region", "mode", "dtype", "flashop", "torch", "ratio"]
    rows = []
    for r in report["overhead"]:
        ours, peer = r["us"].get("flashop"), r["us"].get("torch")
        rows.append([r["region"], r["mode"], r["dtype"], _fmt(ours, ".1f"), _fmt(peer, ".1f"),
                     _fmt(peer / ours if ours and peer else None, ".2f")])
    return "\n".join(lines + _table(head, rows) + [""])


# --- the report: a JSON-able dict per device, rendered to markdown and a plot ------------------------------


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return name


def device_slug(name: str, device: str) -> str:
    """A short file name for a device: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100",
    "NVIDIA GeForce RTX 4090" -> "rtx-4090"; every CPU is "cpu"."""
    if device == "cpu":
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    for i, word in enumerate(words):
        if any(ch.isdigit() for ch in word):
            return "-".join(words[:i + 1])
    return "-".join(words) or device


def _json_ms(ms: float):
    return None if math.isnan(ms) else float(f"{ms:.5g}")  # 5 digits: far below the timings' noise


def make_report(results: list[Result], args, peers: list[str]) -> dict:
    report = {
        "format": REPORT_FORMAT,
        "device": args.device,
        "name": device_name(args.device),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "torch": torch.__version__,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "peers": peers,
        "config": args.config,
        "results": [dict(asdict(r.case), ms={k: _json_ms(v) for k, v in r.ms.items()}) for r in results],
    }
    if args.device == "cuda":
        report["cuda"] = torch.version.cuda
        report["cudnn"] = torch.backends.cudnn.version()
        report["timing"] = f"order balanced over rounds, {SETTLE_SECONDS} s settle"
    else:
        report["threads"] = torch.get_num_threads()
        # Which copy of each side's CPU kernels ran (FLASHOP_CPU_ISA and ATEN_CPU_CAPABILITY force them).
        report["cpu_isa"] = flashop.cpu_isa()
        report["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    report["slug"] = args.slug or device_slug(report["name"], args.device)
    return report


def _speed(report: dict, row: dict, impl: str):
    """TFLOP/s on the GPU, GFLOP/s on the CPU; None where the implementation has no time."""
    ms = row["ms"].get(impl)
    if ms is None or not ms > 0:
        return None
    case = Case(**{k: row[k] for k in ("dtype", "headdim", "seqlen", "batch", "heads", "causal", "mode")})
    return case.flops() / (ms * 1e-3) / (1e12 if report["device"] == "cuda" else 1e9)


def _ratio(row: dict, peer: str):
    ms, peer_ms = row["ms"].get("flashop"), row["ms"].get(peer)
    return peer_ms / ms if ms and peer_ms and ms > 0 and peer_ms > 0 else None


def _harmonic_mean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return statistics.harmonic_mean(xs) if xs else None


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _modes(report: dict) -> list[str]:
    present = {row["mode"] for row in report["results"]}
    return [m for m in MODES if m in present]


def _groups(rows: list[dict], key) -> dict:
    groups = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


def unit(report: dict) -> str:
    return "TFLOP/s" if report["device"] == "cuda" else "GFLOP/s"


def device_section(report: dict, heading: str = "##") -> str:
    """The markdown of one device: what was measured where, the summary, the plot, a table per mode."""
    peers, u = report["peers"], unit(report)
    labels = [PEER_LABELS.get(p, p) for p in peers]
    if report["device"] == "cuda":
        title = report["name"]
        env = f"torch {report['torch']}, CUDA {report.get('cuda')}, cuDNN {report.get('cudnn')}"
    else:
        title = f"CPU: {report['name']}"
        env = f"torch {report['torch']}, {report.get('threads')} threads"
        if report.get("cpu_isa"):
            env += f", flashop's {report['cpu_isa']} kernels, torch's {report.get('torch_cpu_capability')}"
    lines = [f"{heading} {title}", "",
             f"{env}; measured {report['date']}; batch x seqlen = {report['tokens']} tokens, "
             f"{report['rounds']} round{'s' if report['rounds'] != 1 else ''}. {u}, higher is better; "
             "ratios > 1: flashop faster." + (f" Timing: {report['timing']}." if report.get("timing") else ""), ""]
    if report.get("config"):
        lines[-1:-1] = [f"flashop forced to run `{report['config']}` (not the policy's pick).", ""]
    if report.get("variants"):
        lines += [variants_section(report, heading), ""]
    if report.get("varlen"):
        lines += [varlen_section(report, heading), ""]
    if report.get("decode"):
        lines += [decode_section(report, heading), ""]
    if report.get("overhead"):
        lines += [overhead_section(report, heading), ""]
    if not report["results"]:
        return "\n".join(lines)
    modes = _modes(report)
    dtypes = list(dict.fromkeys(r["dtype"] for r in report["results"]))

    def order(r):  # rows by dtype (as measured), headdim, causal, seqlen
        return dtypes.index(r["dtype"]), r["headdim"], r["causal"], r["seqlen"]

    lines += [f"{heading}# Summary", "",
              "Harmonic mean over seqlens of peer time / flashop time:", ""]
    head = ["dtype", "d", "causal"] + [f"{m} vs {label}" for m in modes for label in labels]
    rows = []
    for (dtype, d, causal), group in _groups(sorted(report["results"], key=order),
                                             lambda r: (r["dtype"], r["headdim"], r["causal"])).items():
        cells = [dtype, str(d), str(causal)]
        for m in modes:
            for p in peers:
                cells.append(_fmt(_harmonic_mean([_ratio(r, p) for r in group if r["mode"] == m]), ".2f"))
        rows.append(cells)
    lines += _table(head, rows) + ["", f"![{title}](bench_{report['slug']}.png)", ""]
    for m in modes:
        lines += [f"{heading}# {MODE_TITLES[m]}", ""]
        head = ["dtype", "d", "causal", "seqlen", "batch x heads", f"flashop {u}"]
        head += [f"{label} {u}" for label in labels] + [f"vs {label}" for label in labels]
        rows = []
        for r in sorted((r for r in report["results"] if r["mode"] == m), key=order):
            cells = [r["dtype"], str(r["headdim"]), str(r["causal"]), str(r["seqlen"]), f"{r['batch']}x{r['heads']}",
                     _fmt(_speed(report, r, "flashop"), ".1f")]
            cells += [_fmt(_speed(report, r, p), ".1f") for p in peers] + [_fmt(_ratio(r, p), ".2f") for p in peers]
            rows.append(cells)
        lines += _table(head, rows) + [""]
    return "\n".join(lines)


def load_reports(docs_dir: str) -> list[dict]:
    """Every device report (bench_<slug>.json) in docs_dir: GPUs by name, the CPU last."""
    reports = []
    for path in sorted(glob.glob(os.path.join(docs_dir, "bench_*.json"))):
        with open(path) as f:
            try:
                report = json.load(f)
            except json.JSONDecodeError:
                continue
        # bench_<device>.json from --out-dir has the same format; only the file named by its slug counts.
        if (isinstance(report, dict) and report.get("format") == REPORT_FORMAT and "results" in report
                and os.path.basename(path) == f"bench_{report.get('slug')}.json"):
            reports.append(report)
    return sorted(reports, key=lambda r: (r["device"] == "cpu", r["slug"]))


def render_docs(docs_dir: str) -> str:
    """Write docs_dir/benchmarks.md from the device reports there; returns its path."""
    reports = load_reports(docs_dir)
    lines = ["# flashop benchmarks", "",
             "Generated by `python -m flashop.bench --write-docs docs` from the per-device results in "
             "`docs/bench_<device>.json`; do not edit by hand.", ""]
    if reports:
        lines += ["Devices: " + ", ".join(f"[{r['name'] if r['device'] == 'cuda' else 'CPU'}](#{_anchor(r)})"
                                          for r in reports), ""]
    lines += [METHOD]
    for report in reports:
        lines += [device_section(report)]
    path = os.path.join(docs_dir, "benchmarks.md")
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip("\n") + "\n")
    return path


def _anchor(report: dict) -> str:
    title = report["name"] if report["device"] == "cuda" else f"CPU: {report['name']}"
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def plot(report: dict, path: str) -> bool:
    """One figure per device: a panel per (mode, dtype) row and (headdim, causal) column, speed against
    seqlen for flashop and each peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return False
    results = report["results"]
    by_mode = sorted(results, key=lambda r: MODES.index(r["mode"]))
    row_keys = list(dict.fromkeys((r["mode"], r["dtype"]) for r in by_mode))
    col_keys = list(dict.fromkeys((r["headdim"], r["causal"]) for r in results))
    if not row_keys:
        return False
    size = (2.6 * len(col_keys) + 0.4, 2.0 * len(row_keys) + 0.6)
    fig, axes = plt.subplots(len(row_keys), len(col_keys), figsize=size, squeeze=False)
    impls = ["flashop"] + report["peers"]
    for i, (mode, dtype) in enumerate(row_keys):
        for j, (d, causal) in enumerate(col_keys):
            ax = axes[i][j]
            cell = sorted((r for r in results if (r["mode"], r["dtype"], r["headdim"], r["causal"]) ==
                           (mode, dtype, d, causal)), key=lambda r: r["seqlen"])
            if not cell:
                ax.axis("off")
                continue
            for impl in impls:
                pts = [(r["seqlen"], _speed(report, r, impl)) for r in cell]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label="flashop" if impl == "flashop" else
                            PEER_LABELS.get(impl, impl))
            ax.set_xscale("log", base=2)
            seqlens = [r["seqlen"] for r in cell]
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.tick_params(labelsize=7)
            ax.set_title(f"{mode} {dtype} d{d} {'causal' if causal else 'full'}", fontsize=8)
            if j == 0:
                ax.set_ylabel(unit(report), fontsize=7)
            if i == len(row_keys) - 1:
                ax.set_xlabel("seqlen", fontsize=7)
    handles, labels = next((ax.get_legend_handles_labels() for ax in axes.flat if ax.lines), ([], []))
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"{report['name']} ({report['date']})", fontsize=9, y=0.995, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return True


def report_json(report: dict) -> str:
    """The report as JSON, one result a line (small, and a re-run's diff reads row by row)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in report.items() if k != "results"]
    rows = ",\n".join("  " + json.dumps(row) for row in report["results"])
    return "{\n" + "\n".join(head) + '\n "results": [\n' + rows + "\n ]\n}\n"


def write_report(report: dict, out_dir: str, stem: str, markdown: bool) -> str:
    """out_dir/<stem>.json and .png (and .md: the device's section alone, when asked)."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".json", "w") as f:
        f.write(report_json(report))
    plot(report, base + ".png")
    if markdown:
        with open(base + ".md", "w") as f:
            f.write(device_section(report, heading="#"))
    return base


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES))
    p.add_argument("--headdims", nargs="*", type=int)
    p.add_argument("--seqlens", nargs="*", type=int)
    p.add_argument("--causal", nargs="*", type=lambda s: s.lower() in ("1", "true", "yes"), default=[False, True])
    p.add_argument("--modes", nargs="*", choices=list(MODES),
                   help="default fwd on cuda, fwd and fwd+bwd on cpu; all three with --write-docs")
    p.add_argument("--tokens", type=int, help="batch x seqlen (default 4096 on cpu, 32768 on cuda)")
    p.add_argument("--heads", type=int, help="default 8 on cpu, 2048/headdim on cuda")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--config", help="force one kernel config (cuda)")
    p.add_argument("--rounds", type=int, help="time the implementations in turn this many times, keep each one's "
                   "median (default 3 on cuda, 1 on cpu)")
    p.add_argument("--out-dir", help="write bench_<device>.md/.json/.png here")
    p.add_argument("--write-docs", metavar="DIR", help="write DIR/bench_<slug>.json and .png, then render "
                   "DIR/benchmarks.md from every DIR/bench_*.json")
    p.add_argument("--render-docs", metavar="DIR", help="only render DIR/benchmarks.md from DIR/bench_*.json "
                   "(no benchmark)")
    p.add_argument("--slug", help="the device's short name in --write-docs file names (default: from its name, "
                   "e.g. h100; cpu)")
    p.add_argument("--variants", action="store_true", help="also time windows, softcap, ALiBi and sinks against "
                   "FlexAttention (first of --dtypes/--headdims/--seqlens, default bf16 d128 8k; --modes), and "
                   "the window's cost against a dense problem with as many keys per query")
    p.add_argument("--batch-variants", type=int, default=4, help="batch of the variant cases (default 4)")
    p.add_argument("--varlen", action="store_true", help="also time a packed batch (--tokens tokens of lengths "
                   "uniform in 128..4096, causal) against torch's varlen_attn and flashop's dense batch at the mean "
                   "length")
    p.add_argument("--decode", action="store_true", help="also time one query token over KV caches of 4k..128k "
                   "tokens (batch 1, 8, 64; contiguous and paged) against torch's SDPA and the copy bandwidth")
    p.add_argument("--overhead", action="store_true", help="also time the wall time per call of a tiny problem "
                   "against torch's SDPA, eager and compiled")
    p.add_argument("--no-sweep", action="store_true", help="skip the dense sweep (with --variants, --varlen, "
                   "--decode or --overhead)")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (32768 if args.device == "cuda" else 4096)
    args.rounds = args.rounds or (3 if args.device == "cuda" else 1)
    if args.write_docs and not args.modes:
        args.modes = list(MODES)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.render_docs:
        print(render_docs(args.render_docs))
        return []
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        peers, cases = ["flash", "cudnn"], list(cuda_cases(args))
    else:
        peers, cases = ["torch"], list(cpu_cases(args))
    from tqdm import tqdm

    results = [] if args.no_sweep else [run_case(c, args.device, peers, args.config, args.rounds)
                                        for c in tqdm(cases, desc=f"bench {args.device}")]
    report = make_report(results, args, peers)
    if args.no_sweep:
        spin_up(args.device)  # the sweep would have warmed the GPU for the sections below
    if args.variants:
        report["variants"] = run_variant_cases(args)
        report["window_cost"] = window_cost_rows(args) if args.device == "cuda" else []
    if args.varlen:
        report["varlen"] = run_varlen_cases(args)
    if args.decode:
        report["decode"] = run_decode_cases(args)
    if args.overhead:
        report["overhead"] = run_overhead_cases(args)
    print(device_section(report, heading="#"))
    if args.out_dir:
        write_report(report, args.out_dir, f"bench_{args.device}", markdown=True)
    if args.write_docs:
        write_report(report, args.write_docs, f"bench_{report['slug']}", markdown=False)
        print(render_docs(args.write_docs))
    return results


if __name__ == "__main__":
    main()
