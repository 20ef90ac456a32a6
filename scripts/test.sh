#!/usr/bin/env bash
# Quick start 2: set everything up (with test tools and redis-server), lint, and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then
        sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install it from your system packages (Debian/Ubuntu: apt-get install redis-server)" >&2
        exit 1
    fi
fi

scripts/setup.sh --test
source .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest -q "$@"

# The OpenVINO execution provider's tests, in their own venv (onnxruntime-openvino replaces
# onnxruntime there): on a full run only, and only where that venv can be set up (about 2-3
# minutes the first time, then a check; the tests about a minute). EDGECLOUD_SKIP_OPENVINO=1
# leaves them out.
if [[ $# -eq 0 && -z "${EDGECLOUD_SKIP_OPENVINO:-}" ]]; then
    if scripts/setup_openvino.sh --test; then
        .venv-openvino/bin/python -m pytest -q tests/test_openvino.py
    else
        echo "the OpenVINO venv could not be set up: tests/test_openvino.py was not run there" >&2
    fi
fi

# The QNN plugin EP's tests (onnxruntime-qnn, HTP emulated on x86) in their own small venv: on a
# full run only, the CI subset (-m "not slow"), where that venv can be set up (about 30 s the
# first time, then a check of a second or two; the subset a few seconds). EDGECLOUD_SKIP_QNN=1
# leaves them out; docs/npu.md says how to run the whole file.
if [[ $# -eq 0 && -z "${EDGECLOUD_SKIP_QNN:-}" ]]; then
    if scripts/setup_qnn.sh; then
        .venv-qnn/bin/python -m pytest -q -m "not slow" tests/test_qnn.py
    else
        echo "the QNN venv could not be set up: tests/test_qnn.py was not run there" >&2
    fi
fi
