"""Per-kernel GPU time of one attention call, flashop next to torch's FLASH_ATTENTION and
CUDNN_ATTENTION backends (torch.profiler): which kernel of a backward (preprocess, main, dQ
conversion, torch's own fills and copies) the time goes to.

    python3 tools/probes/kernel_breakdown.py --direction backward --headdim 128 --seqlens 1024 16384 --causal
    python3 tools/probes/kernel_breakdown.py --direction forward --headdim 64 --seqlens 1024 --causal \
        --configs NAME [NAME ...]   # also these configs next to the policy's pick (a backward config, bwd.* or
                                    # sm90.bwd.*, runs behind the policy's forward in forward+backward)
    python3 tools/probes/kernel_breakdown.py --direction forward+backward --seqlens 1024 --causal
        # a training step's call (the benchmark's fwd+bwd): idle time between the forward and the backward shows
        # as wall - kernels
    python3 tools/probes/kernel_breakdown.py --direction forward+backward --seqlens 2048 --timeline
        # each call as the benchmark runs it (after an L2 flush): every kernel's start after the flush ended and
        # the GPU's idle time before it (median over the calls); --sustain 3: after 3 s of back-to-back calls
    python3 tools/probes/kernel_breakdown.py --direction forward+backward --seqlens 4096 --causal --ab --impls cudnn \
        --configs sm90.bwd.bf16.d128.br64.bc128 sm90.bwd.bf16.d128.br64.bc128.lpt
        # the benchmark's timing and a loop timed as a whole, per implementation and named config, in turn
    python3 tools/probes/kernel_breakdown.py --composition --seqlens 2048 16384 --causal
        # fwd, bwd and fwd+bwd of each implementation timed in one process: what the training step's call costs
        # beyond its forward and its backward timed apart

Same shapes as the benchmark: batch x seqlen = 32768 tokens, 2048 / headdim query heads.
"""
import argparse
import collections
import dataclasses
import statistics
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from flashop.bench import MODES, Case, make_runner, median_ms, timing_orders


def breakdown(fn, repeats):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / repeats / 1e3  # ms per call
    return sorted(per_kernel.items(), key=lambda kv: -kv[1])


