"""A client that leaves cancels its request everywhere (issue 15.3, request side).

A real gateway (uvicorn, in a thread) in front of one real node per engine, each with room for
ONE running request: request A runs (a long reply sent whole), B waits in the node's queue.
When B's client leaves, B leaves the node's queue (``/load`` waiting back to 0 within about a
second) whether B was streamed or not; when A's client leaves, the node stops generating
(running back to 0). The gateway's counters end at zero.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.nodes import Served, serve_node, tiny_edge_engine

LONG = 1500  # tokens: seconds of generation on the tiny model


@pytest.fixture(scope="module")
def fleet(tiny_model_path: Path, edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    from cloud_engine.config import EngineConfig
    from cloud_engine.engine import CloudEngine
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig
    from routing.model_store import resolve

    info = resolve(tiny_model_path)
    engines = {
        "cloud": CloudEngine.from_model(
            tiny_model_path,
            "cpu",
            config=EngineConfig(device="cpu", kv_memory_bytes=32 << 20, max_running=1),
        ),
        "edge": tiny_edge_engine(tiny_model_path, slots=1, prefix_reuse=False),
    }
    served: list[Served] = []
    out: dict[str, Any] = {"model": info.name}
    try:
        for name, engine in engines.items():
            node = serve_node(engine, tiny_model_path, name)
            served.append(node)
            gw = Served(create_gateway_app(GatewayConfig(nodes=[node.url], poll_interval_s=0.5)))
            served.append(gw)
            out[name] = (node, gw)
        for _, gw in (out["cloud"], out["edge"]):
            deadline = time.monotonic() + 30
            while not httpx.get(gw.url + "/v1/models").json()["data"]:
                assert time.monotonic() < deadline, "the gateway did not see its node"
                time.sleep(0.05)
        yield out
    finally:
        for s in reversed(served):
            s.stop()


async def _load(client: httpx.AsyncClient, node: Served) -> dict[str, Any]:
    return (await client.get(node.url + "/load")).json()


async def _until(client: httpx.AsyncClient, node: Served, key: str, value: int, t: float) -> float:
    """Seconds until the node's ``/load`` shows ``key == value`` (fails after ``t`` s)."""
    t0 = time.monotonic()
    while (await _load(client, node))[key] != value:
        assert time.monotonic() - t0 < t, f"{key} still not {value} after {t} s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def _body(model: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 7,
        "stream": stream,
    }


@pytest.mark.parametrize("engine", ["cloud", "edge"])
async def test_departed_clients_are_cancelled_queued_and_running(fleet, engine: str) -> None:
    node, gw = fleet[engine]
    model = fleet["model"]
    async with httpx.AsyncClient(timeout=60) as probe:
        assert (await _load(probe, node))["running"] == 0

        async def post(body: dict[str, Any]) -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                if body["stream"]:
                    async with c.stream("POST", gw.url + "/v1/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    await c.post(gw.url + "/v1/completions", json=body)

        a = asyncio.ensure_future(post(_body(model, False, LONG)))
        await _until(probe, node, "running", 1, 20)
        for stream in (False, True):  # B waits behind A; its client leaves
            b = asyncio.ensure_future(post(_body(model, stream, 8)))
            await _until(probe, node, "waiting", 1, 20)
            b.cancel()
            took = await _until(probe, node, "waiting", 0, 2.0)
            assert took < 1.5, f"a departed client's queued request left after {took:.2f} s"
            assert (await _load(probe, node))["running"] == 1  # A still runs
        a.cancel()  # A's client leaves: the node stops generating for it
        took = await _until(probe, node, "running", 0, 2.0)
        assert took < 1.5, f"a departed client's running request stopped after {took:.2f} s"
        health = (await probe.get(gw.url + "/health")).json()
        assert health.get("in_flight", 0) == 0
