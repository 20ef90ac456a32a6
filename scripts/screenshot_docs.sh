#!/usr/bin/env bash
# Screenshot the gateway's /docs (Swagger UI, served from local files) in headless Chromium
# (Debian package `chromium`), saved as docs/gateway-docs.png. Starts a gateway on a free port
# with a throwaway config (one unreachable node: the docs do not need a live one), then stops it.
# Usage: scripts/screenshot_docs.sh [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/gateway-docs.png}"
# shellcheck disable=SC1091
[[ -f .venv/bin/activate ]] && source .venv/bin/activate
BROWSER="$(command -v chromium || command -v chromium-browser || true)"
[[ -n "$BROWSER" ]] || { echo "needs chromium: apt-get install -y chromium" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'kill "$GW" 2>/dev/null || true; wait "$GW" 2>/dev/null || true; rm -rf "$TMP"' EXIT
PORT="$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
echo "nodes: [http://127.0.0.1:9]" > "$TMP/gw.yaml"
edgecloud gateway --config "$TMP/gw.yaml" --port "$PORT" 2> "$TMP/gw.log" &
GW=$!
for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$PORT/openapi.json" >/dev/null 2>&1 && break
    sleep 0.2
done
curl -fs "http://127.0.0.1:$PORT/openapi.json" >/dev/null || { cat "$TMP/gw.log" >&2; exit 1; }
"$BROWSER" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
    --user-data-dir="$TMP/profile" --virtual-time-budget=15000 \
    --window-size=1280,1600 --screenshot="$OUT" "http://127.0.0.1:$PORT/docs" 2> "$TMP/chromium.log"
[[ -s "$OUT" ]] || { tail -20 "$TMP/chromium.log" >&2; exit 1; }
echo "wrote $OUT"
