"""The CUDA sources without a GPU: the kernel-config names and lists, the generator's output (all
families), the index math of the sm80 kernels (tools/check_sm80_layouts.py), and nvcc compiling a
representative subset (sm_80, and sm_90a for the Hopper files) so a syntax or template error fails CI.
Skipped only where nvcc is absent."""
import glob
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.utils.cpp_extension as cpp_extension

from flashop import configs
from flashop.configs import (BACKWARD_CONFIGS, FORWARD_CONFIGS, HOPPER_BACKWARD_CONFIGS, HOPPER_FORWARD_CONFIGS,
                             parse_name, selected)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_LISTS = (FORWARD_CONFIGS, BACKWARD_CONFIGS, HOPPER_FORWARD_CONFIGS, HOPPER_BACKWARD_CONFIGS)


def find_cuda_home():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return home
    return None


CUDA_HOME = find_cuda_home()
NVCC = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
CUDA_INCLUDE = os.path.join(CUDA_HOME, "include") if CUDA_HOME else None


def compile_emulator(tmp_path_factory, name):
    """tests/<name>/test_<name>.cpp, a CPU-emulator harness of CUDA kernels (csrc/cuda/sm80/bwd_emulate.cuh),
    compiled with g++; returns the binary's path."""
    source = os.path.join(ROOT, "tests", name, f"test_{name.replace('_emulator', '_emu')}.cpp")
    binary = str(tmp_path_factory.mktemp("emu") / os.path.basename(source)[:-4])
    cmd = ["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", f"-I{os.path.join(ROOT, 'csrc', 'cuda')}",
           f"-I{CUDA_INCLUDE}", source, "-o", binary]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    return binary


