"""The autotuner end to end on a GPU (a small sweep), and forward_timed."""
import os
import subprocess
import sys

import pytest
import torch

import flashop
from flashop import autotune as tune_module
from flashop import dispatch
from flashop.autotune import TIE_TOLERANCE
from flashop.dispatch import Problem
from conftest import CUDA
from reference import attention_reference

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


@needs_cuda
def test_tune_cuda_small_sweep_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOP_CACHE_DIR", str(tmp_path))
    dispatch.clear_caches()
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


@needs_cuda
def test_forward_timed():
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse, ms = flashop.forward_timed(q, k, v, causal=True)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert ms > 0
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_tuner_checks_the_default_against_float32(causal):
    """The tuner's correctness gate: the default's rows against float32 attention, other candidates
    against the default (here the CPU kernel stands in for a GPU config)."""
    problem = Problem("bf16", 64, 200, 150, 2 * 3, causal)
    q = torch.randn(2, 200, 3, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 150, 3, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.ops.flashop.forward(q, k, v, None, causal)
    tune_module._check_rows_against_float32(problem, (q, k, v), out, "cpu")
    assert tune_module._agrees((out, lse), (out.clone(), lse.clone()))
    wrong = out.clone()
    wrong[0, -5:, 0] = 0  # a tile left unwritten
    with pytest.raises(RuntimeError, match="disagrees with a float32 reference"):
        tune_module._check_rows_against_float32(problem, (q, k, v), wrong, "cpu")
    assert not tune_module._agrees((wrong, lse), (out, lse))
    assert not tune_module._agrees((out, lse.roll(1, dims=-1)), (out, lse))
    nan = out.clone()
    nan[1, 7, 2, 3] = float("nan")
    assert not tune_module._agrees(nan, out)


def test_timing_passes_prune_confirm_and_keep():
    """The tuner's pass schedule, with made-up times: configs far behind drop out after pass 1, near
    ties get the confirmation passes, `keep` configs are timed in every pass, and a config's time is the
    median of its passes (one disturbed pass does not decide)."""
    base = {"fast": 1.0, "close": 1.02, "far": 1.5, "kept": 1.4}
    calls = []

    def measure(name, pass_index):
        calls.append((name, pass_index))
        return base[name] * (3.0 if (name, pass_index) == ("close", 1) else 1.0)  # one disturbed pass

    times = tune_module._timing_passes(list(base), measure, keep=("kept",), rounds=3, confirm_rounds=2,
                                       contender_margin=0.03, prune_margin=0.15)
    count = {name: sum(1 for n, _ in calls if n == name) for name in base}
    assert count == {"fast": 5, "close": 5, "far": 1, "kept": 5}
    assert times == pytest.approx(base)
    # Passes are interleaved: pass k of every timed config runs before pass k+1 of any.
    order = [index for _, index in calls]
    assert order == sorted(order)
    # Without `keep`, the slow config is measured once only.
    calls.clear()
    tune_module._timing_passes(list(base), measure, rounds=3, confirm_rounds=2)
    assert sum(1 for n, _ in calls if n == "kept") == 1


def test_importing_the_command_line_keeps_flashop_tune_callable(monkeypatch):
    import importlib

    command_line = importlib.import_module("flashop.tune")  # rebinds flashop.tune to the module
    calls = []
    monkeypatch.setattr(command_line, "tune", lambda *args, **kwargs: calls.append((args, kwargs)) or "tuned")
    assert flashop.tune(["problem"], write=False) == "tuned"
    assert calls == [((["problem"],), {"write": False})]
