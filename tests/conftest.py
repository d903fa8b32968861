import os

import pytest
import torch

import flashop  # noqa: F401  (registers the ops)

CUDA = torch.cuda.is_available()

# A crash in native code prints its C++ stack, not only the Python one (faulthandler).
if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
    torch._C._set_print_stack_traces_on_fatal_signal(True)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")),
]


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs in every test; the seed is printed so a failure can be replayed
    with FLASHOP_TEST_SEED."""
    seed = int(os.environ.get("FLASHOP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    torch.manual_seed(seed)
    print(f"FLASHOP_TEST_SEED={seed}")
    yield seed


@pytest.fixture(autouse=True)
def _reset_dynamo():
    yield
    torch._dynamo.reset()


def cuda_cannot_run(device, dtype, headdim):
    """CUDA kernels take float16/bfloat16 at every headdim from 1 to 256; float32 must be a clear error."""
    return device == "cuda" and (dtype == torch.float32 or not 1 <= headdim <= 256)


def assert_cuda_refuses(fn):
    with pytest.raises(RuntimeError, match="no built CUDA kernel runs"):
        fn()


def capture_cuda_graph(fn):
    """(graph, fn's outputs in the graph's memory): fn run once on a side stream (lazy initialisation outside the
    capture), then captured; graph.replay() reruns it on whatever its inputs then hold."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
