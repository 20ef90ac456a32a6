#!/usr/bin/env bash
# Set up the OpenVINO GenAI peer of the edge decode benchmark (bench/edge_peer_openvino.py):
# ./.venv-ovgenai with openvino-genai (which brings openvino and openvino-tokenizers) and what
# converting a Hugging Face folder needs (optimum-intel with the openvino extra, nncf,
# transformers, CPU torch), then the default model as OpenVINO IR with int4 weights plus the
# OpenVINO tokenizer/detokenizer, under <edgecloud home>/peers/openvino-genai/<identity>/int4
# (the home and the identity are the project's own: routing.model_store, run in ./.venv).
# Needs scripts/setup.sh first (./.venv and the default model). Idempotent: a second run finds
# the packages and the complete folder and does nothing. Usage: scripts/setup_openvino_genai.sh
# Each step prints one line (what it does, about how long it takes); pip's and the converter's
# output is kept in a log and shown only if the step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-ovgenai
MODEL=smollm2-135m-instruct

# shellcheck source=scripts/_step.sh
source "scripts/_step.sh"

if [[ ! -x .venv/bin/edgecloud ]]; then
    echo "run scripts/setup.sh first: the model store and its identities come from ./.venv" >&2
    exit 1
fi

# Where the model is, its identity and the edgecloud home ($EDGECLOUD_HOME honoured), from the
# project itself; `models pull` is a check when setup.sh already pulled the model.
.venv/bin/edgecloud models pull "$MODEL" >/dev/null
where="$(.venv/bin/python - "$MODEL" <<'PY'
import sys
from routing.model_store import home_dir, resolve
info = resolve(sys.argv[1])
print(info.path, info.identity, home_dir(), sep="\n")
PY
)"
{ read -r MODEL_DIR; read -r IDENTITY; read -r HOME_DIR; } <<<"$where"
OUT="$HOME_DIR/peers/openvino-genai/$IDENTITY/int4"
MARKER=edgecloud-peer.json  # written last, after the converted files: the folder is complete

