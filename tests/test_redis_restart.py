"""Redis under load and across an empty restart (issue 15, item 6), against a private
redis-server (``tests/conftest.py``).

- A flood of concurrent clients through the gateway's own pool (a BlockingConnectionPool sized
  from ``max_in_flight``) admits at most the token bucket's ceiling and never falls back.
- Redis stopped and restarted empty: rate-limit buckets restart empty (refilling), not full; the
  gateway keeps serving from its last view (no 503 window); the node re-sends its whole prefix
  index.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.ratelimit import Limits, RedisRateLimiter
from tests.nodes import Served, serve_node, tiny_cloud_engine


def _ns() -> str:
    return f"edgecloud:test-restart-{uuid.uuid4().hex[:8]}:"


# ---- the flood ---------------------------------------------------------------------------------
async def _flood(lim: RedisRateLimiter, limits: Limits, clients: int, waves: int) -> int:
    key = f"flood-{uuid.uuid4().hex[:8]}"
    admitted = 0

    async def one() -> None:
        nonlocal admitted
        if (await lim.acquire(key, limits, 10)).allowed:
            admitted += 1

    for _ in range(waves):
        await asyncio.gather(*(one() for _ in range(clients)))
    return admitted


async def test_flood_of_concurrent_clients_admits_at_most_the_ceiling(redis_url: str) -> None:
    from gateway.front.config import GatewayConfig

    cfg = GatewayConfig(redis_url=redis_url, max_in_flight=64)  # pool of 64 for 300 clients
    assert cfg.redis_pool_size == 64
    lim = RedisRateLimiter(redis_url, namespace=_ns(), client=cfg.redis_client())
    limits = Limits(rpm=120)
    t0 = time.monotonic()
    admitted = await _flood(lim, limits, clients=300, waves=4)
    elapsed = time.monotonic() - t0
    ceiling = 120 + 120 * elapsed / 60.0
    print(
        f"flood: {admitted} admitted / ceiling {ceiling:.1f} ({elapsed:.2f} s, 1200 tries, "
        f"{lim.fallback_decisions} fallback decisions, last error {lim.last_error})"
    )
    # No pool overflow any more (a loaded machine may still time out a read now and then:
    # those few fall back, conservatively).
    assert lim.fallback_decisions < 50
    assert 100 <= admitted <= ceiling
    await lim.close()


async def test_redis_py_default_pool_overflows_under_the_same_flood(redis_url: str) -> None:
    """The bug the sized pool fixes: redis-py's default pool (100) overflows, requests fall
    back; the fallback now admits at most this replica's share, from the last Redis level."""
    client = Redis.from_url(redis_url, decode_responses=True)
    lim = RedisRateLimiter(redis_url, namespace=_ns(), client=client)
    t0 = time.monotonic()
    admitted = await _flood(lim, Limits(rpm=120), clients=300, waves=4)
    ceiling = 120 + 120 * (time.monotonic() - t0) / 60.0
    print(
        f"default pool: {admitted} admitted / ceiling {ceiling:.1f}, "
        f"{lim.fallback_decisions} fallback decisions"
    )
    assert lim.fallback_decisions > 0  # it did overflow
    # bounded (the calls in flight when it overflowed are only estimated; on a loaded 2-core
    # machine up to ~1.3x was seen): it was ~2x before the fallback started from Redis's level
    assert admitted <= 1.5 * ceiling
    await lim.close()


# ---- an empty restart: the limiter ------------------------------------------------------------
async def test_buckets_restart_empty_after_an_empty_redis_restart(redis_server: Any) -> None:
    ns = _ns()
    lim = RedisRateLimiter(redis_server.url, namespace=ns, retry_interval_s=0.0)
    fresh = RedisRateLimiter(redis_server.url, namespace=ns)
    limits = Limits(rpm=60)
    # A new deployment starts full.
    assert (await lim.acquire("k60", limits, 1)).remaining_requests == pytest.approx(59, abs=0.1)
    while (await lim.acquire("k60", limits, 1)).allowed:
        pass
    redis_server.stop()
    redis_server.start()
    t0 = time.monotonic()
    admitted = 0
    while time.monotonic() - t0 < 3.0:
        d = await lim.acquire("k60", limits, 1)
        admitted += d.allowed
        await asyncio.sleep(0.02)
    elapsed = time.monotonic() - t0
    print(f"60 rpm key after an empty restart: {admitted} admitted in {elapsed:.1f} s")
    assert admitted <= 1 + elapsed  # its rate (1/s), not a full bucket of 60
    assert lim.epochs_seen == 2 and lim.healthy
    # A gateway that never saw the old epoch still finds the restart's epoch: not full either.
    d = await fresh.acquire("other-key", limits, 1)
    assert d.backend == "redis" and d.remaining_requests is not None
    assert d.remaining_requests < 10
    await lim.close()
    await fresh.close()


