"""Redis behind Sentinel, as operators run it (issue 50, item 6): a primary, a replica and 3
Sentinels from the system's redis-server (``tests/redis_topologies.py``), reached through a
``redis+sentinel://`` URL by redis-py's own Sentinel client.

- The rate limiter and the fleet store work through the Sentinel URL.
- ``SENTINEL FAILOVER`` during load: no request fails; the calls caught by the switch fall back
  as documented (in-process limits, the last view) and Redis serves again once Sentinel names
  the new primary; a bucket's level survives (it was replicated).
- (slow) the primary killed: the same, after Sentinel's down-after and election.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.ratelimit import Limits, RedisRateLimiter
from routing.fleet.redis_store import RedisFleetStore
from tests.redis_load import BLOCKS, node_state, run_through
from tests.redis_topologies import LocalSentinel


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    s = LocalSentinel(Path(tmp_path_factory.mktemp("sentinel")))
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _ns() -> str:
    return f"edgecloud:test-sentinel-{uuid.uuid4().hex[:8]}:"


async def test_limiter_and_fleet_through_a_sentinel_url(sentinel: LocalSentinel) -> None:
    ns = _ns()
    lim = RedisRateLimiter(sentinel.url, namespace=ns)
    gw, nd = (
        RedisFleetStore(sentinel.url, namespace=ns),
        RedisFleetStore(sentinel.url, namespace=ns),
    )
    try:
        for _ in range(3):
            d = await lim.acquire("k", Limits(rpm=10), 1)
            assert d.backend == "redis" and d.allowed
        assert d.remaining_requests == pytest.approx(7, abs=0.1)
        await nd.put_node(node_state("s1"))
        await nd.record_blocks("s1", BLOCKS, [])
        view = await gw.view(BLOCKS)
        assert [n.id for n in view.nodes] == ["s1"] and view.prefix_blocks == {"s1": len(BLOCKS)}
    finally:
        for c in (lim, gw, nd):
            await c.close()


async def _failover_under_load(sentinel: LocalSentinel, event, what: str) -> None:
    ns = _ns()
    lim = RedisRateLimiter(sentinel.url, namespace=ns)
    gw, nd = (
        RedisFleetStore(sentinel.url, namespace=ns),
        RedisFleetStore(sentinel.url, namespace=ns),
    )
    kept = Limits(rpm=100)
    try:
        for _ in range(30):
            assert (await lim.acquire("kept", kept, 1)).backend == "redis"
        report = await run_through(lim, gw, nd, event, duration_s=6.0)
        print(report.describe(what))
        assert report.failed == []
        assert report.recovered_after_s < report.event_s + 3.0
        assert lim.healthy and gw.healthy
        # the bucket was replicated: still drained (70 left, plus ~10 s of refill), not full
        d = await lim.acquire("kept", kept, 1)
        assert d.backend == "redis" and d.remaining_requests is not None
        assert d.remaining_requests < 90
    finally:
        for c in (lim, gw, nd):
            await c.close()


async def test_sentinel_failover_under_load(sentinel: LocalSentinel) -> None:
    await _failover_under_load(sentinel, sentinel.failover, "SENTINEL FAILOVER")


@pytest.mark.slow
async def test_primary_killed_under_load(sentinel: LocalSentinel) -> None:
    await _failover_under_load(sentinel, sentinel.kill_primary, "primary killed")
