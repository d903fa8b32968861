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
missing=$("$PY" - <<'PYEOF'
import importlib.util
needed = {"ninja": "ninja", "pybind11": "pybind11", "numpy": "numpy", "tqdm": "tqdm", "pytest": "pytest",
          "expecttest": "expecttest", "setuptools": "setuptools", "matplotlib": "matplotlib"}
print(" ".join(pkg for mod, pkg in needed.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  "$PY" -m pip install $missing
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install --no-build-isolation --no-deps -e .
