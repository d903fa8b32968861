"""Per-kernel GPU time of one attention call, flashop next to torch's FLASH_ATTENTION and
CUDNN_ATTENTION backends (torch.profiler): which kernel of a backward (preprocess, main, dQ
conversion, torch's own fills and copies) the time goes to.

    python3 tools/kernel_breakdown.py --direction backward --headdim 128 --seqlens 1024 16384 --causal

Same shapes as the benchmark: batch x seqlen = 32768 tokens, 2048 / headdim query heads.
"""
import argparse
import collections

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import flashop


def _call(impl, q, k, v, dout, causal, direction):
    """One forward, or one backward (the forward run once beforehand, as in the benchmark), of
    `impl` on (B, S, H, D) inputs."""
    if impl == "flashop":
        attend = lambda: flashop.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
    else:
        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

        def attend():
            with sdpa_kernel(backend):
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    if direction == "forward":
        def forward():
            with torch.no_grad():
                attend()
        return forward
    out = attend()
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", choices=("forward", "backward"), default="backward")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    for seqlen in args.seqlens:
        batch, heads = max(1, 32768 // seqlen), 2048 // args.headdim
        q, k, v = (torch.randn(batch, seqlen, heads, args.headdim, device="cuda", dtype=dtype, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(batch, seqlen, heads, args.headdim, device="cuda", dtype=dtype)
        print(f"\n## {args.direction} {args.dtype} d{args.headdim} seqlen {seqlen} causal={args.causal} "
              f"({batch}x{heads}); ms per call")
        for impl in ("flashop", "flash", "cudnn"):
            fn = _call(impl, q, k, v, dout, args.causal, args.direction)
            rows = breakdown(fn, args.repeats)
            total = sum(ms for _, ms in rows)
            # Wall time of the call on the GPU (the benchmark's measure, L2 flushed before each call)
            # against the sum of its kernels: the difference is time the GPU spent idle inside the call.
            wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            print(f"{impl:8s} kernels {total:8.3f}  do_bench {wall:8.3f}  idle {wall - total:+7.3f}")
            for name, ms in rows[:6]:
                print(f"    {ms:8.3f}  {name[:110]}")


if __name__ == "__main__":
    main()
