"""SM clock and board power while one attention implementation runs back to back.

    python3 tools/probes/power_probe.py --dtype bf16 --headdim 128 --seqlen 8192 --seconds 4 [--mode bwd]

Each implementation (flashop, cuDNN, flashop again; then a plain matmul for reference) runs alone for
--seconds on the benchmark's shape (batch x seqlen = 32768 tokens, 2048 / headdim heads) while nvidia-smi
samples the GPU every 100 ms;
per implementation: TFLOP/s over the window (CUDA events), and the mean SM clock and power of the
samples inside it (the first second left out: the clock settles). Shows whether a kernel runs at a
lower clock than its peer under the same load (power-bound) rather than doing less per cycle.
"""
import argparse
import csv
import datetime
import io
import statistics
import subprocess
import time

import torch

from flashop.bench import DTYPES, MODES, Case, make_runner


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mode", choices=MODES, default="fwd",
                        help="the benchmark's mode: the forward, the backward, or a forward+backward call")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--config", default=None, help="flashop config (default: the policy's pick)")
    parser.add_argument("--gemm", type=int, default=8192, metavar="N",
                        help="also an N x N x N matmul in the same dtype (cuBLAS): the rate the tensor cores reach at "
                             "this power limit without a softmax (0: leave it out)")
    args = parser.parse_args()
    case = Case(args.dtype, args.headdim, args.seqlen, max(1, 32768 // args.seqlen), 2048 // args.headdim,
                args.causal, args.mode)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    windows = []
    try:
        time.sleep(1.0)
        for impl in ("flashop", "cudnn", "flashop") + (("gemm",) if args.gemm else ()):
            if impl == "gemm":
                a, b = (torch.randn(args.gemm, args.gemm, device="cuda", dtype=DTYPES[args.dtype]) for _ in range(2))
                run, flops = (lambda: torch.matmul(a, b)), 2.0 * args.gemm ** 3
            else:
                run = make_runner(impl, case, "cuda", config=args.config if impl == "flashop" else None)
                flops = case.flops()
            run()
            torch.cuda.synchronize()
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.time()
            start_event.record()
            calls = 0
            while time.time() - t0 < args.seconds:
                for _ in range(8):
                    run()
                calls += 8
                torch.cuda.synchronize()  # keep the host within a few calls of the GPU
            end_event.record()
            torch.cuda.synchronize()
            t1 = time.time()
            tflops = flops * calls / (start_event.elapsed_time(end_event) * 1e-3) / 1e12
            windows.append((impl, t0, t1, tflops))
            time.sleep(1.0)  # idle gap between windows
    finally:
        smi.terminate()
        output, _ = smi.communicate()
    samples = []  # (unix time, MHz, W)
    for row in csv.reader(io.StringIO(output)):
        if len(row) == 3:
            stamp = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(row[1]), float(row[2])))
    print(f"{case.mode} {case.dtype} d{case.headdim} seqlen {case.seqlen} causal={case.causal}: "
          f"{torch.cuda.get_device_name()}, {len(samples)} samples")
    print("| implementation | TFLOP/s | SM MHz | W | TFLOP/s per GHz |")
    print("|---|---|---|---|---|")
    for impl, t0, t1, tflops in windows:
        inside = [s for s in samples if t0 + 1.0 <= s[0] <= t1]
        mhz = statistics.mean(s[1] for s in inside) if inside else float("nan")
        watts = statistics.mean(s[2] for s in inside) if inside else float("nan")
        print(f"| {impl} | {tflops:.1f} | {mhz:.0f} | {watts:.0f} | {tflops / (mhz / 1000):.1f} |")


if __name__ == "__main__":
    main()