# --- the virtualenv ------------------------------------------------------------------------------
"$PYTHON" - <<'PY' || { echo "needs Python 3.11 or newer (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV and upgrading pip (a few seconds)" \
        bash -c "\"$PYTHON\" -m venv $VENV && $VENV/bin/python -m pip install --upgrade pip"
fi

# Pinned ranges. torch stays the CPU build: pinned exactly in a constraints file that every pip
# call here gets, so nothing later can swap in a CUDA torch. Where the CPU wheel is not cached
# locally, point TORCH_INDEX_URL at PyTorch's CPU wheel index.
# optimum-intel declares torchvision, which text models never use and which PyPI serves only as
# a CUDA build: beside CPU torch it fails to import ("operator torchvision::nms does not exist")
# and takes transformers down with it. So optimum-intel goes in with --no-deps and its other
# requirements are listed here (from its metadata); torchvision only where TORCH_INDEX_URL gives
# the CPU build.
REQS=(
    "openvino-genai>=2026.4,<2026.5"  # brings openvino and openvino-tokenizers of its release
    "openvino>=2026.4,<2026.5"
    "openvino-tokenizers>=2026.4,<2026.5"
    "nncf>=3.3,<3.5"
    "transformers>=4.51,<5.6"  # optimum-intel 2.2's range
    "optimum>=2.3,<2.4"        # optimum-intel 2.2: ~=2.3.0
    "huggingface-hub>=0.23.2,<1.22"
    "requests>=2.33,<3"
    "setuptools"
)
OPTIMUM_INTEL="optimum-intel>=2.2,<2.3"
CONSTRAINTS="$VENV/edgecloud-constraints.txt"
stamp="$VENV/.edgecloud-installed-$(printf '%s\n' "${REQS[@]}" "$OPTIMUM_INTEL" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
    echo "torch==2.13.0" >"$CONSTRAINTS"
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        step "installing CPU torch (about 20 s from the local wheel; 1-2 minutes downloaded)" \
            "$VENV/bin/python" -m pip install -c "$CONSTRAINTS" "torch==2.13.0" \
            ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    step "installing openvino-genai, nncf, transformers, optimum (about 30 s)" \
        "$VENV/bin/python" -m pip install -c "$CONSTRAINTS" "${REQS[@]}"
    step "installing optimum-intel without torchvision (a few seconds)" \
        "$VENV/bin/python" -m pip install -c "$CONSTRAINTS" --no-deps "$OPTIMUM_INTEL"
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        step "installing CPU torchvision for torch 2.13 (under a minute)" \
            "$VENV/bin/python" -m pip install -c "$CONSTRAINTS" "torchvision==0.28.*" \
            --index-url "$TORCH_INDEX_URL"
    fi
    step "checking the install (a few seconds)" "$VENV/bin/python" -c "
import openvino, openvino_genai, openvino_tokenizers, nncf, torch
from optimum.exporters.openvino import main_export
assert not torch.version.cuda, 'a CUDA torch got in: ' + torch.__version__"
    rm -f "$VENV"/.edgecloud-installed-*
    touch "$stamp"
fi

# --- the int4 model ------------------------------------------------------------------------------
complete() {
    [[ -f "$OUT/$MARKER" && -f "$OUT/openvino_model.xml" && -f "$OUT/openvino_model.bin" \
        && -f "$OUT/openvino_tokenizer.xml" && -f "$OUT/openvino_detokenizer.xml" ]]
}
if complete; then
    echo "OpenVINO GenAI int4 model: $OUT (already there)"
    exit 0
fi

# Weight compression as OpenVINO recommends for speed on CPU: INT4_SYM (symmetric, no zero
# point: faster kernels than INT4_ASYM), groups of 128 along the input channel, ratio 1.0 (every
# linear layer 4-bit, none left at the int8 backup precision). 128 must divide every input
# width or NNCF keeps that layer at int8: SmolLM2-135M's hidden size is 576 = 4.5 x 128, so the
# largest of 128/64/32 that divides hidden and intermediate sizes is taken (64 here).
# --all-layers also makes the embedding and the (tied) lm_head int4, which NNCF keeps at int8 by
# default: our int4 variant quantizes those too (edge_runtime/quantize.py), so both engines read
# 4-bit weights for every matrix. Data-free (round to nearest, no AWQ/dataset), like ours.
GROUP="$("$VENV/bin/python" - "$MODEL_DIR/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
widths = [c["hidden_size"], c["intermediate_size"]]
print(next(g for g in (128, 64, 32, 16) if all(w % g == 0 for w in widths)))
PY
)"
TMP="$OUT.tmp"
rm -rf "$TMP"
mkdir -p "$(dirname "$OUT")"
step "converting $MODEL to OpenVINO IR, int4 sym group $GROUP, and its tokenizer (about 1-2 minutes)" \
    env HF_HUB_OFFLINE=1 "$VENV/bin/optimum-cli" export openvino \
    --model "$MODEL_DIR" --task text-generation-with-past \
    --weight-format int4 --sym --group-size "$GROUP" --ratio 1.0 --all-layers "$TMP"
for f in openvino_model.xml openvino_model.bin openvino_tokenizer.xml openvino_detokenizer.xml; do
    [[ -f "$TMP/$f" ]] || { echo "conversion left no $f in $TMP" >&2; exit 1; }
done
"$VENV/bin/python" - "$TMP/$MARKER" "$MODEL" "$IDENTITY" "$GROUP" <<'PY'
import json, sys
from importlib.metadata import version
path, name, identity, group = sys.argv[1:]
pkgs = ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "nncf", "torch",
        "transformers")
json.dump({"model": name, "identity": identity, "weights": "int4_sym", "group_size": int(group),
           "ratio": 1.0, "all_layers": True, "versions": {p: version(p) for p in pkgs}},
          open(path, "w"), indent=2)
PY
rm -rf "$OUT"
mv "$TMP" "$OUT"
echo "OpenVINO GenAI int4 model: $OUT"
