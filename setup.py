"""Builds flashop._C: the operator schemas, the CPU kernels always, the CUDA
kernels when the installed torch has CUDA.

Environment:
  FLASHOP_CUDA=0/1       force the CUDA build off/on (default: on when torch has CUDA and nvcc is found)
  FLASHOP_CUDA_ARCHS     mma.sync targets, e.g. "80;90" (default); with 90 the Hopper module flashop._C_sm90
                         (wgmma + TMA, sm_90a only) is built too
  FLASHOP_KERNELS        comma-separated patterns of forward kernel configs to build, mma.sync and Hopper
                         (e.g. "bf16.d128.*,sm90.bf16.d128.*"; see flashop/configs.py)
  FLASHOP_BWD_KERNELS    the same for the backward kernels (names bwd.<dtype>.d<D>..., sm90.bwd.<dtype>...)
  MAX_JOBS               parallel compile jobs (ninja)
"""
import glob
import importlib.util
import os
import re
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def load_by_path(name, relpath):
    """Import a module from a file without importing its package (which needs the built extension)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def want_cuda():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    flag = os.environ.get("FLASHOP_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def cpu_isa_flags():
    """Vector ISA for the CPU kernels (at::vec picks its implementation from CPU_CAPABILITY_*).
    Chosen from the build machine, like -march=native, but only with ISAs ATen knows."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(re.findall(r"\b\w+\b", f.read()))
    except OSError:
        return []
    if os.environ.get("FLASHOP_CPU_ISA", "").lower() == "default":
        return []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
                "-DCPU_CAPABILITY=AVX512"]
    if {"avx2", "fma", "f16c"} <= flags:
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []


def generated_sources(module):
    """The generated instantiation and registry files of an extension module (tools/codegen.py), relative
    to the repository root, written (or left alone when unchanged) under csrc/cuda/instantiations."""
    codegen = load_by_path("flashop_codegen", "tools/codegen.py")
    paths = codegen.generate(os.path.join(ROOT, "csrc/cuda/instantiations"), codegen.MODULES[module])
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def hopper_extension():
    """flashop._C_sm90: the wgmma + TMA forward and backward kernels, built for sm_90a only (a separate
    module, so the mma.sync sources keep their own targets). Built when the CUDA build targets sm_90."""
    from torch.utils.cpp_extension import CUDAExtension

    sources = ["csrc/checks.cpp", "csrc/cuda/glue.cpp", "csrc/cuda/sm90/bindings_sm90.cpp"] + generated_sources("flashop._C_sm90")
    nvcc = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a"]
    return CUDAExtension("flashop._C_sm90", sources, include_dirs=[os.path.join(ROOT, "csrc")],
                         extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc},
                         extra_link_args=PRIVATE_STATIC_LIBS)


# Where the compiler links libstdc++ statically into extensions (the GPU machine's g++ does), keep that
# copy private: exported, its data symbols (the global locale, facet ids) bind to the process's shared
# libstdc++ while its functions stay local, and formatting a number in an error message crashed.
# A no-op where libstdc++ is linked as a shared library.
PRIVATE_STATIC_LIBS = ["-Wl,--exclude-libs,ALL"]


def cuda_archs():
    return [a for a in os.environ.get("FLASHOP_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a]


def extension():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = ["csrc/flashop.cpp", "csrc/checks.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # -Wno-maybe-uninitialized: false positives from ATen's vectorised transposes under -Wall.
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-Wno-maybe-uninitialized"] + cpu_isa_flags()
    if not want_cuda():
        return CppExtension("flashop._C", sources, extra_compile_args={"cxx": cxx},
                            extra_link_args=["-fopenmp"] + PRIVATE_STATIC_LIBS)

    sources += ["csrc/cuda/glue.cpp", "csrc/cuda/forward_cuda.cpp", "csrc/cuda/backward_cuda.cpp"] + generated_sources("flashop._C")
    archs = cuda_archs()
    nvcc = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    nvcc += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    return CUDAExtension(
        "flashop._C",
        sources,
        define_macros=[("FLASHOP_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"] + PRIVATE_STATIC_LIBS,
    )


def ext_modules():
    return [extension()] + ([hopper_extension()] if want_cuda() and "90" in cuda_archs() else [])


def main():
    from torch.utils.cpp_extension import BuildExtension

    setup(
        name="flashop",
        version="0.1.0",
        description="FlashAttention as a PyTorch operator: CUDA and CPU kernels behind torch.ops.flashop",
        packages=find_packages(include=["flashop", "flashop.*"]),
        ext_modules=ext_modules(),
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        python_requires=">=3.10",
        install_requires=["torch>=2.4", "numpy", "tqdm"],
        extras_require={"test": ["pytest", "expecttest"], "plot": ["matplotlib"]},
    )


if __name__ == "__main__":
    main()
