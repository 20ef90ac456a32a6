#!/usr/bin/env bash
# Set up edgecloud in ./.venv: Python 3.11+ virtualenv, CPU torch, the project with every role's
# extras (`all`: gateway, edge, cloud, simulator), the default model.
# Idempotent: a second run only checks. Usage: scripts/setup.sh [--test]  (--test adds test tools)
# Each step prints one line (what it installs, about how long it takes); pip's output is kept in
# a log and shown only if the step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
EXTRAS="all"
[[ "${1:-}" == "--test" ]] && EXTRAS="all,test"

# shellcheck source=scripts/_step.sh
source "scripts/_step.sh"

"$PYTHON" - <<'PY' || { echo "edgecloud needs Python 3.11 or newer (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [[ ! -x .venv/bin/python ]]; then
    step "creating .venv and upgrading pip (a few seconds)" \
        bash -c "\"$PYTHON\" -m venv .venv && .venv/bin/python -m pip install --upgrade pip"
fi
# shellcheck disable=SC1091
source .venv/bin/activate

# Torch: the CPU build unless this machine has an NVIDIA GPU. Where the CPU wheel is not cached
# locally, point TORCH_INDEX_URL at PyTorch's CPU wheel index so pip never pulls a CUDA build.
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        step "installing CUDA torch (about 2-5 minutes, a 2+ GB download)" \
            python -m pip install "torch>=2.5,<2.15"
    else
        step "installing CPU torch (about 1-2 minutes)" \
            python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
fi

# The project and its dependencies, again only when pyproject.toml changed since the last install
# (a stamp per set of extras; the test extras include the plain install).
stamp() { echo ".venv/.edgecloud-installed-$(sha256sum pyproject.toml | cut -c1-16)-$1"; }
if [[ ! -f "$(stamp "$EXTRAS")" ]] || ! command -v edgecloud >/dev/null 2>&1; then
    tools=""
    [[ "$EXTRAS" == *test* ]] && tools=" with test tools"
    step "installing edgecloud and its dependencies${tools} (about 1 minute)" \
        python -m pip install -e ".[${EXTRAS}]"
    rm -f .venv/.edgecloud-installed-*
    touch "$(stamp "$EXTRAS")"
    if [[ "$EXTRAS" != all ]]; then touch "$(stamp all)"; fi
fi

echo "getting the default model (about a minute the first time; then a check)..."
model="$(edgecloud models pull smollm2-135m-instruct)"  # progress on stderr
echo "model: $model"
