"""``edgecloud serve`` (the embedded default): an edge node, a cloud node where it pays, and the
gateway in front of them, on one machine.

The tiers (``--cloud-device``): with a CUDA device the cloud node runs on it beside the edge
node on the CPU; on a CPU-only machine the edge node serves alone on every core (``auto``):
there the two tiers would split the same cores, and the edge alone answered sooner at 1 to 32
users (``bench/embedded_load.py``, docs/benchmarks.md); ``--cloud-device cpu`` adds a CPU cloud
node on half the cores, ``off`` leaves the cloud node out anywhere.

The nodes are child processes owned by a :class:`routing.supervisor.Supervisor`: they die with
this process however it ends (SIGKILL included), and one that dies takes the whole thing down
with a message and a non-zero exit, rather than leaving a half-served endpoint. SIGTERM or
Ctrl-C drains the gateway (no new connections, in-flight requests finish within
``--drain-timeout``), then stops the children (SIGTERM, then SIGKILL after a few seconds), one
line per thing stopped.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from gateway.commands.argtypes import port
from gateway.commands.edge import VARIANT_CHOICES
from gateway.commands.gateway import add_workers
from gateway.commands.node_args import (
    CLOUD_FLAGS,
    EDGE_FLAGS,
    add_drain_timeout,
    add_serve_flags,
    drain_limits,
    serve_argv,
)

if TYPE_CHECKING:
    from gateway.http_server import DrainingServer
    from gateway.workers.pool import WorkerPool
    from routing.supervisor import ChildExit, Supervisor

# After the gateway has drained, how long the nodes get to exit on SIGTERM before SIGKILL
# (a torch process alone takes a second or more to tear down on a busy machine).
CHILD_STOP_TIMEOUT_S = 10.0
# How long the nodes may take to answer /health (a first run exports the ONNX graph).
READY_TIMEOUT_S = 600.0
REGION = "local"  # the region the embedded nodes report
ALONE_EDGE_SLOTS = 16  # the edge node's --slots when it serves alone (its 4 beside a cloud node)
# the one model answers the names coding agents and SDK examples send (Claude Code, Codex, ...);
# a reply names the model that served it
AGENT_ALIASES = {"claude-*": "auto", "gpt-*": "auto"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "serve", help="edge node, cloud node (on a GPU) and gateway on one machine (embedded)"
    )
    s.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="store name (see: edgecloud models list) or Hugging Face folder path",
    )
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="the gateway's address (non-loopback: see --insecure-no-auth)",
    )
    s.add_argument("--port", type=port, default=8000, help="the gateway's port")
    s.add_argument(
        "--edge-port", type=port, default=None, help="the edge node's port (default: port + 1)"
    )
    s.add_argument(
        "--cloud-port", type=port, default=None, help="the cloud node's port (default: port + 2)"
    )
    s.add_argument(
        "--edge-variant",
        default="auto",
        choices=VARIANT_CHOICES,
        help="the edge node's weights (default auto: the quality gate's pick for this CPU)",
    )
    add_serve_flags(s, EDGE_FLAGS, CLOUD_FLAGS)
    s.add_argument(
        "--policy-file",
        type=Path,
        default=None,
        help="routing policy YAML (see examples/policy.yaml; default: the built-in policy)",
    )
    s.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback --host (serve has no API keys: anyone may use it)",
    )
    add_workers(s)
    add_drain_timeout(s)
    s.set_defaults(func=run_serve)


# what a GPU driver puts on a Linux machine (NVIDIA's; AMD's for ROCm torch): without either,
# torch sees no CUDA device and asking it (a child importing torch, ~2 s) is skipped
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


@functools.cache
def cuda_visible() -> bool:
    """Whether torch is installed and sees a CUDA device (asked in a child process, so that the
    gateway in this one never imports torch; once per process)."""
    if importlib.util.find_spec("torch") is None:
        return False
    if sys.platform.startswith("linux") and not any(map(os.path.exists, GPU_DRIVER_PATHS)):
        return False
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def wants_cloud(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs a cloud node: ``--cloud-device`` ``off``: no; ``cuda`` or
    ``cpu``: yes; ``auto`` (the default): where a CUDA device is visible."""
    device = args.cloud_device or "auto"
    if device == "off":
        return False
    return device != "auto" or cuda_visible()


