"""Redis Cluster, as operators run it (issue 50, item 6): 3 primaries with a replica each, from
the system's redis-server (``tests/redis_topologies.py``), reached with a ``redis+cluster://`` URL
through redis-py's own RedisCluster client.

- Each limiter script touches one key, a node's fleet keys share its hash tag: everything
  works on the cluster (no CROSSSLOT), and keys spread over the primaries.
- A view sees every node with its leading prefix blocks, whichever primary holds its keys.
- ``CLUSTER FAILOVER`` of the primary holding a node's keys and a limiter key, during load: no
  request fails; the calls caught by the switch fall back as documented; buckets survive.
- (slow) a primary killed: the replica is elected after the node timeout; the same holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.front.config import GatewayConfig
from gateway.ratelimit import Limits, RedisRateLimiter
from routing.fleet.redis_store import RedisFleetStore
from routing.fleet.redis_view import FleetKeys
from routing.redis_connect import hash_tag
from tests.redis_load import BLOCKS, node_state, run_through
from tests.redis_topologies import LocalCluster, client


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _ns() -> str:
    return f"edgecloud:test-cluster-{uuid.uuid4().hex[:8]}:"


def _clients(cluster: LocalCluster, ns: str):
    cfg = GatewayConfig(redis_url=cluster.url)
    lim = RedisRateLimiter(cluster.url, namespace=ns, client=cfg.redis_client())
    gw = RedisFleetStore(cluster.url, namespace=ns, client=cfg.redis_client())
    nd = RedisFleetStore(cluster.url, namespace=ns)
    return lim, gw, nd


def test_hash_tags_put_a_nodes_keys_in_one_slot_and_spread_nodes(cluster: LocalCluster) -> None:
    keys = FleetKeys("edgecloud:v1:")
    c = client(cluster.primaries()[0])
    owners = set()
    for node_id in (f"node-{i}" for i in range(12)):
        names = (keys.node(node_id), keys.blocks(node_id), keys.events(node_id))
        slots = {c.execute_command("CLUSTER KEYSLOT", k) for k in names}
        assert len(slots) == 1
        assert slots == {c.execute_command("CLUSTER KEYSLOT", node_id)}
        owners.add(cluster.owner(names[0]))
    assert len(owners) == 3  # 12 nodes over 3 primaries
    odd = "a}{b%"  # braces in an id stay inside its tag
    assert hash_tag(odd) == "{a%7D%7Bb%25}"
    assert (
        len(
            {
                c.execute_command("CLUSTER KEYSLOT", keys.node(odd)),
                c.execute_command("CLUSTER KEYSLOT", keys.blocks(odd)),
            }
        )
        == 1
    )


async def test_limiter_and_fleet_on_the_cluster(cluster: LocalCluster) -> None:
    ns = _ns()
    lim, gw, nd = _clients(cluster, ns)
    try:
        for key in (f"key-{i}" for i in range(9)):
            for _ in range(2):
                d = await lim.acquire(key, Limits(rpm=10, tpm=1000), 7)
                assert d.backend == "redis" and d.allowed, d
            assert d.remaining_requests == pytest.approx(8, abs=0.1)
            await lim.settle(d, 2)
        owners = {cluster.owner(lim.key(f"key-{i}")) for i in range(9)}
        assert len(owners) >= 2  # the buckets spread
        ids = [f"c{i}" for i in range(6)]
        for i, node_id in enumerate(ids):
            await nd.put_node(node_state(node_id))
            await nd.record_blocks(node_id, BLOCKS[: i + 1], [])
        assert len({cluster.owner(nd.keys.blocks(n)) for n in ids}) >= 2
        view = await gw.view(BLOCKS)
        assert sorted(n.id for n in view.nodes) == ids and not view.stale
        assert view.prefix_blocks == {n: i + 1 for i, n in enumerate(ids)}
        await nd.remove_node("c0")
        gw._reader._due = 0.0  # type: ignore[attr-defined]  # the next view re-reads the list
        assert "c0" not in [n.id for n in (await gw.view(BLOCKS)).nodes]
    finally:
        for c in (lim, gw, nd):
            await c.close()


async def _failover_under_load(cluster: LocalCluster, kill: bool, what: str) -> None:
    ns = _ns()
    lim, gw, nd = _clients(cluster, ns)
    kept = Limits(rpm=100)
    primary = cluster.owner(gw.keys.node("n1"))

    def event() -> int:
        return cluster.kill_primary(primary) if kill else cluster.failover(primary)

    try:
        for _ in range(30):
            assert (await lim.acquire("kept", kept, 1)).backend == "redis"
        report = await run_through(lim, gw, nd, event, duration_s=6.0 if kill else 4.0)
        print(report.describe(what))
        assert report.failed == []
        assert report.recovered_after_s < report.event_s + 3.0
        assert lim.healthy and gw.healthy
        d = await lim.acquire("kept", kept, 1)
        assert d.backend == "redis" and d.remaining_requests is not None
        assert d.remaining_requests < 90  # replicated: still drained, not full
    finally:
        for c in (lim, gw, nd):
            await c.close()


async def test_cluster_failover_under_load(cluster: LocalCluster) -> None:
    await _failover_under_load(cluster, False, "CLUSTER FAILOVER")


@pytest.mark.slow
async def test_primary_killed_under_load(cluster: LocalCluster) -> None:
    await _failover_under_load(cluster, True, "primary killed")
