#!/usr/bin/env bash
# Set up ./.venv-qnn for tests/test_qnn.py: the QNN execution provider as an ONNX Runtime plugin
# EP (the `edge-qnn` extra, onnxruntime-qnn; on x86 its HTP backend is emulated on the host CPU).
# The plugin installs beside plain onnxruntime, but it must stay out of the main .venv (there the
# provider chain would take emulated QNN for static-shape graphs), so it gets a venv of its own,
# and a small one: the project with --no-deps, then only what the QNN tests import (numpy, onnx,
# onnxruntime at pyproject's ranges), the extra, and pytest with the two plugins pyproject's
# [tool.pytest.ini_options] configures (pytest-timeout: the per-test limit; pytest-asyncio: else
# pytest warns of its unknown options). No torch, no server: the rest of the project does not
# import there (the `edgecloud` command is installed but cannot run).
# Idempotent: a second run only checks. Usage: scripts/setup_qnn.sh
# Each step prints one line; pip's output is shown only if the step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-qnn

# shellcheck source=scripts/_step.sh
source "scripts/_step.sh"

"$PYTHON" - <<'PY' || { echo "edgecloud needs Python 3.11 or newer (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

# The dependency list, ranges as in pyproject.toml: the tests' imports, the extra, the test tools.
requirements() {
    "$PYTHON" scripts/requirements.py \
        --only numpy,onnx,onnxruntime,onnxruntime-qnn,pytest,pytest-asyncio,pytest-timeout \
        edge edge-qnn test
}
reqs="$(requirements)"

# No pip upgrade: the venv's bundled pip installs these wheels, and it saves CI the time.
if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV (a few seconds)" "$PYTHON" -m venv "$VENV"
fi

# Installed again only when the list above changed (the stamp is its hash).
stamp="$VENV/.edgecloud-installed-$(sha256sum <<<"$reqs" | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    step "installing edgecloud (--no-deps) (a few seconds)" \
        "$VENV/bin/python" -m pip install --no-deps -e .
    # shellcheck disable=SC2086  # one requirement per line, none with spaces
    step "installing onnxruntime-qnn, onnxruntime, onnx, numpy, pytest (about 20-30 s, a 160 MB download)" \
        "$VENV/bin/python" -m pip install $reqs
    rm -f "$VENV"/.edgecloud-installed-*
    touch "$stamp"
fi

step "checking that the QNN plugin registers and offers a device (a second)" \
    "$VENV/bin/python" -c "
from edge_runtime import qnn
plugin = qnn.register()
print(plugin.version, plugin.library, [d.device.type for d in qnn.ep_devices()])"
