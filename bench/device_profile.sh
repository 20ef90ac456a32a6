#!/usr/bin/env bash
# Profile a cloud node on the GPU machine: random bf16 weights of the default model's shape
# (bench/random_default_shape.py; the tokenizer files copied into .devmodel/ beforehand), served by
# `edgecloud cloud serve --device cuda`, measured by `edgecloud profile`.
#
#   bench/device_profile.sh OUT.json [profile args...]
#
# Python packages the machine lacks travel as wheels in .whl/ (see the device notes).
set -euo pipefail
out=$1; shift
source "$(dirname "$0")/_device_site.sh"
python3 bench/random_default_shape.py "$work/smollm2-random" .devmodel
python3 -m gateway.cli cloud serve --model "$work/smollm2-random" \
    --device cuda --port 8002 ${NODE_ARGS:-} > "$work/node.log" 2>&1 &
node=$!
trap 'kill $node 2>/dev/null || true' EXIT
for _ in $(seq 240); do
    curl -sf http://127.0.0.1:8002/load >/dev/null && break
    kill -0 $node 2>/dev/null || { cat "$work/node.log"; exit 1; }
    sleep 0.5
done
python3 -m gateway.cli profile --node http://127.0.0.1:8002 --out "$out" "$@"
tail -5 "$work/node.log"
