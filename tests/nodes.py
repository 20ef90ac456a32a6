"""Starting real node and gateway processes on loopback for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn

from tests.conftest import free_port

if TYPE_CHECKING:
    from cloud_engine.engine import CloudEngine
    from edge_runtime.engine import EdgeEngine
    from routing.fleet.store import FleetStore

REPO = Path(__file__).resolve().parents[1]


class Proc:
    """A child process serving HTTP on ``port``; ``stop()`` sends SIGINT and waits."""

    def __init__(
        self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 300.0, path: str = "/health") -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


class Served:
    """An ASGI app under uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """Shut the server down (its lifespan too: a node deregisters from its fleet store); one
        still running after two minutes fails the test that stops it, not the next to share
        the fleet store."""
        self.server.should_exit = True
        self.thread.join(timeout=120)
        if self.thread.is_alive():
            raise RuntimeError(f"the server on port {self.port} did not stop within 120 s")


def tiny_cloud_engine(model: Path) -> CloudEngine:
    """The cloud engine on the tiny model, CPU, a 32 MB KV pool."""
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine

    return CloudEngine.from_model(
        model, "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=32 << 20)
    )


def tiny_edge_engine(model: Path, **config: Any) -> EdgeEngine:
    """The edge engine on the tiny model's fp32 export: 4 slots, one thread (``config``
    overrides EdgeEngineConfig fields)."""
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig

    cfg = EdgeEngineConfig(**{"slots": 4, "threads": 1, "huge_pages": False, **config})
    return EdgeEngine.from_model(model, "fp32", config=cfg)


def serve_node(
    engine: Any,
    model: Path,
    node_id: str,
    *,
    store: FleetStore | None = None,
    node_token: str | None = None,
) -> Served:
    """The real node app over ``engine`` (serving ``model``), under uvicorn on a free port."""
    from gateway.node.app import create_node_app
    from gateway.node.server import build_service
    from routing.model_store import resolve

    port = free_port()
    service = build_service(
        engine, resolve(model), region="test", host="127.0.0.1", port=port, node_id=node_id
    )
    return Served(create_node_app(service, store, node_token=node_token), port)


@contextlib.contextmanager
def tiny_fleet(model: Path, suffix: str, **gateway_config: Any) -> Iterator[dict[str, Any]]:
    """A tiny cloud node, a tiny edge node and a real gateway in front of both (in-process
    store), each under uvicorn on loopback; yields ``{"served": {"cloud", "edge", "gw"},
    "model": name, "gateway": the Gateway object}`` once the gateway sees both nodes."""
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig
    from routing.model_store import resolve

    served: dict[str, Served] = {}
    try:
        served["cloud"] = serve_node(tiny_cloud_engine(model), model, f"cloud-{suffix}")
        served["edge"] = serve_node(tiny_edge_engine(model), model, f"edge-{suffix}")
        nodes = [served["edge"].url, served["cloud"].url]
        app = create_gateway_app(GatewayConfig(nodes=nodes, **gateway_config))
        served["gw"] = Served(app)
        deadline = time.monotonic() + 30
        while len(httpx.get(served["gw"].url + "/admin/nodes").json()["nodes"]) < 2:
            assert time.monotonic() < deadline, "the gateway never saw both nodes"
            time.sleep(0.05)
        yield {"served": served, "model": resolve(model).name, "gateway": app.state.gateway}
    finally:
        for s in served.values():
            s.stop()


def gateway_over(node_url: str | None, **config: Any) -> Served:
    """A real gateway (in-process store) in front of one node (or only the ``openai_nodes`` of
    ``config``), once it sees it."""
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    nodes = [node_url] if node_url else []
    gw = Served(create_gateway_app(GatewayConfig(nodes=nodes, poll_interval_s=1.0, **config)))
    deadline = time.monotonic() + 30
    while not httpx.get(gw.url + "/admin/nodes").json()["nodes"]:
        assert time.monotonic() < deadline, "the gateway never saw its node"
        time.sleep(0.05)
    return gw


@contextlib.contextmanager
def default_model_tiers(model: Path, suffix: str) -> Iterator[dict[str, Any]]:
    """An edge node (fp32, 4 slots) and a CPU cloud node on the default model, each behind a
    gateway of its own (so a test picks the tier); yields ``{"model", "gw": {tier: url},
    "node": {tier: url}}``."""
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from edge_runtime.engine import EdgeEngine, EdgeEngineConfig
    from routing.model_store import resolve

    served: list[Served] = []
    try:
        edge = EdgeEngine.from_model(
            model, "fp32", config=EdgeEngineConfig(slots=4, threads=2, huge_pages=False)
        )
        served.append(serve_node(edge, model, f"edge-{suffix}"))
        cloud = CloudEngine.from_model(
            model, "cpu", config=EngineConfig(device="cpu", kv_memory_bytes=96 << 20)
        )
        served.append(serve_node(cloud, model, f"cloud-{suffix}"))
        gws = {"edge": gateway_over(served[0].url), "cloud": gateway_over(served[1].url)}
        served += gws.values()
        yield {
            "model": resolve(model).name,
            "gw": {k: v.url for k, v in gws.items()},
            "node": {"edge": served[0].url, "cloud": served[1].url},
        }
    finally:
        for s in reversed(served):
            s.stop()