def load_codegen():
    spec = importlib.util.spec_from_file_location("_flashop_tool_codegen", os.path.join(ROOT, "tools", "codegen.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_config_names_round_trip():
    names = [c.name for configs_list in ALL_LISTS for c in configs_list]
    for configs_list in ALL_LISTS:
        for config in configs_list:
            assert parse_name(config.name) == config
    assert len(set(names)) == len(names)


def test_selection_patterns():
    everything = selected({})
    assert [everything[f] for f in ("fwd", "bwd", "sm90_fwd", "sm90_bwd")] == [list(lst) for lst in ALL_LISTS]
    # FLASHOP_KERNELS selects forward configs of both families, FLASHOP_BWD_KERNELS backward ones.
    chosen = selected({"FLASHOP_KERNELS": "bf16.d128.*,sm90.*.d64.*.tmao", "FLASHOP_BWD_KERNELS": "sm90.bwd.*"})
    assert chosen["fwd"] and all(c.dtype == "bf16" and c.headdim == 128 for c in chosen["fwd"])
    assert chosen["sm90_fwd"] and all(c.headdim == 64 and c.name.endswith(".tmao") for c in chosen["sm90_fwd"])
    assert chosen["bwd"] == [] and chosen["sm90_bwd"] == list(HOPPER_BACKWARD_CONFIGS)
    # A valid name that is in no list is built when named (and only then).
    chosen = selected({"FLASHOP_KERNELS": "fp16.d64.br64.bc64.w4,sm90.bf16.d128.br128.bc128.nopp"})
    assert [c.name for c in chosen["fwd"]] == ["fp16.d64.br64.bc64.w4"]
    assert [c.name for c in chosen["sm90_fwd"]] == ["sm90.bf16.d128.br128.bc128.nopp"]
    assert chosen["bwd"] == list(BACKWARD_CONFIGS)
    with pytest.raises(ValueError, match="FLASHOP_KERNELS: pattern.* match no kernel config"):
        selected({"FLASHOP_KERNELS": "bf16.d999.*"})
    with pytest.raises(ValueError, match="FLASHOP_BWD_KERNELS: bf16.d128.br64.bc64.w4 is not a backward kernel"):
        selected({"FLASHOP_BWD_KERNELS": "bf16.d128.br64.bc64.w4"})
    assert configs.select("bwd.bf16.d64.*", BACKWARD_CONFIGS) == [c for c in BACKWARD_CONFIGS
                                                                   if c.name.startswith("bwd.bf16.d64.")]


def test_hopper_backward_role_split_names(tmp_path):
    """The ".rs" Hopper backward builds (Sm90BwdRoleSplit): wide widths at B_c = 64 only, before ".lpt" in the name,
    listed ahead of the plain build at d256 only (elsewhere built when named), without the attention variants or
    packed batches; their instantiation wraps the wide traits (inside Sm90BwdLpt for ".rs.lpt") and pins the shared
    memory the wide build has."""
    config = parse_name("sm90.bwd.bf16.d256.br64.bc64.rs")
    assert config.role_split and config.wide and not config.supports_variants and not config.supports_packed
    assert config.smem_bytes() == parse_name("sm90.bwd.bf16.d256.br64.bc64").smem_bytes()
    assert parse_name("sm90.bwd.fp16.d192.br64.bc64.rs.lpt").longest_first
    for bad in ("sm90.bwd.bf16.d128.br64.bc128.rs", "sm90.bwd.bf16.d192.br64.bc96.rs", "sm90.bwd.bf16.d256.br64.bc64.lpt.rs"):
        with pytest.raises(ValueError):
            parse_name(bad)
    listed = [c.name for c in HOPPER_BACKWARD_CONFIGS]
    assert [n for n in listed if parse_name(n).role_split] == ["sm90.bwd.bf16.d256.br64.bc64.rs",
                                                                "sm90.bwd.fp16.d256.br64.bc64.rs"]
    for dtype in ("bf16", "fp16"):
        assert listed.index(f"sm90.bwd.{dtype}.d256.br64.bc64.rs") < listed.index(f"sm90.bwd.{dtype}.d256.br64.bc64")
    chosen = selected({"FLASHOP_BWD_KERNELS": "sm90.bwd.bf16.d256.br64.bc64.rs.lpt"})["sm90_bwd"]
    assert [c.name for c in chosen] == ["sm90.bwd.bf16.d256.br64.bc64.rs.lpt"]
    gen = load_codegen()
    gen.generate(str(tmp_path), ["sm90_bwd"], {"sm90_bwd": chosen})
    source = (tmp_path / gen.file_name(chosen[0])).read_text()
    assert ("Sm90BwdLpt<::flashop::sm90::Sm90BwdRoleSplit<::flashop::sm90::Sm90BwdWideTraits<true, 256>>>" in source
            and f"== {chosen[0].smem_bytes()}" in source)


def test_generator_output(tmp_path):
    gen = load_codegen()
    selection = selected({"FLASHOP_KERNELS": "bf16.d128.*,fp16.d64.br128.bc64.w4,sm90.bf16.d128.*",
                          "FLASHOP_BWD_KERNELS": "bwd.bf16.d128.*,sm90.bwd.fp16.*"})
    paths = gen.generate(str(tmp_path), selection=selection)
    registries = {"fwd": "registry_fwd.cu", "bwd": "registry_bwd.cu", "sm90_fwd": "registry_sm90_fwd.cu",
                  "sm90_bwd": "registry_sm90_bwd.cu"}
    assert sorted(os.path.basename(p) for p in paths) == sorted(
        [gen.file_name(c) for family in selection.values() for c in family] + list(registries.values()))
    instantiated = {"fwd": "sm80::launch_fwd<", "bwd": "sm80::launch_bwd<", "sm90_fwd": "sm90::launch_fwd<",
                    "sm90_bwd": "sm90::launch_bwd<"}
    for family, configs_list in selection.items():
        assert configs_list
        registry = (tmp_path / registries[family]).read_text()
        # In list order, each once.
        assert [registry.index(f'"{c.name}"') for c in configs_list] == sorted(
            registry.index(f'"{c.name}"') for c in configs_list)
        for config in configs_list:
            assert instantiated[family] in (tmp_path / gen.file_name(config)).read_text()
    # Unchanged files are not rewritten (ninja stays incremental); dropped configs are removed.
    mtimes = {p: os.stat(p).st_mtime_ns for p in paths}
    assert gen.generate(str(tmp_path), selection=selection) == paths
    assert all(os.stat(p).st_mtime_ns == t for p, t in mtimes.items())
    fewer = {family: configs_list[:1] for family, configs_list in selection.items()}
    gen.generate(str(tmp_path), selection=fewer)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [gen.file_name(c[0]) for c in fewer.values()] + list(registries.values()))
    # An empty selection still gives a registry (an empty table).
    gen.generate(str(tmp_path), ["sm90_fwd"], {"sm90_fwd": []})
    assert "kNumKernels = 0" in (tmp_path / "registry_sm90_fwd.cu").read_text()
    assert not any(f.startswith("sm90_fwd_") for f in os.listdir(tmp_path))


def test_every_listed_config_generates(tmp_path):
    """Every config of every list gets its file (the Hopper ones with the template arguments of its name)."""
    gen = load_codegen()
    paths = gen.generate(str(tmp_path), selection=selected({}))
    assert len(paths) == sum(map(len, ALL_LISTS)) + 4
    text = (tmp_path / gen.file_name(parse_name("sm90.fp16.d64.br64.bc64.cta3.tmao"))).read_text()
    assert "Sm90FwdTraits<false, 64, 64, 64, true, true, false, false, 2, false, 3, false>" in text
    text = (tmp_path / gen.file_name(parse_name("sm90.bf16.d128.br128.bc192.pers.rego"))).read_text()
    assert "Sm90FwdTraits<true, 128, 128, 192, true, false, true, false, 2, false, 0, false>" in text


def test_sm80_index_math():
    """Swizzle, cp.async/ldmatrix addressing, mma fragment algebra and causal tile ranges, on the CPU."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_sm80_layouts.py")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def nvcc_compile(source, out_dir, arch="80"):
    """nvcc -c with setup.py's flags."""
    cmd = [NVCC, "-c", source, "-o", os.path.join(out_dir, os.path.basename(source) + ".o"), "-O3", "-std=c++17",
           "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-I{os.path.join(ROOT, 'csrc')}"]
    return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_nvcc_compiles_representative_kernels(tmp_path):
    """Generated files with setup.py's nvcc flags: forward and backward mma.sync kernels for sm_80 (each
    forward file holds the full-width kernel and the one for narrower head dimensions; d160 is a width
    of 32-column blocks that is not a power of two), a Hopper forward and backward kernel and the
    Hopper registries for sm_90a."""
    gen = load_codegen()
    names = {"fwd": ["bf16.d128.br128.bc64.w4.kv2", "fp16.d64.br128.bc64.w4", "bf16.d160.br64.bc64.w4"],
             "bwd": ["bwd.bf16.d128.br64.bc128.w8.k32"],
             "sm90_fwd": ["sm90.bf16.d128.br128.bc192.tmao"], "sm90_bwd": ["sm90.bwd.bf16.d128.br64.bc128"]}
    selection = {family: [parse_name(n) for n in ns] for family, ns in names.items()}
    jobs = []
    for family in names:
        arch = "90a" if family.startswith("sm90") else "80"
        jobs += [(path, arch) for path in gen.generate(str(tmp_path / "gen"), [family], selection)]
    jobs.append((os.path.join(ROOT, "csrc", "cuda", "decode", "decode.cu"), "80"))  # the split-KV decode kernels
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
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp")))
    for source in sources + [os.path.join(ROOT, "csrc", "cuda", "sm90", "bindings_sm90.cpp")]:
        cmd = ["g++", "-fsyntax-only", "-std=c++17", "-DFLASHOP_WITH_CUDA", source]
        cmd += [f"-I{p}" for p in includes]
        cmd += [f"-I{__import__('sysconfig').get_paths()['include']}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, " ".join(cmd) + "\n" + result.stderr[-5000:]
