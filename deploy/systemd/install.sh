#!/usr/bin/env bash
# Install an edgecloud edge node as a systemd service on this box (run as root):
#   EDGECLOUD_NODE_TOKEN=... EDGECLOUD_REDIS_PASSWORD=... deploy/systemd/install.sh \
#     --region eu-west --redis-url rediss://redis.internal:6380/0 \
#     --public-url https://edge-1.internal:8001 [--port 8001] [--model NAME] [--openvino] \
#     [--from SPEC]   (SPEC: what pip installs, default: this checkout)
# It creates the system user `edgecloud`, a venv in /opt/edgecloud with the edge extra (or
# edge-openvino) and CPU torch for the one ONNX export, /etc/edgecloud/edge.env (0640,
# root:edgecloud: it holds the secrets, taken from the environment, never from flags; and
# $EDGECLOUD_NODE_TLS, the node's TLS folder, when set: docs/deploy.md), the unit
# edgecloud-edge.service, and starts it. Run again to upgrade: it reinstalls and restarts.
# DESTDIR=DIR --files-only writes only the files, under DIR (for packaging and tests).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

region="" redis_url="" public_url="" port=8001 model=smollm2-135m-instruct
extra=edge spec="$(cd "$here/../.." && pwd)" files_only=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --region) region="$2"; shift 2 ;;
        --redis-url) redis_url="$2"; shift 2 ;;
        --public-url) public_url="$2"; shift 2 ;;
        --port) port="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --openvino) extra=edge-openvino; shift ;;
        --from) spec="$2"; shift 2 ;;
        --files-only) files_only=1; shift ;;
        -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
for need in region redis_url public_url; do
    if [[ -z "${!need}" ]]; then
        echo "install.sh: --${need//_/-} is required (see --help)" >&2
        exit 2
    fi
done
if [[ -z "${EDGECLOUD_NODE_TOKEN:-}" ]]; then
    echo "install.sh: set EDGECLOUD_NODE_TOKEN to the token the gateways send" >&2
    exit 2
fi

root="${DESTDIR:-}"
if [[ "$files_only" == 0 ]]; then
    [[ "$(id -u)" == 0 ]] || { echo "install.sh: run it as root" >&2; exit 1; }
    id edgecloud >/dev/null 2>&1 ||
        useradd --system --user-group --home-dir /var/lib/edgecloud --shell /usr/sbin/nologin edgecloud
    [[ -x /opt/edgecloud/bin/python ]] || python3 -m venv /opt/edgecloud
    /opt/edgecloud/bin/pip install --quiet --upgrade pip
    # torch (CPU build) only exports the model to ONNX once; TORCH_INDEX_URL as in scripts/setup.sh
    /opt/edgecloud/bin/pip install --quiet "torch>=2.5,<2.15" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    /opt/edgecloud/bin/pip install --quiet "${spec}[${extra}]"
fi

install -d -m 0755 "$root/etc/edgecloud" "$root/etc/systemd/system"
env_file="$root/etc/edgecloud/edge.env"
umask 027
cat >"$env_file" <<ENV
EDGECLOUD_MODEL=$model
EDGECLOUD_REGION=$region
EDGECLOUD_HOST=0.0.0.0
EDGECLOUD_PORT=$port
EDGECLOUD_PUBLIC_URL=$public_url
EDGECLOUD_REDIS_URL=$redis_url
EDGECLOUD_NODE_TOKEN=$EDGECLOUD_NODE_TOKEN
EDGECLOUD_REDIS_PASSWORD=${EDGECLOUD_REDIS_PASSWORD:-}
EDGECLOUD_NODE_TLS=${EDGECLOUD_NODE_TLS:-}
ENV
chmod 0640 "$env_file"
install -m 0644 "$here/edgecloud-edge.service" "$root/etc/systemd/system/edgecloud-edge.service"

if [[ "$files_only" == 0 ]]; then
    chgrp edgecloud "$env_file"
    systemctl daemon-reload
    systemctl enable edgecloud-edge.service
    systemctl restart edgecloud-edge.service
    echo "edgecloud-edge is starting: journalctl -u edgecloud-edge -f (the first start exports the model)"
fi
