#!/usr/bin/env bash
# Quick start 1: set everything up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
exec edgecloud chat "What is the capital of France?" "$@"
