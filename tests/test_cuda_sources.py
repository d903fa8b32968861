"""The CUDA sources without a GPU: the kernel-config names, the generator's output, the index math
of the sm80 kernels (tools/check_sm80_layouts.py), and nvcc compiling a representative subset for
sm_80 so a syntax or template error fails CI. Skipped only where nvcc is absent."""
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.utils.cpp_extension as cpp_extension

from flashop.configs import FORWARD_CONFIGS, KernelConfig, selected_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_cuda_home():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


CUDA_HOME = find_cuda_home()
NVCC = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
CUDA_INCLUDE = os.path.join(CUDA_HOME, "include") if CUDA_HOME else None


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"_flashop_tool_{name}", os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_config_names_round_trip():
    for config in FORWARD_CONFIGS:
        assert KernelConfig.parse(config.name) == config
    assert len({c.name for c in FORWARD_CONFIGS}) == len(FORWARD_CONFIGS)


def test_selected_configs_patterns():
    assert selected_configs({}) == list(FORWARD_CONFIGS)
    d128 = selected_configs({"FLASHOP_KERNELS": "bf16.d128.*"})
    assert d128 and all(c.dtype == "bf16" and c.headdim == 128 for c in d128)
    assert [c.name for c in selected_configs({"FLASHOP_KERNELS": "fp16.d64.br64.bc64.w4"})] == ["fp16.d64.br64.bc64.w4"]
    with pytest.raises(ValueError, match="match no kernel config"):
        selected_configs({"FLASHOP_KERNELS": "bf16.d999.*"})


def test_generator_output(tmp_path):
    gen = load_tool("gen_kernels")
    configs = selected_configs({"FLASHOP_KERNELS": "bf16.d128.*,fp16.d64.br128.bc64.w4"})
    paths = gen.generate(str(tmp_path), configs)
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        [gen.file_name(c) for c in configs] + ["registry_fwd.cu"])
    registry = (tmp_path / "registry_fwd.cu").read_text()
    for config in configs:
        assert f'"{config.name}"' in registry
        assert "launch_fwd<" in (tmp_path / gen.file_name(config)).read_text()
    # Unchanged files are not rewritten (ninja stays incremental); dropped configs are removed.
    mtimes = {p: os.stat(p).st_mtime_ns for p in paths}
    assert gen.generate(str(tmp_path), configs) == paths
    assert all(os.stat(p).st_mtime_ns == t for p, t in mtimes.items())
    gen.generate(str(tmp_path), configs[:1])
    assert sorted(os.listdir(tmp_path)) == sorted([gen.file_name(configs[0]), "registry_fwd.cu"])


def test_sm80_index_math():
    """Swizzle, cp.async/ldmatrix addressing, mma fragment algebra and causal tile ranges, on the CPU."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_sm80_layouts.py")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def nvcc_compile(source, out_dir, arch="80"):
    cmd = [NVCC, "-c", source, "-o", os.path.join(out_dir, os.path.basename(source) + ".o"), "-O3", "-std=c++17",
           "--use_fast_math", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           f"-I{os.path.join(ROOT, 'csrc')}"]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_nvcc_compiles_representative_kernels(tmp_path):
    """Forward and backward mma.sync kernels for sm_80, the wgmma + TMA kernels and the GPU probes (tools/*.cu,
    built on the GPU machine by tools/gpu_check.sh) for sm_90a."""
    gen = load_tool("gen_kernels")
    subset = [KernelConfig.parse(n) for n in ("bf16.d128.br128.bc64.w4.kv2", "fp16.d64.br128.bc64.w4")]
    jobs = [(s, "80") for s in gen.generate(str(tmp_path / "gen"), subset)]
    bwd = load_tool("gen_bwd_kernels")
    jobs += [(s, "80") for s in bwd.generate(str(tmp_path / "gen"), "bwd.bf16.d128.bc128.br64.w8.k32")]
    jobs += [(os.path.join(ROOT, f"csrc/cuda/sm90/{f}_sm90.cu"), "90a") for f in ("forward", "backward")]  # Hopper
    jobs += [(os.path.join(ROOT, f"tools/{f}.cu"), "90a") for f in ("wgmma_rate", "cluster_occupancy")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: nvcc_compile(job[0], str(tmp_path), job[1]), jobs))
    for cmd, result in results:
        assert result.returncode == 0, " ".join(cmd) + "\n" + result.stderr[-5000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_cuda_glue_compiles(tmp_path):
    """The host glue against torch's headers (compile only: this torch may have no CUDA libraries).
    A CPU build of torch ships c10/cuda's headers but not the one CMake writes; an empty one stands in."""
    shim = tmp_path / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = cpp_extension.include_paths() + [CUDA_INCLUDE, os.path.join(ROOT, "csrc"), str(tmp_path)]
    for source in ("csrc/cuda/forward_cuda.cpp", "csrc/cuda/backward_cuda.cpp", "csrc/cuda/glue.cpp",
                   "csrc/cuda/sm90/bindings_sm90.cpp"):
        cmd = ["g++", "-fsyntax-only", "-std=c++17", "-DFLASHOP_WITH_CUDA", os.path.join(ROOT, source)]
        cmd += [f"-I{p}" for p in includes]
        cmd += [f"-I{__import__('sysconfig').get_paths()['include']}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, " ".join(cmd) + "\n" + result.stderr[-5000:]
