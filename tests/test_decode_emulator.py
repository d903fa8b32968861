"""The CUDA split-KV decode kernels on the CPU emulator (tests/decode_emulator/test_decode_emu.cpp): their
fragment layouts, cp.async pipeline, warp merge and split combine checked against a float64 reference without a
GPU, at tile widths 64, 128 and 256 and head dimensions below them (NaN input columns past the head dimension,
sentinel output columns, every cp.async source checked against the rows' true width), over contiguous, paged
(pages of 16 and 64) and cache_batch_idx caches, with GQA rows, several queries, leftpad, empty sequences,
splits (more than there are key blocks too) and the attention variants. Needs g++ and the CUDA headers (for
the half/bfloat16 types); skipped where they are absent."""
import shutil
import subprocess

import pytest

from test_cuda_sources import CUDA_INCLUDE, compile_emulator

pytestmark = pytest.mark.skipif(CUDA_INCLUDE is None or shutil.which("g++") is None,
                                reason="needs g++ and the CUDA headers")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return compile_emulator(tmp_path_factory, "decode_emulator")


@pytest.mark.parametrize("mode", [("lazy", "rr"), ("eager", "reverse"), ("lazy", "random")],
                         ids=["interleaved", "warp-runs-ahead", "random-warps"])
def test_decode_kernels_on_the_emulator(emulator, mode):
    result = subprocess.run([emulator, *mode], capture_output=True, text=True, timeout=600)
    tail = result.stdout[-4000:]
    assert result.returncode == 0 and "ALL OK" in result.stdout, tail + result.stderr[-2000:]
    assert "FAIL" not in result.stdout, tail