def timeline(fn, repeats, sustain=0.0):
    """(kernel, median start after the flush, median idle time before it, median duration) in ms, per kernel of
    one call, each call run as triton's do_bench runs it: behind a pass over 256 MB that flushes the L2 (an int8
    add, whose kernel no attention call launches, marks where each call starts). With `sustain` the calls run back
    to back for that many seconds first, inside the profiled region (starting the profiler idles the GPU, which
    then boosts its clock again), and only the last `repeats` count: they see the clock the benchmark's sustained
    load settles at (at the power limit), not a cool GPU's boost clock."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.time()
        while time.time() - start < sustain:
            for _ in range(4):
                flush.add_(1)
                fn()
            torch.cuda.synchronize()
        for _ in range(repeats):
            flush.add_(1)
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    calls, current = [], None
    for event in kernels:
        if "signed char" in event.name:
            current = {"flush_end": event.time_range.end, "kernels": []}
            calls.append(current)
        elif current is not None:
            current["kernels"].append(event)
    calls = calls[-repeats:]
    rows = collections.defaultdict(lambda: ([], [], []))
    for call in calls:
        previous_end = call["flush_end"]
        for i, event in enumerate(call["kernels"]):
            start, idle, duration = rows[(i, event.name)]
            start.append((event.time_range.start - call["flush_end"]) / 1e3)
            idle.append(max(0.0, event.time_range.start - previous_end) / 1e3)
            duration.append((event.time_range.end - event.time_range.start) / 1e3)
            previous_end = max(previous_end, event.time_range.end)
    return [(name, statistics.median(a), statistics.median(b), statistics.median(c))
            for (_, name), (a, b, c) in sorted(rows.items())]


def composition(impl, case, rounds):
    """Median ms of the forward, the backward and the forward+backward call of one implementation on the case's
    shape (the benchmark's runners and timing), the three timed in turn `rounds` times in this process."""
    runners = {mode: make_runner(impl, dataclasses.replace(case, mode=mode), "cuda") for mode in MODES}
    for fn in runners.values():
        fn()
    samples = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, fn in runners.items():
            samples[mode].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return {mode: statistics.median(ms) for mode, ms in samples.items()}


def named_backward_runner(case, config):
    """The backward op with a named backward config on the case's inputs (for bwd the forward run once
    beforehand by the policy's pick, for fwd+bwd in every call): the benchmark's runners name forward configs
    only."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    q, k, v = (torch.randn(case.batch, case.seqlen, case.heads, case.headdim, device="cuda", dtype=dtype)
               for _ in range(3))
    out, lse = torch.ops.flashop.forward(q, k, v, None, case.causal)
    dout = torch.randn_like(out)
    if case.mode == "fwd+bwd":
        def forward_backward():
            out, lse = torch.ops.flashop.forward(q, k, v, None, case.causal)
            torch.ops.flashop.backward(dout, q, k, v, out, lse, None, case.causal, config)
        return forward_backward
    return lambda: torch.ops.flashop.backward(dout, q, k, v, out, lse, None, case.causal, config)


def loop_ms(fn, seconds=1.0):
    """ms per call over back-to-back calls for about `seconds`, each behind do_bench's L2 flush (a zeroed
    256 MB int32 buffer), timed by one pair of CUDA events around the whole loop (no event between calls), less
    as many flushes timed alone."""
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    flush.zero_()
    fn()
    end.record()
    end.synchronize()
    calls = max(5, int(seconds * 1e3 / start.elapsed_time(end)))
    start.record()
    for _ in range(calls):
        flush.zero_()
        fn()
    end.record()
    end.synchronize()
    flush_start, flush_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush_start.record()
    for _ in range(calls):
        flush.zero_()
    flush_end.record()
    flush_end.synchronize()
    return (start.elapsed_time(end) - flush_start.elapsed_time(flush_end)) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", choices=("forward", "backward", "forward+backward"), default="backward")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeline", action="store_true",
                        help="each kernel's start and the idle time before it, calls run behind an L2 flush")
    parser.add_argument("--ab", action="store_true",
                        help="each implementation and config timed as the benchmark times it (median_ms) and as a "
                             "loop without events between calls, in turn for --rounds rounds")
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="--timeline: run the calls back to back this long before the profiled ones")
    parser.add_argument("--impls", nargs="+", default=["flashop", "flash", "cudnn"],
                        help="the implementations to run (flashop, flash, cudnn)")
    parser.add_argument("--composition", action="store_true",
                        help="per implementation: fwd, bwd and fwd+bwd timed in one process, and what the "
                             "fwd+bwd call costs beyond the other two")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--composition: turns of the three timings; --timeline: turns of the implementations")
    parser.add_argument("--configs", nargs="*", default=[],
                        help="flashop kernel configs to time as well, next to the policy's pick")
    args = parser.parse_args()
    mode = {"forward": "fwd", "backward": "bwd", "forward+backward": "fwd+bwd"}[args.direction]
    for seqlen in args.seqlens:
        # The benchmark's case and runners: its inputs, and for bwd its forward run once beforehand.
        case = Case(args.dtype, args.headdim, seqlen, max(1, 32768 // seqlen), 2048 // args.headdim, args.causal, mode)
        print(f"\n## {args.direction} {args.dtype} d{args.headdim} seqlen {seqlen} causal={args.causal} "
              f"({case.batch}x{case.heads}); ms per call")
        if args.composition:
            print("impl     fwd / bwd / fwd+bwd (ms), fwd+bwd - fwd - bwd")
            for impl in args.impls:
                ms = composition(impl, case, args.rounds)
                extra = ms["fwd+bwd"] - ms["fwd"] - ms["bwd"]
                print(f"{impl:8s} {ms['fwd']:8.3f} {ms['bwd']:8.3f} {ms['fwd+bwd']:8.3f}  {extra:+7.3f} "
                      f"({100 * extra / (ms['fwd'] + ms['bwd']):+.1f}%)")
            continue
        runs = [(impl, None) for impl in args.impls] + [("flashop", c) for c in args.configs]
        runners = {}
        for impl, config in runs:
            if config is not None and ".bwd." in f".{config}":  # a backward config (bwd.*, sm90.bwd.*)
                runners[impl if config is None else config] = named_backward_runner(case, config)
            else:
                runners[impl if config is None else config] = make_runner(impl, case, "cuda", config=config)
        if args.ab:
            # The benchmark's timing (flashop.bench.median_ms: do_bench with its events around each call) and a loop
            # timed as a whole, every runner in turn (the benchmark's timing_orders); medians over the rounds.
            labels = list(runners)
            samples = {label: ([], []) for label in labels}
            for order in timing_orders(labels, args.rounds):
                for label in order:
                    samples[label][0].append(median_ms(runners[label], "cuda"))
                    samples[label][1].append(loop_ms(runners[label]))
            first = labels[0]
            bench0, loop0 = (statistics.median(x) for x in samples[first])
            print(f"{'':36s} {'median_ms':>10s} {'loop':>10s}   {first} / this (median_ms, loop)")
            for label in labels:
                bench, loop = (statistics.median(x) for x in samples[label])
                print(f"{label[:36]:36s} {bench:10.3f} {loop:10.3f}   {bench0 / bench:6.3f} {loop0 / loop:6.3f}")
            continue
        if args.timeline:
            # Rounds in turn in the benchmark's timing_orders (the clock drifts down by a few percent over tens of
            # seconds as the GPU warms, which favours whatever runs first); each figure is the median over rounds.
            labels = list(runners)
            samples = {label: collections.defaultdict(list) for label in labels}
            for order in timing_orders(labels, args.rounds):
                for label in order:
                    for i, row in enumerate(timeline(runners[label], max(args.repeats, 20), args.sustain)):
                        samples[label][(i, row[0])].append(row[1:])
            for label in labels:
                print(f"{label:8s} kernel: start after the flush / idle before it / duration (ms)")
                call = 0.0
                for (_, name), rows in sorted(samples[label].items()):
                    start, idle, duration = (statistics.median(column) for column in zip(*rows))
                    call = max(call, start + duration)
                    print(f"    {start:8.3f} {idle:8.3f} {duration:8.3f}  {name[:100]}")
                print(f"    call (flush end to last kernel end): {call:8.3f}")
            continue
        for label, fn in runners.items():
            rows = breakdown(fn, args.repeats)
            total = sum(ms for _, ms in rows)
            # Wall time of the call on the GPU (the benchmark's measure, L2 flushed before each call)
            # against the sum of its kernels (profiled with a warm L2): a clearly positive difference
            # is time the GPU spent idle inside the call.
            wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"{label:8s} kernels {total:8.3f}  do_bench {wall:8.3f}  wall - kernels {wall - total:+7.3f}")
            for name, ms in rows[:6]:
                print(f"    {ms:8.3f}  {name[:110]}")


if __name__ == "__main__":
    main()
