"""``edgecloud gateway --config FILE`` and ``edgecloud serve`` (the embedded default).

``serve`` starts an edge node and a cloud node on one model as child processes, sharing the
machine's cores between them (oversubscribed torch threads collapse, see the notes), and the
gateway in front of them in this process with the in-process fleet store. Ctrl-C (or SIGTERM)
stops the gateway, then the children; a child that dies takes the whole thing down with a
message, rather than leaving a half-served endpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    g = sub.add_parser("gateway", help="run the front gateway from a config file")
    g.add_argument("--config", type=Path, required=False, help="gateway YAML (default: built-in)")
    g.add_argument("--host", default=None)
    g.add_argument("--port", type=int, default=None)
    g.set_defaults(func=run_gateway)

    s = sub.add_parser("serve", help="edge node + cloud node + gateway on one machine (embedded)")
    s.add_argument("--model", default="smollm2-135m-instruct", help="store name or HF folder")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="the gateway's port")
    s.add_argument("--edge-port", type=int, default=None, help="default: port + 1")
    s.add_argument("--cloud-port", type=int, default=None, help="default: port + 2")
    s.add_argument("--region", default="local")
    s.add_argument("--edge-variant", default="int8", choices=["fp32", "int8", "int4"])
    s.add_argument("--edge-threads", type=int, default=None, help="default: half the cores")
    s.add_argument("--cloud-threads", type=int, default=None, help="default: the other half")
    s.add_argument("--policy-file", type=Path, default=None, help="routing policy YAML")
    s.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the nodes (the first run exports the ONNX graph)",
    )
    s.set_defaults(func=run_serve)


def _uvicorn(app: object, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        proxy_headers=False,
    )  # type: ignore[arg-type]


def run_gateway(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig, load_gateway_config

    try:
        cfg = load_gateway_config(args.config) if args.config else GatewayConfig()
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        print(f"edgecloud gateway: error: bad config {args.config}: {exc}", file=sys.stderr)
        return 2
    host, port = args.host or cfg.host, args.port if args.port is not None else cfg.port
    print(
        f"edgecloud gateway on http://{host}:{port} ({len(cfg.nodes)} configured nodes, "
        f"store: {'redis' if cfg.redis_url else 'in-process'})",
        file=sys.stderr,
    )
    from gateway.geo import GeoDatabaseError

    try:
        app = create_gateway_app(cfg)
    except GeoDatabaseError as exc:
        print(f"edgecloud gateway: error: {exc}", file=sys.stderr)
        return 2
    _uvicorn(app, host, port)
    return 0


def split_cores(total: int) -> tuple[int, int]:
    """Threads for (edge, cloud): disjoint halves of the cores, at least one each."""
    edge = max(1, total // 2)
    return edge, max(1, total - edge)


def _wait_ready(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"a node exited during start-up (exit code {p.returncode}); see its log above"
                )
        for url in list(pending):
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes not ready after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.5)


def run_serve(args: argparse.Namespace) -> int:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig
    from routing.model_store import ModelNotFound, resolve

    try:
        info = resolve(args.model)
    except ModelNotFound:
        from cloud_engine.model.gguf_import import pull

        info = pull(args.model)
    edge_t, cloud_t = split_cores(os.cpu_count() or 2)
    edge_t, cloud_t = args.edge_threads or edge_t, args.cloud_threads or cloud_t
    edge_port = args.edge_port or args.port + 1
    cloud_port = args.cloud_port or args.port + 2
    exe = [sys.executable, "-m", "gateway.cli"]
    common = ["--model", str(info.path), "--region", args.region, "--host", "127.0.0.1"]
    env = dict(os.environ)
    children = [
        subprocess.Popen(
            [
                *exe,
                "edge",
                "serve",
                *common,
                "--port",
                str(edge_port),
                "--threads",
                str(edge_t),
                "--variant",
                args.edge_variant,
                "--node-id",
                f"edge-{args.region}",
            ],
            env=env,
        ),
        subprocess.Popen(
            [
                *exe,
                "cloud",
                "serve",
                *common,
                "--port",
                str(cloud_port),
                "--threads",
                str(cloud_t),
                "--device",
                "auto",
                "--node-id",
                f"cloud-{args.region}",
            ],
            env=env,
        ),
    ]

    def stop_children(*_: object) -> None:
        for p in children:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in children:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    urls = [f"http://127.0.0.1:{edge_port}", f"http://127.0.0.1:{cloud_port}"]
    try:
        print(
            f"starting edge node ({edge_t} thread(s)) and cloud node ({cloud_t} thread(s)) on "
            f"{info.name}...",
            file=sys.stderr,
        )
        _wait_ready(urls, children, args.ready_timeout)
        cfg = GatewayConfig(
            host=args.host,
            port=args.port,
            nodes=urls,
            policy_file=args.policy_file,
            virtual_models={"auto": info.name},
        )
        print(
            f"edgecloud is serving {info.name} on http://{args.host}:{args.port}/v1 "
            f"(model 'auto' or '{info.name}'); Ctrl-C stops everything",
            file=sys.stderr,
        )
        _uvicorn(create_gateway_app(cfg), args.host, args.port)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        stop_children()
    return 0