def split_cores(total: int) -> tuple[int, int]:
    """Threads for (edge, cloud): disjoint halves of the cores, at least one each."""
    edge = max(1, total // 2)
    return edge, max(1, total - edge)


def _wait_ready(urls: list[str], supervisor: Supervisor, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        if supervisor.unexpected is not None:
            raise RuntimeError(f"{supervisor.unexpected.describe()} during start-up; see its log")
        for url in list(pending):
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes not ready after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.25)


def _node_argv(kind: str, args: argparse.Namespace, model: Path, port: int) -> list[str]:
    """The command line of ``serve``'s ``kind`` node: its place, the gateway's drain time (under
    systemd every process of the unit gets SIGTERM at once, and a node must then drain as long
    as the gateway in front of it), and the engine flags ``serve`` was given for it."""
    argv = [sys.executable, "-m", "gateway.cli", kind, "serve", "--model", str(model)]
    argv += ["--region", REGION, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--node-id", f"{kind}-{REGION}", "--drain-timeout", str(args.drain_timeout)]
    if kind == "edge":
        argv += ["--variant", args.edge_variant]
    return argv + serve_argv(EDGE_FLAGS if kind == "edge" else CLOUD_FLAGS, args)


def run_serve(args: argparse.Namespace) -> int:
    """Start the nodes, serve the gateway until SIGTERM/Ctrl-C or a node's death, stop all.

    The supervisor is the one owner of the children: whatever path this function leaves by,
    its ``finally`` stops them, once. Returns 1 if a node died or start-up failed, else 0.
    """
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig, UnsafeExposure
    from gateway.http_server import DrainingServer
    from routing.model_store import ModelNotFound, resolve
    from routing.supervisor import ChildSpec, Supervisor

    limits = drain_limits(args)
    try:  # before anything starts: serve has no API keys
        GatewayConfig(host=args.host, insecure_no_auth=args.insecure_no_auth).check_exposure()
    except UnsafeExposure as exc:
        print(f"edgecloud serve: error: {exc}", file=sys.stderr)
        return 2
    # The nodes listen on loopback, but other local users could reach them: a token per run,
    # given to the children in their environment (not on their command line).
    node_token = os.environ.get("EDGECLOUD_NODE_TOKEN") or secrets.token_urlsafe(32)
    # ... and plain HTTP: the nodes are reached on loopback only, so a TLS folder set for
    # standalone nodes ($EDGECLOUD_NODE_TLS) is not handed on (it would add nothing here).
    node_env = {k: v for k, v in os.environ.items() if k != "EDGECLOUD_NODE_TLS"}
    node_env["EDGECLOUD_NODE_TOKEN"] = node_token
    try:
        info = resolve(args.model)
    except ModelNotFound:
        from cloud_engine.model.catalog import CATALOG
        from cloud_engine.model.pull import pull

        if args.model not in CATALOG:  # the error names what is stored, pullable, importable
            raise
        info = pull(args.model)
    cloud = wants_cloud(args)
    if cloud:
        edge_t, cloud_t = split_cores(os.cpu_count() or 2)
        args.edge_threads, args.cloud_threads = (
            args.edge_threads or edge_t,
            args.cloud_threads or cloud_t,
        )
    elif args.edge_slots is None:  # alone: the node's own threads (every core, at most 8)
        args.edge_slots = ALONE_EDGE_SLOTS
    edge_port = args.edge_port or args.port + 1
    cloud_port = args.cloud_port or args.port + 2
    from gateway.cli import check_port_free

    check_port_free(args.host, args.port)
    check_port_free("127.0.0.1", edge_port, "--edge-port")
    if cloud:
        check_port_free("127.0.0.1", cloud_port, "--cloud-port")
    if args.edge_variant == "auto":  # measured here, on a quiet machine; the edge node reads it
        from edge_runtime.quality_gate import choose_variant

        gate = choose_variant(info.path, threads=args.edge_threads)
        print(f"edge weights: {gate.summary()}", file=sys.stderr)
    servers: list[DrainingServer | WorkerPool] = []

    def node_died(ended: ChildExit) -> None:  # the supervisor's watcher thread
        print(f"edgecloud serve: error: {ended.describe()}; stopping", file=sys.stderr)
        for server in servers:
            server.request_stop(f"{ended.name} exited")

    supervisor = Supervisor(on_unexpected_exit=node_died)
    # Until the gateway's server takes over the signals, SIGTERM stops start-up as Ctrl-C does.
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    rc = 0
    try:
        edge = "edge node " + (
            f"({args.edge_threads} thread(s))" if args.edge_threads else "on every core"
        )
        if cloud:
            what = f"{edge} and cloud node ({args.cloud_threads or 'its'} thread(s))"
        else:  # docs/benchmarks.md, embedded_load
            what = f"{edge} alone (no cloud node: without a GPU the edge on every core answers "
            what += "sooner than two tiers splitting them; --cloud-device cpu adds one)"
        print(f"starting {what} on {info.name}...", file=sys.stderr)
        supervisor.start(
            ChildSpec("edge node", _node_argv("edge", args, info.path, edge_port), node_env)
        )
        urls = [f"http://127.0.0.1:{edge_port}"]
        if cloud:
            supervisor.start(
                ChildSpec("cloud node", _node_argv("cloud", args, info.path, cloud_port), node_env)
            )
            urls.append(f"http://127.0.0.1:{cloud_port}")
        _wait_ready(urls, supervisor, READY_TIMEOUT_S)
        cfg = GatewayConfig(
            host=args.host,
            port=args.port,
            nodes=urls,
            policy_file=args.policy_file,
            virtual_models={"auto": info.name},
            model_aliases=AGENT_ALIASES,
            node_token=node_token,
            insecure_no_auth=args.insecure_no_auth,
        )
        serving = (
            f"edgecloud is serving {info.name} on http://{args.host}:{args.port}/v1 "
            f"(model 'auto' or '{info.name}'; 'claude-*' and 'gpt-*' names map to it); "
            "Ctrl-C stops everything"
        )
        if args.workers > 1:

            def keep(pool: WorkerPool) -> None:  # a node's death stops it, as it does a server
                servers.append(pool)
                if supervisor.unexpected is not None:  # died between start-up and here
                    pool.request_stop(f"{supervisor.unexpected.name} exited")

            from gateway.workers.pool import serve_with_workers

            rc = serve_with_workers(
                cfg,
                args.host,
                args.port,
                args.workers,
                limits,
                serving,
                on_pool=keep,
                # from the first stop request on, the nodes' own exits are expected ones
                on_stop_request=lambda _reason: supervisor.expect_exits(),
            )
        else:
            server = DrainingServer(
                create_gateway_app(cfg),
                host=args.host,
                port=args.port,
                limits=limits,
                proxy_headers=False,
                # from the first stop request on, the nodes' own exits are expected ones
                on_stop_request=lambda _reason: supervisor.expect_exits(),
            )
            servers.append(server)
            if supervisor.unexpected is not None:  # died between start-up and here
                server.request_stop(f"{supervisor.unexpected.name} exited")
            print(serving, file=sys.stderr)
            result = server.serve_until_stopped()
            print(result.describe("gateway"), file=sys.stderr)
    except RuntimeError as exc:
        print(f"edgecloud serve: error: {exc}", file=sys.stderr)
        rc = 1
    except KeyboardInterrupt:
        print("edgecloud serve: interrupted during start-up", file=sys.stderr)
    finally:
        # Stopping is bounded (CHILD_STOP_TIMEOUT_S, then SIGKILL): a second signal must not
        # interrupt it half-way.
        handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for ended in supervisor.stop(term_timeout_s=CHILD_STOP_TIMEOUT_S):
                print(ended.describe(), file=sys.stderr)
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
            signal.signal(signal.SIGTERM, previous_term)
    return 1 if supervisor.unexpected is not None else rc
