"""Stored responses: the Redis store (a private redis-server) and the in-process one keep a
response for its owner only, for the TTL; a gateway with a redis_url stores in Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.apis.response_store import (
    KEY_PREFIX,
    InProcessResponseStore,
    RedisResponseStore,
    StoredResponse,
)


def _record(rid: str, owner: str = "alice") -> StoredResponse:
    return StoredResponse(
        owner=owner,
        response={"id": rid, "object": "response", "output": []},
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    )


async def _owner_only(store: Any) -> None:
    await store.put(_record("resp_1"))
    got = await store.get("resp_1", "alice")
    assert got is not None and got.messages[1]["content"] == "yo"
    assert await store.get("resp_1", "bob") is None
    assert not await store.delete("resp_1", "bob")
    assert await store.get("resp_1", "alice") is not None
    assert await store.delete("resp_1", "alice")
    assert await store.get("resp_1", "alice") is None
    assert await store.get("resp_never", "alice") is None


async def test_redis_store_owner_and_ttl(redis_url: str) -> None:
    from routing.redis_link import redis_client

    client = redis_client(redis_url, max_connections=4, pool_timeout_s=1.0)
    try:
        store = RedisResponseStore(client, ttl_s=60)
        await _owner_only(store)
        await store.put(_record("resp_2"))
        ttl = await client.ttl(KEY_PREFIX + "resp_2")
        assert 0 < ttl <= 60
        short = RedisResponseStore(client, ttl_s=1)
        await short.put(_record("resp_3"))
        await asyncio.sleep(1.2)
        assert await short.get("resp_3", "alice") is None
    finally:
        await client.aclose()


async def test_in_process_store_owner_ttl_and_bound() -> None:
    await _owner_only(InProcessResponseStore(ttl_s=60))
    short = InProcessResponseStore(ttl_s=0.05)
    await short.put(_record("resp_4"))
    await asyncio.sleep(0.1)
    assert await short.get("resp_4", "alice") is None
    small = InProcessResponseStore(ttl_s=60, max_entries=2)
    for i in range(3):
        await small.put(_record(f"resp_{i}"))
    assert await small.get("resp_0", "alice") is None
    assert await small.get("resp_2", "alice") is not None


@pytest.mark.parametrize("redis", [True, False])
def test_the_gateway_picks_its_store(redis: bool, redis_url: str) -> None:
    from gateway.front.app import create_gateway_app
    from gateway.front.config import GatewayConfig

    app = create_gateway_app(GatewayConfig(redis_url=redis_url if redis else None))
    kind = RedisResponseStore if redis else InProcessResponseStore
    assert isinstance(app.state.responses, kind)
