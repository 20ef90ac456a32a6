#!/usr/bin/env bash
# Set up edgecloud in ./.venv: Python 3.11+ virtualenv, CPU torch, the project, the default model.
# Idempotent: a second run only checks. Usage: scripts/setup.sh [--test]  (--test adds test tools)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
EXTRAS=""
[[ "${1:-}" == "--test" ]] && EXTRAS="[test]"

"$PYTHON" - <<'PY' || { echo "edgecloud needs Python 3.11 or newer (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
python -m pip install --quiet --upgrade pip

# Torch: the CPU build unless this machine has an NVIDIA GPU. Where the CPU wheel is not cached
# locally, point TORCH_INDEX_URL at PyTorch's CPU wheel index so pip never pulls a CUDA build.
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install --quiet "torch>=2.5,<2.15"
    else
        python -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
fi

python -m pip install --quiet -e ".${EXTRAS}"
edgecloud models pull smollm2-135m-instruct
