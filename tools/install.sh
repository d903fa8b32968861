#!/usr/bin/env bash
# Installs flashop into the current Python environment, building flashop._C from source, by the standard
# path: pip install --no-build-isolation --no-deps -e . (editable: the tests and the GPU scripts import
# from the tree). Keeps an installed torch (e.g. a CUDA build); with none, installs the CPU build
# torch==2.13.0. Build and test dependencies are installed only when missing, so an offline machine that
# already has them (the GPU machine) needs no registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
missing() {  # the names among "$@" that do not import
  "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"
}
# Needed to build (pyproject.toml's build-system: the build runs without isolation, against this torch)
# and to run. setuptools builds editable installs from pyproject.toml from 64 on, and needs the wheel
# package for it before 70.1.
required=$("$PY" - <<'EOF'
import importlib.metadata
import importlib.util

need = [m for m in ("ninja", "pybind11", "numpy", "tqdm") if importlib.util.find_spec(m) is None]
try:
    setuptools = tuple(int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
    setuptools = (0, 0)
if setuptools < (64, 0):
    need.append("setuptools>=64")
if setuptools < (70, 1) and importlib.util.find_spec("wheel") is None:
    need.append("wheel")
print(" ".join(need))
EOF
)
if [ -n "$required" ]; then
  "$PY" -m pip install $required
fi
# Needed by the tests (expecttest, transformers for the integration's tests) and the benchmark plots; an
# offline machine without them still builds and runs (the tests that need them are skipped there).
optional=$(missing pytest expecttest matplotlib transformers)
if [ -n "$optional" ]; then
  "$PY" -m pip install $optional || echo "install.sh: could not install $optional (offline?); continuing without" >&2
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
