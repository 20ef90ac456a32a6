"""The router's picture of the fleet against what the nodes report (issue: routing grounded in
what the fleet really holds).

A real gateway, with the in-process store and with Redis, in front of real nodes on loopback
(the tiny random model): a cloud node, an edge node with prefix reuse and an edge node without.
- A repeated prompt is credited (``x-edgecloud-credited-tokens``) exactly as the node that runs
  it then reports (``usage.prompt_tokens_details.cached_tokens``).
- A node that keeps no prefix cache is never credited, and serves no block feed.
- A follow-up turn on the edge reuses its slot's blocks and the gateway credits exactly that.
- Requests sent to a node count in the next decision before any new NodeState arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from routing.blocks import BLOCK_SIZE
from tests.nodes import Served, serve_node, tiny_cloud_engine, tiny_edge_engine

LONG = " ".join(f"Clause {i}: the tenant keeps the premises clean and tidy." for i in range(30))


@pytest.fixture(scope="module")
def nodes(tiny_model_path: Path, edge_home: None, one_torch_thread: None) -> Iterator[dict]:
    from routing.model_store import resolve

    served: dict[str, Served] = {}
    try:
        engines = {
            "cloud": tiny_cloud_engine(tiny_model_path),
            "edge": tiny_edge_engine(tiny_model_path),
            "plain": tiny_edge_engine(tiny_model_path, prefix_reuse=False),
        }
        for name, engine in engines.items():
            served[name] = serve_node(engine, tiny_model_path, name)
        yield {"served": served, "model": resolve(tiny_model_path).name}
    finally:
        for s in served.values():
            s.stop()


def _gateway(nodes: dict, **config: Any) -> Served:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    urls = [s.url for s in nodes["served"].values()]
    gw = Served(create_gateway_app(GatewayConfig(nodes=urls, **config)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len(httpx.get(gw.url + "/admin/nodes").json()["nodes"]) == len(urls):
            return gw
        time.sleep(0.05)
    raise TimeoutError("the gateway did not see every node")


def _chat(model: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def _run(url: str, body: dict[str, Any]) -> tuple[httpx.Headers, dict[str, Any]]:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers, r.json()


def _cached(obj: dict[str, Any]) -> int:
    return int(obj["usage"]["prompt_tokens_details"]["cached_tokens"])


def _candidates(gw: Served, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    r = httpx.post(gw.url + "/v1/route", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return {c["node"]: c for c in r.json()["candidates"]}


def test_repeated_prompt_is_credited_as_the_node_reports_in_process(nodes) -> None:
    gw = _gateway(nodes, poll_interval_s=1.0)
    try:
        for holder in ("edge", "cloud"):
            url = nodes["served"][holder].url
            _check_repeat_credit(gw, nodes["model"], holder, url, wait_s=3.0)
    finally:
        gw.stop()


def test_repeated_prompt_is_credited_as_the_node_reports_with_redis(
    nodes, redis_url: str, tiny_model_path: Path
) -> None:
    """Nodes publish to Redis (every second) from their one block feed; the gateway reads the
    prefix index from Redis only."""
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig
    from routing.fleet.redis_store import RedisFleetStore
    from routing.model_store import resolve

    info = resolve(tiny_model_path)
    namespace = f"edgecloud:test-truth-{time.monotonic_ns()}:"
    served: list[Served] = []
    try:
        for name, engine in (
            ("r-cloud", tiny_cloud_engine(tiny_model_path)),
            ("r-plain", tiny_edge_engine(tiny_model_path, prefix_reuse=False)),
        ):
            store = RedisFleetStore(redis_url, namespace=namespace)
            served.append(serve_node(engine, tiny_model_path, name, store=store))
        cfg = GatewayConfig(redis_url=redis_url)
        gw_app = create_gateway_app(cfg, RedisFleetStore(redis_url, namespace=namespace))
        gw = Served(gw_app)
        served.append(gw)
        deadline = time.monotonic() + 30
        while len(httpx.get(gw.url + "/admin/nodes").json()["nodes"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _check_repeat_credit(gw, info.name, "r-cloud", served[0].url, wait_s=5.0)
    finally:
        for s in reversed(served):
            s.stop()


def _check_repeat_credit(
    gw: Served, model: str, holder: str, holder_url: str, wait_s: float
) -> None:
    """The prompt runs once straight on ``holder``; the gateway then credits it (and nobody
    else) with exactly the blocks it reports reusing when the prompt comes again."""
    system = f"For {holder}. {LONG}"  # a prompt of its own: nobody else can hold its blocks
    body = _chat(model, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
    _, first = _run(holder_url, body)
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 10 * BLOCK_SIZE
    assert _cached(first) == 0  # a prompt no node saw before

    deadline = time.monotonic() + wait_s
    while True:  # straight to the node: the gateway learns it at its next poll or push (1 s)
        credit = {n: c["cached_tokens"] for n, c in _candidates(gw, body).items()}
        if credit.get(holder, 0) > 0 or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    expected = ((prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE  # every full block but the last token's
    assert credit[holder] == expected, credit
    assert all(v == 0 for n, v in credit.items() if n != holder), credit  # nobody else holds it

    for _ in range(3):
        h, again = _run(gw.url, body)
        node = h["x-edgecloud-node"]
        assert int(h["x-edgecloud-credited-tokens"]) == _cached(again), (node, dict(h))
        if node == holder:
            assert _cached(again) == expected


def test_a_node_without_a_prefix_cache_is_never_credited(nodes) -> None:
    model = nodes["model"]
    plain = nodes["served"]["plain"].url
    body = _chat(model, [{"role": "user", "content": LONG}])
    for _ in range(2):  # straight to the node: the same prompt twice
        _, obj = _run(plain, body)
        assert _cached(obj) == 0
    assert httpx.get(plain + "/load").json()["prefix_cache"] is False
    assert httpx.get(plain + "/prefix/events").status_code == 404
    gw = _gateway(nodes, poll_interval_s=1.0)
    try:
        assert _candidates(gw, body)["plain"]["cached_tokens"] == 0
    finally:
        gw.stop()


def test_a_follow_up_turn_on_the_edge_reuses_its_prefix(nodes) -> None:
    model = nodes["model"]
    edge = nodes["served"]["edge"].url
    turn1 = [{"role": "system", "content": LONG}, {"role": "user", "content": "Who cleans?"}]
    _, first = _run(edge, _chat(model, turn1, max_tokens=6))
    assert _cached(first) == 0
    reply = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    gw = _gateway(nodes, poll_interval_s=1.0)
    try:
        credited = _candidates(gw, _chat(model, turn2))["edge"]["cached_tokens"]
        _, second = _run(edge, _chat(model, turn2))
        # whole blocks of the first turn's prompt at least: the chat's text is resent as is
        assert _cached(second) >= (first["usage"]["prompt_tokens"] // BLOCK_SIZE) * BLOCK_SIZE
        assert _cached(second) % BLOCK_SIZE == 0
        assert credited == _cached(second)
        load = httpx.get(edge + "/load").json()
        assert load["prefix_cache"] is True and load["prefix_hit_rate"] > 0
    finally:
        gw.stop()


async def test_requests_sent_count_before_the_next_node_state(nodes) -> None:
    """Eight streams in flight through a gateway that polls node states once a minute: its
    next decision counts all eight on the nodes they went to."""
    gw = _gateway(nodes, poll_interval_s=60.0)
    model = nodes["model"]
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            body = _chat(model, [{"role": "user", "content": "Tell me a long story."}])
            body.update(max_tokens=200, stream=True)
            opened = asyncio.Event()
            seen: list[str] = []

            async def stream() -> None:
                async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                    seen.append(r.headers["x-edgecloud-node"])
                    if len(seen) == 8:
                        opened.set()
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.create_task(stream()) for _ in range(8)]
            await asyncio.wait_for(opened.wait(), 60)
            r = await client.post(gw.url + "/v1/route", json={**body, "stream": False})
            cands = {c["node"]: c for c in r.json()["candidates"]}
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for node in set(seen):
            assert cands[node]["in_hand"] == seen.count(node), (seen, cands)
        assert sum(c["in_hand"] for c in cands.values()) == 8
    finally:
        gw.stop()
