"""What the kernel generators (gen_kernels.py, gen_bwd_kernels.py) share: loading flashop/configs.py
without the package, include paths relative to the output folder, and writing a set of generated
sources so that unchanged files keep their timestamps (ninja stays incremental) and files of configs
no longer selected disappear."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_SRC = os.path.join(ROOT, "csrc", "cuda")
DEFAULT_OUT = os.path.join(CUDA_SRC, "instantiations")


def load_configs_module():
    """flashop/configs.py by file path: importing the package would need torch and the built extension."""
    name = "_flashop_configs_for_gen"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "flashop", "configs.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


def include_path(out_dir: str, header: str) -> str:
    """#include path of csrc/cuda/<header> relative to a generated file in out_dir."""
    return os.path.relpath(os.path.join(CUDA_SRC, header), os.path.abspath(out_dir)).replace(os.sep, "/")


def write_if_changed(path: str, text: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_sources(out_dir: str, sources: dict, stale_prefix: str, marker: str) -> list:
    """Write {file name: text} under out_dir and return the paths in order; remove files named
    stale_prefix*.cu that this generator wrote earlier (first line == marker) and that are not in sources."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in sources.items():
        path = os.path.join(out_dir, name)
        write_if_changed(path, text)
        paths.append(path)
    for entry in os.listdir(out_dir):
        if entry.startswith(stale_prefix) and entry.endswith(".cu") and entry not in sources:
            stale = os.path.join(out_dir, entry)
            try:
                with open(stale, encoding="utf-8") as f:
                    generated = f.readline().rstrip("\n") == marker
            except OSError:
                generated = False
            if generated:
                os.remove(stale)
    return paths


def check_unique(configs, what: str) -> None:
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate {what} configs: " + ", ".join(sorted({n for n in names if names.count(n) > 1})))


def registry_source(marker: str, what: str, header_include: str, struct: str, getter: str, entries: list) -> str:
    """A registry .cu: `const <struct> kKernels[]` of the given C++ initialisers, plus `<getter>()` and
    `num_<getter>()` in namespace flashop."""
    lines = [marker, f"// The table of built {what} kernels (see csrc/cuda/{header_include.rsplit('/', 1)[-1]}).",
             f'#include "{header_include}"', "", "namespace flashop {", "namespace {", ""]
    if entries:
        lines += [f"const {struct} kKernels[] = {{", *entries, "};",
                  "constexpr int kNumKernels = int(sizeof(kKernels) / sizeof(kKernels[0]));"]
    else:
        lines += [f"const {struct}* const kKernels = nullptr;", "constexpr int kNumKernels = 0;"]
    lines += ["", "}  // namespace", "", f"const {struct}* {getter}() {{ return kKernels; }}",
              f"int num_{getter}() {{ return kNumKernels; }}", "", "}  // namespace flashop", ""]
    return "\n".join(lines)
