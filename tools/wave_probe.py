"""Wave quantisation of one forward config: time (CUDA events, median) against the number of CTAs.

Batch 1, seqlen_q = seqlen_k, non-causal, heads 1..N: the grid grows by one head's query tiles per
step, so the time steps up each time the tiles pass a multiple of the CTAs (or clusters) that run at
once. Run it with FLASHOP_SM90_SPLIT_LAST_WAVE=0 and without to see what the split last wave removes.

    python3 tools/wave_probe.py sm90.bf16.d128.br128.bc192.mc.tmao --seqlen 8192 --heads 40
"""
import argparse

import torch
import triton.testing

import flashop


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=40)
    args = p.parse_args()
    config = flashop.configs.HopperConfig.parse(args.config)
    dtype, d = {"bf16": torch.bfloat16, "fp16": torch.float16}[config.dtype], config.headdim
    s = args.seqlen
    q_tiles = -(-s // config.block_m)
    for h in range(1, args.heads + 1):
        q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
        ms = triton.testing.do_bench(lambda: torch.ops.flashop.forward(q, k, v, None, False, args.config),
                                     warmup=10, rep=50, return_mode="median")
        tflops = 4 * h * s * s * d / ms / 1e9
        print(f"heads {h:3d} tiles {h * q_tiles:5d}: {ms * 1e3:8.1f} us  {ms * 1e3 / (h * q_tiles):7.2f} us/tile"
              f"  {tflops:5.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
