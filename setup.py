"""Builds flashop._C: the operator schemas, the CPU kernels always, the CUDA
kernels when the installed torch has CUDA. The package's metadata is in pyproject.toml.

The CPU kernels are compiled once per instruction set (CPU_ISA_FLAGS: generic, and on x86-64 AVX2 and
AVX-512), whatever the build machine; the module runs the best copy the CPU supports (FLASHOP_CPU_ISA at
run time forces one, see csrc/cpu/isa.h).

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
import platform
import sys

from setuptools import setup

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


# The copies of the CPU kernels, one per instruction set (csrc/cpu/isa/kernels_<name>.cpp), and their
# flags (at::vec picks its implementation from CPU_CAPABILITY_*); csrc/cpu/isa.cpp runs the best one the
# CPU supports. Generic first: where several objects define the same inline function (c10's, the standard
# library's), the linker keeps the first, so no caller ever gets a copy built for a newer ISA than its own.
CPU_ISA_FLAGS = {
    "default": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512",
               "-DCPU_CAPABILITY=AVX512"],
}


def cpu_isa_sources():
    """(name, sources, flags) of each copy of the CPU kernels to build: every one on x86-64, the generic
    one elsewhere (csrc/cpu/isa.h makes the same choice from __x86_64__)."""
    x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    return [(name, [f"csrc/cpu/isa/kernels_{name}.cpp"], flags) for name, flags in CPU_ISA_FLAGS.items()
            if x86_64 or name == "default"]


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

    sources = ["csrc/flashop.cpp", "csrc/autograd.cpp", "csrc/checks.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # -Wno-maybe-uninitialized: false positives from ATen's vectorised transposes under -Wall.
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-Wno-maybe-uninitialized"]
    if not want_cuda():
        return CppExtension("flashop._C", sources, extra_compile_args={"cxx": cxx},
                            extra_link_args=["-fopenmp"] + PRIVATE_STATIC_LIBS)

    sources += ["csrc/cuda/glue.cpp", "csrc/cuda/forward_cuda.cpp", "csrc/cuda/backward_cuda.cpp",
                "csrc/cuda/decode_cuda.cpp", "csrc/cuda/ops_cuda.cpp", "csrc/cuda/decode/decode.cu"] + generated_sources("flashop._C")
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


def with_cpu_isas(ext):
    """The extension with the copies of the CPU kernels, which build_ext_command() compiles and links."""
    ext.cpu_isa_sources = cpu_isa_sources()
    return ext


def ext_modules():
    return [with_cpu_isas(extension())] + ([hopper_extension()] if want_cuda() and "90" in cuda_archs() else [])


def build_ext_command():
    """torch's BuildExtension, which compiles every source of an extension with the same flags, plus the
    sources of its `cpu_isa_sources`: each compiled with the extension's C++ flags and its own (in a build
    directory of its own) and linked after the extension's objects, in the order given."""
    from torch.utils.cpp_extension import BuildExtension

    class BuildExtensionWithIsas(BuildExtension):
        def build_extension(self, ext):
            objects = []
            for name, sources, flags in getattr(ext, "cpu_isa_sources", []):
                args = ext.extra_compile_args  # by now with the flags BuildExtension adds
                cxx = args["cxx"] if isinstance(args, dict) else args
                objects += self.compiler.compile(sources, output_dir=os.path.join(self.build_temp, f"isa_{name}"),
                                                 macros=ext.define_macros, include_dirs=ext.include_dirs,
                                                 extra_postargs={"cxx": cxx + flags})
            own = ext.extra_objects
            ext.extra_objects = own + objects
            try:
                super().build_extension(ext)
            finally:
                ext.extra_objects = own

    return BuildExtensionWithIsas.with_options(use_ninja=True)


def main():
    setup(ext_modules=ext_modules(), cmdclass={"build_ext": build_ext_command()})


if __name__ == "__main__":
    main()
