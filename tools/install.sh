#!/usr/bin/env bash
# Installs flashop into the current Python environment, building flashop._C from source.
# Keeps an installed torch (e.g. a CUDA build); with none, installs the CPU build torch==2.13.0.
# Build and test dependencies are installed only when missing, so an offline machine that already
# has them (the GPU machine) needs no registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
missing() {  # the names among "$@" that do not import
  "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"
}
# Needed to build and run.
required=$(missing setuptools ninja pybind11 numpy tqdm)
if [ -n "$required" ]; then
  "$PY" -m pip install $required
fi
# Needed by the tests (expecttest) and the benchmark plots; an offline machine without them still
# builds and runs (the tests that need expecttest are skipped there).
optional=$(missing pytest expecttest matplotlib)
if [ -n "$optional" ]; then
  "$PY" -m pip install $optional || echo "install.sh: could not install $optional (offline?); continuing without" >&2
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
