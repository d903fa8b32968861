"""Benchmark flashop against torch's scaled_dot_product_attention, in one process.

    python -m flashop.bench --device cpu      # vs torch's CPU SDPA (flash kernel), times and ratios
    python -m flashop.bench --device cuda     # TFLOP/s vs the FLASH_ATTENTION and CUDNN_ATTENTION backends

Times are medians: CUDA-event timings (triton.testing.do_bench) on the GPU, torch.utils.benchmark on
the CPU; on the GPU the implementations take turns over --rounds rounds (median of the rounds).
Ratios > 1 mean flashop is faster. Results go to stdout as a markdown table and, with --out-dir, to
<out-dir>/bench_<device>.{md,json,png}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashop

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
    ms: dict[str, float] = field(default_factory=dict)  # implementation -> median milliseconds

    def tflops(self, impl: str) -> float:
        return self.case.flops() / (self.ms[impl] * 1e-3) / 1e12

    def ratio(self, impl: str, peer: str) -> float:
        return self.ms[peer] / self.ms[impl]


def median_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
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


def cuda_cases(args):
    for dtype in args.dtypes or ["bf16", "fp16"]:
        for headdim in args.headdims or [64, 128, 256]:
            for causal in args.causal:
                for seqlen in args.seqlens or [512, 1024, 2048, 4096, 8192, 16384]:
                    for mode in args.modes or ["fwd"]:
                        batch = max(1, args.tokens // seqlen)
                        heads = args.heads or 2048 // headdim  # 16 heads at d128, as in shared/GPU.md
                        yield Case(dtype, headdim, seqlen, batch, heads, causal, mode)


def run_case(case: Case, device: str, peers: list[str], config=None, rounds: int = 1) -> Result:
    """Each implementation's median time; with rounds > 1 the implementations are timed in turn, round after
    round (the order rotated each round), and each keeps the median of its rounds: the GPU's clock drifts
    with temperature and power over seconds, and a peer timed in one cool or hot stretch would carry that
    into the ratio."""
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
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            if impl in runners:
                samples[impl].append(median_ms(runners[impl], device))
    for impl in impls:
        result.ms[impl] = statistics.median(samples[impl]) if samples[impl] else float("nan")
    del runners
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def harmonic_mean(xs):
    xs = [x for x in xs if x == x and x > 0]
    return statistics.harmonic_mean(xs) if xs else float("nan")


def markdown(results: list[Result], device: str, peers: list[str]) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'CPU'} ({torch.get_num_threads()} threads)"
    lines = [f"Device: {name}; torch {torch.__version__}; {datetime.date.today().isoformat()}", ""]
    unit = "TFLOP/s" if device == "cuda" else "ms"
    head = ["dtype", "d", "causal", "mode", "seqlen", "batch x heads", f"flashop {unit}"]
    head += [f"{p} {unit}" for p in peers] + [f"flashop/{p}" for p in peers]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        c = r.case
        value = (lambda i: f"{r.tflops(i):.1f}") if device == "cuda" else (lambda i: f"{r.ms[i]:.2f}")
        row = [c.dtype, str(c.headdim), str(c.causal), c.mode, str(c.seqlen), f"{c.batch}x{c.heads}", value("flashop")]
        row += [value(p) for p in peers] + [f"{r.ratio('flashop', p):.2f}" for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    # Harmonic means over seqlens, the figure the issues' bars are stated in.
    lines += ["", "Harmonic mean over seqlens of flashop speed / peer speed:", ""]
    groups = {}
    for r in results:
        c = r.case
        groups.setdefault((c.dtype, c.headdim, c.causal, c.mode), []).append(r)
    head = ["dtype", "d", "causal", "mode"] + [f"vs {p}" for p in peers]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, rs in groups.items():
        row = [key[0], str(key[1]), str(key[2]), key[3]] + [f"{harmonic_mean([r.ratio('flashop', p) for r in rs]):.3f}" for p in peers]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[Result], device: str, peers: list[str], path: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    groups = {}
    for r in results:
        c = r.case
        groups.setdefault((c.dtype, c.headdim, c.causal, c.mode), []).append(r)
    cols = 4
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (key, rs) in zip(axes.flat, groups.items()):
        for impl in ["flashop"] + peers:
            ys = [r.tflops(impl) if device == "cuda" else r.ms[impl] for r in rs]
            ax.plot([r.case.seqlen for r in rs], ys, marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{key[0]} d{key[1]} {'causal' if key[2] else 'full'} {key[3]}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s" if device == "cuda" else "ms")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="*", choices=list(DTYPES))
    p.add_argument("--headdims", nargs="*", type=int)
    p.add_argument("--seqlens", nargs="*", type=int)
    p.add_argument("--causal", nargs="*", type=lambda s: s.lower() in ("1", "true", "yes"), default=[False, True])
    p.add_argument("--modes", nargs="*", choices=["fwd", "bwd", "fwd+bwd"])
    p.add_argument("--tokens", type=int, help="batch x seqlen (default 4096 on cpu, 32768 on cuda)")
    p.add_argument("--heads", type=int, help="default 8 on cpu, 2048/headdim on cuda")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    p.add_argument("--config", help="force one kernel config (cuda)")
    p.add_argument("--rounds", type=int, help="time the implementations in turn this many times, keep each one's "
                   "median (default 3 on cuda, 1 on cpu)")
    p.add_argument("--out-dir", help="write bench_<device>.md/.json/.png here")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (32768 if args.device == "cuda" else 4096)
    args.rounds = args.rounds or (3 if args.device == "cuda" else 1)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        peers, cases = ["flash", "cudnn"], list(cuda_cases(args))
    else:
        peers, cases = ["torch"], list(cpu_cases(args))
    from tqdm import tqdm

    results = [run_case(c, args.device, peers, args.config, args.rounds)
               for c in tqdm(cases, desc=f"bench {args.device}")]
    table = markdown(results, args.device, peers)
    print(table)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        stem = os.path.join(args.out_dir, f"bench_{args.device}")
        with open(stem + ".md", "w") as f:
            f.write(table)
        with open(stem + ".json", "w") as f:
            json.dump([{"case": asdict(r.case), "ms": r.ms} for r in results], f, indent=1)
        plot(results, args.device, peers, stem + ".png")
    return results


if __name__ == "__main__":
    main()
