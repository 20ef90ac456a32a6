"""Running one node process: engine + NodeService + app under uvicorn.

The app is served by :class:`gateway.http_server.DrainingServer` (header and body read
timeouts, a connection cap); SIGTERM or SIGINT drains in-flight requests within the limits'
``drain_timeout_s``, shuts the engine down, and :func:`serve_node` returns (exit code 0).
With a TLS folder (:mod:`gateway.tls_folder`) it serves HTTPS (client certificates required
when the folder has a CA) and its default public URL is ``https://``.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from gateway.front.config import is_loopback_host
from gateway.http_server import ServeResult, serve
from gateway.node.app import create_node_app
from gateway.node.service import NodeConfig, NodeService
from gateway.server_limits import ServerLimits
from gateway.tls_folder import NODE_TLS_ENV, TLSFolder
from routing.engine import Engine
from routing.fleet.store import FleetStore
from routing.model_store import ModelInfo
from routing.power import Watts
from routing.prompt import PromptFormatter

log = logging.getLogger(__name__)


def default_node_id(kind: str, region: str, port: int) -> str:
    return f"{kind}-{region}-{socket.gethostname()}-{port}"


def make_store(redis_url: str | None, node_token: str | None = None) -> FleetStore | None:
    """The fleet store a node registers in (None: no Redis, gateways poll it); with a node
    token its records are signed (``routing.fleet.signing``)."""
    if not redis_url:
        return None
    from routing.fleet.redis_store import RedisFleetStore
    from routing.fleet.signing import RecordSigner

    signer = RecordSigner(node_token) if node_token else None
    return RedisFleetStore(redis_url, signer=signer)


def build_service(
    engine: Engine,
    model: ModelInfo,
    *,
    region: str,
    host: str,
    port: int,
    node_id: str | None = None,
    public_url: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    watts: Watts | None = None,
    tls: bool = False,
) -> NodeService:
    advertised = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    scheme = "https" if tls else "http"
    config = NodeConfig(
        node_id=node_id or default_node_id(engine.kind, region, port),
        region=region,
        public_url=public_url or f"{scheme}://{advertised}:{port}",
        model_name=model.name,
        model_path=Path(model.path),
        model_identity=model.identity,
        max_body_bytes=max_body_bytes,
        watts=watts,
    )
    return NodeService(engine, PromptFormatter.from_folder(model.path), config)


def serve_node(
    engine: Engine,
    model: ModelInfo,
    *,
    region: str,
    host: str = "127.0.0.1",
    port: int = 8001,
    node_id: str | None = None,
    public_url: str | None = None,
    redis_url: str | None = None,
    log_level: str = "warning",
    limits: ServerLimits | None = None,
    node_token: str | None = None,
    watts: Watts | None = None,
    tls: TLSFolder | None = None,
) -> ServeResult:
    service = build_service(
        engine,
        model,
        region=region,
        host=host,
        port=port,
        node_id=node_id,
        public_url=public_url,
        watts=watts,
        tls=tls is not None,
    )
    app = create_node_app(
        service, make_store(redis_url, node_token), node_token=node_token, tune_gc=True
    )
    log.info(
        "node %s (%s) serving %s on %s",
        service.config.node_id,
        engine.kind,
        model.name,
        service.config.public_url,
    )
    if tls is not None:
        log.info("serving HTTPS%s", " (client certificates required)" if tls.mutual else "")
    elif node_token and not is_loopback_host(host):
        log.warning(
            "serving plain HTTP on %s: gateways refuse to send the node token to it in clear "
            "(set $%s to a TLS folder, or insecure_plain_nodes on a network you trust)",
            host,
            NODE_TLS_ENV,
        )
    result = serve(
        app,
        host=host,
        port=port,
        limits=limits or ServerLimits(),
        log_level=log_level,
        tls=tls,
    )
    log.info(result.describe(f"node {service.config.node_id}"))
    return result
