"""The autotuner end to end on a GPU (a small sweep), and forward_timed."""
import os
import subprocess
import sys

import pytest
import torch

import flashop
from flashop import dispatch
from flashop.dispatch import Problem
from flashop.tune import TIE_TOLERANCE
from conftest import CUDA
from reference import attention_reference

pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


def test_tune_cuda_small_sweep_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOP_CACHE_DIR", str(tmp_path))
    dispatch._loaded_cache.clear()
    dispatch._choose_cached.cache_clear()
    problems = [(Problem("bf16", 64, 1024, 1024, 2 * 4, causal), (2, 4)) for causal in (False, True)]
    results = flashop.tune(problems, progress=False, quiet=True)
    assert len(results) == 2
    cached = dispatch.read_cache()[dispatch.DeviceInfo.of(torch.cuda.current_device()).name]
    for key, (best, times) in results.items():
        # The fastest, or the heuristic's pick when it is within the tie tolerance of the fastest.
        assert cached[key] == best and times[best] <= min(times.values()) * (1 + TIE_TOLERANCE)
    # A later process picks the tuned entry up by itself.
    script = ("import torch, flashop; from flashop import dispatch; "
              "q = torch.randn(2, 1024, 4, 64, device='cuda', dtype=torch.bfloat16); "
              "print(dispatch.config_for(q, q, True, 'forward'))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "FLASHOP_CACHE_DIR": str(tmp_path)}).stdout.strip()
    assert out == results[dispatch.bucket_key(problems[1][0])][0]


def test_forward_timed():
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse, ms = flashop.forward_timed(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert ms > 0
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
