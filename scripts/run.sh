#!/usr/bin/env bash
# Quick start 1: set everything up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
# once, cached: the export and the quality gate's pick for this CPU (progress on stderr); the
# graph the edge will serve, labelled, on stdout
graph="$(edgecloud edge export smollm2-135m-instruct --variant auto)"
echo "edge graph: $graph"
exec edgecloud serve "$@"
