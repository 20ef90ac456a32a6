"""``edgecloud gateway --config FILE``: the front gateway over the nodes a config names (or
the Redis fleet store they register in), in one process or ``--workers`` processes on one port.
``edgecloud serve`` (gateway and nodes on one machine) is :mod:`gateway.commands.serve`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.commands.argtypes import port, positive_int
from gateway.server_limits import add_server_arguments, limits_from_args

if TYPE_CHECKING:
    pass

# After the gateway has drained, how long the nodes get to exit on SIGTERM before SIGKILL
# (a torch process alone takes a second or more to tear down on a busy machine).
CHILD_STOP_TIMEOUT_S = 10.0
# How long the nodes may take to answer /health (a first run exports the ONNX graph).
READY_TIMEOUT_S = 600.0
REGION = "local"  # the region the embedded nodes report


def add_workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="gateway processes serving the port, sharing the fleet view, limits and in-flight "
        "counts (through the config's redis_url, else a private redis-server, which must then "
        "be installed); at most one per core (default 1: one process, no Redis needed)",
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("gateway", help="run the front gateway from a config file")
    g.add_argument(
        "--config",
        type=Path,
        required=False,
        help="gateway YAML naming the nodes or the Redis fleet store (see examples/gateway.yaml, "
        "docs/configuration.md); without it the gateway has no node and refuses to start",
    )
    g.add_argument("--host", default=None, help="address to listen on (default: the config's host)")
    g.add_argument(
        "--port", type=port, default=None, help="port to listen on (default: the config's port)"
    )
    g.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback host with authentication off (anyone may use it)",
    )
    add_workers(g)
    add_server_arguments(g)
    g.set_defaults(func=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from gateway.front.config import GatewayConfig, load_gateway_config

    try:
        cfg = load_gateway_config(args.config) if args.config else GatewayConfig()
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        print(f"edgecloud gateway: error: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    host, port = args.host or cfg.host, args.port if args.port is not None else cfg.port
    from gateway.front.config import UnsafeExposure

    try:
        cfg.insecure_no_auth = cfg.insecure_no_auth or args.insecure_no_auth
        cfg.check_exposure(host)
    except UnsafeExposure as exc:
        print(f"edgecloud gateway: error: {exc}", file=sys.stderr)
        return 2
    from gateway.cli import CLIError, check_port_free

    if args.config is None:
        raise CLIError(
            "no nodes to route to: pass --config FILE, a gateway YAML that lists the nodes "
            "(nodes:, openai_nodes:) or the Redis fleet store they register in (redis_url:); "
            "see examples/gateway.yaml. To run everything on this machine: edgecloud serve",
            code=2,
        )
    if not (cfg.nodes or cfg.openai_nodes or cfg.redis_url):
        print(
            f"edgecloud gateway: warning: {args.config} names no nodes and no redis_url: every "
            "request will be answered 503 (no node configured)",
            file=sys.stderr,
        )
    check_port_free(host, port)
    store = "redis" if cfg.redis_url else "in-process"
    if args.workers > 1:
        shared = "redis_url" if cfg.redis_url else "a private redis-server"
        store += f"; {args.workers} workers sharing state through {shared}"
    print(
        f"edgecloud gateway on http://{host}:{port} ({len(cfg.nodes)} configured nodes, "
        f"store: {store})",
        file=sys.stderr,
    )
    from gateway.geo import GeoDatabaseError, GeoLocator

    if args.workers > 1:
        try:  # checked here, once, rather than by every worker
            GeoLocator(cfg.geo).close()
        except GeoDatabaseError as exc:
            print(f"edgecloud gateway: error: {exc}", file=sys.stderr)
            return 2
        ready = f"{args.workers} gateway workers listening"
        from gateway.workers.pool import serve_with_workers

        return serve_with_workers(cfg, host, port, args.workers, limits_from_args(args), ready)
    from gateway.front.app import create_gateway_app
    from gateway.http_server import DrainingServer

    try:
        app = create_gateway_app(cfg)
    except GeoDatabaseError as exc:
        print(f"edgecloud gateway: error: {exc}", file=sys.stderr)
        return 2
    server = DrainingServer(
        app, host=host, port=port, limits=limits_from_args(args), proxy_headers=False
    )
    result = server.serve_until_stopped()
    print(result.describe("gateway"), file=sys.stderr)
    return 0
