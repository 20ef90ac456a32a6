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
exec python -m pytest -q "$@"