async def test_fallback_admits_a_share_from_the_last_level(redis_server: Any) -> None:
    lim = RedisRateLimiter(redis_server.url, namespace=_ns(), replicas=4, retry_interval_s=60)
    limits = Limits(rpm=40)
    for _ in range(20):  # 20 of 40 left in Redis
        assert (await lim.acquire("share", limits, 1)).allowed
    redis_server.stop()
    try:
        admitted = 0
        for _ in range(50):
            d = await lim.acquire("share", limits, 1)
            assert d.degraded
            admitted += d.allowed
        # this replica's share of what was left: 20 / 4 = 5 (a fresh key: 40 / 4 = 10)
        assert admitted == 5
        fresh = [(await lim.acquire("unseen", limits, 1)).allowed for _ in range(20)]
        assert sum(fresh) == 10
    finally:
        redis_server.start()
    await lim.close()


# ---- an empty restart: gateway, node, prefix index --------------------------------------------
@pytest.fixture(scope="module")
def fleet(
    tiny_model_path: Path, redis_url: str, one_torch_thread: None
) -> Iterator[dict[str, Any]]:
    """A real gateway and a real tiny cloud node (prefix cache on), both on Redis."""
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig
    from routing.fleet.redis_store import RedisFleetStore
    from routing.model_store import resolve

    info = resolve(tiny_model_path)
    ns = _ns()
    served: list[Served] = []
    try:
        store = RedisFleetStore(redis_url, namespace=ns)
        node = serve_node(
            tiny_cloud_engine(tiny_model_path), tiny_model_path, "rc-cloud", store=store
        )
        served.append(node)
        gw = Served(
            create_gateway_app(
                GatewayConfig(redis_url=redis_url), RedisFleetStore(redis_url, namespace=ns)
            )
        )
        served.append(gw)
        deadline = time.monotonic() + 30
        while not httpx.get(gw.url + "/admin/nodes").json()["nodes"]:
            assert time.monotonic() < deadline, "the gateway never saw the node"
            time.sleep(0.1)
        yield {"gw": gw, "node": node, "ns": ns, "model": info.name}
    finally:
        for s in reversed(served):
            s.stop()


PROMPT = " ".join(f"Clause {i}: the tenant keeps the premises clean." for i in range(12))


async def _blocks(redis_url: str, ns: str) -> set[str]:
    r = Redis.from_url(redis_url, decode_responses=True)
    try:
        return set(await r.smembers(f"{ns}blocks:{{rc-cloud}}"))
    finally:
        await r.aclose()


async def test_empty_restart_no_503_window_and_prefix_index_republished(
    fleet: dict[str, Any], redis_server: Any
) -> None:
    gw, node, ns = fleet["gw"], fleet["node"], fleet["ns"]
    body = {
        "model": fleet["model"],
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 1,
        "temperature": 0,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while not (before := await _blocks(redis_server.url, ns)):
            assert time.monotonic() < deadline, "the node never published its blocks"
            await asyncio.sleep(0.1)
        pushes0 = (await client.get(node.url + "/health")).json()["store"]["full_index_pushes"]

        statuses: list[tuple[float, int, str]] = []
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                resp = await client.post(gw.url + "/v1/chat/completions", json=body)
                code = resp.json().get("error", {}).get("code", "") if resp.status_code else ""
                statuses.append((time.monotonic(), resp.status_code, code))

        tasks = [asyncio.create_task(load()) for _ in range(2)]
        await asyncio.sleep(0.5)
        t_stop = time.monotonic()
        await asyncio.to_thread(redis_server.stop)
        await asyncio.sleep(0.3)  # an outage: stale views
        await asyncio.to_thread(redis_server.start)
        t_start = time.monotonic()
        # until the node is back in Redis with its whole index
        deadline = time.monotonic() + 15
        while (await _blocks(redis_server.url, ns)) != before:
            assert time.monotonic() < deadline, "the prefix index was not re-published"
            await asyncio.sleep(0.05)
        t_back = time.monotonic()
        await asyncio.sleep(1.5)  # and some more traffic after
        stop.set()
        await asyncio.gather(*tasks)
        health = (await client.get(node.url + "/health")).json()["store"]
        gw_health = (await client.get(gw.url + "/health")).json()

    bad = [(t, s, c) for t, s, c in statuses if s != 200]
    window = (max(t for t, *_ in bad) - min(t for t, *_ in bad)) if bad else 0.0
    during = [s for t, s, _ in statuses if t_stop <= t <= t_back]
    print(
        f"empty restart: {len(statuses)} requests, {len(during)} during outage+recovery, "
        f"{len(bad)} non-200 (503 window {window * 1000:.0f} ms); index back "
        f"{t_back - t_start:.2f} s after the restart"
    )
    assert not bad, bad[:5]
    assert during, "no request ran during the outage"
    assert health["full_index_pushes"] > pushes0
    # the gateway saw the outage end and began a recovery; whether a node was still missing
    # then (a carried view) depends on who is first after the restart: on a fast machine the
    # node re-publishes before the gateway's next view
    assert gw_health["store"]["recoveries_total"] >= 1
    assert gw_health["store"]["recovering"] is False  # the node is back: nothing carried
