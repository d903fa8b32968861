"""The CUDA backward kernels on a CPU emulator (tests/bwd_emulator/test_bwd_emu.cpp): their index
math, fragment layouts and barriers checked against a float64 reference without a GPU, at the tile
width and at head dimensions below it (NaN input columns past the head dimension, sentinel output
columns, every cp.async source checked against the rows' true width), and with the attention variants
(windows, softcap, ALiBi, an lse that carries sinks; deterministic mode with key tiles that skip query
tiles), and packed batches (cu_seqlens, seqused: an empty sequence, tails, tiles cut by seqused); and the dQ
convert kernel in each accumulator order (rows, paired rows, the Hopper wide builds' fragment order). Needs g++ and the CUDA headers (for the half/bfloat16 types); skipped where they are absent."""
import shutil
import subprocess

import pytest

from test_cuda_sources import CUDA_INCLUDE, compile_emulator

pytestmark = pytest.mark.skipif(CUDA_INCLUDE is None or shutil.which("g++") is None,
                                reason="needs g++ and the CUDA headers")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return compile_emulator(tmp_path_factory, "bwd_emulator")


@pytest.mark.parametrize("mode", [("lazy", "rr"), ("eager", "reverse", "-", "edge")],
                         ids=["interleaved", "warp-runs-ahead-edge-shapes"])
def test_backward_kernels_on_the_emulator(emulator, mode):
    result = subprocess.run([emulator, "all", *mode], capture_output=True, text=True, timeout=1800)
    tail = result.stdout[-4000:]
    assert result.returncode == 0 and "ALL OK" in result.stdout, tail
    assert "FAIL" not in result.stdout, tail
