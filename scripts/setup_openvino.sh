#!/usr/bin/env bash
# Set up ./.venv-openvino: edgecloud on onnxruntime-openvino (OpenVINO execution provider, CPU,
# GPU or NPU) instead of plain onnxruntime. The two cannot share an environment (beside plain
# onnxruntime the OpenVINO build loses its provider), so this is a venv of its own: the project
# installed with --no-deps, then the core dependencies from pyproject.toml and its `edge-openvino`
# extra (never the `edge` extra's onnxruntime). Idempotent: a second run only checks.
# Usage: scripts/setup_openvino.sh [--test]  (--test adds the test tools)
# Each step prints one line; pip's output is shown only if the step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-openvino
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

# shellcheck source=scripts/_step.sh
source "scripts/_step.sh"

"$PYTHON" - <<'PY' || { echo "edgecloud needs Python 3.11 or newer (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV and upgrading pip (a few seconds)" \
        bash -c "\"$PYTHON\" -m venv $VENV && $VENV/bin/python -m pip install --upgrade pip"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

if ! python -c "import torch" 2>/dev/null; then  # the export needs torch; CPU build, as setup.sh
    step "installing CPU torch (about 1-2 minutes)" \
        python -m pip install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi

# The dependency list: the core's and the edge-openvino extra's (never plain onnxruntime), and
# the test tools' with --test (scripts/requirements.py expands the project's own extras).
requirements() {
    if [[ "$WITH_TEST" == 1 ]]; then
        python scripts/requirements.py edge-openvino test
    else
        python scripts/requirements.py edge-openvino
    fi
}

stamp="$VENV/.edgecloud-installed-$(sha256sum pyproject.toml | cut -c1-16)-$WITH_TEST"
if [[ ! -f "$stamp" && ! -f "${stamp%-0}-1" ]] || ! command -v edgecloud >/dev/null 2>&1; then
    reqs="$(mktemp "${TMPDIR:-/tmp}/edgecloud-openvino-reqs.XXXXXX")"
    requirements >"$reqs"
    step "installing edgecloud (--no-deps) (a few seconds)" \
        python -m pip install --no-deps -e .
    step "installing its dependencies with onnxruntime-openvino (about 1-2 minutes)" \
        python -m pip install -r "$reqs"
    rm -f "$reqs" "$VENV"/.edgecloud-installed-*
    touch "$stamp"
fi

step "checking that onnxruntime offers OpenVINOExecutionProvider (a second)" python -c "
import onnxruntime as ort, sys
ok = 'OpenVINOExecutionProvider' in ort.get_available_providers()
sys.exit(0 if ok else 'OpenVINOExecutionProvider missing: is plain onnxruntime installed too?')"

echo "getting the default model (a check if the main setup pulled it)..."
model="$(edgecloud models pull smollm2-135m-instruct)"  # progress on stderr
echo "model: $model"
