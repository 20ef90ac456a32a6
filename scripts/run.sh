#!/usr/bin/env bash
# Quick start 1: set everything up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
# once, cached: progress on stderr; the graph's folder labelled, not bare, on stdout
graph="$(edgecloud edge export smollm2-135m-instruct --variant int8)"
echo "edge graph: $graph"
exec edgecloud serve "$@"
