"""RedisFleetStore against the private test Redis: TTLs, the block index, one-round-trip views,
and an outage (stop Redis, serve the last view, start it, recover)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from routing.blocks import block_hashes, model_seed
from routing.fleet.memory_store import OpenAINodeConfig, OpenAINodeTracker
from routing.fleet.redis_store import FleetStoreUnavailable, RedisFleetStore, hex_hash
from routing.fleet.state import NodeKind, NodeState


def node(node_id: str, kind: NodeKind = NodeKind.CLOUD, ttl_s: float = 5.0, **kw) -> NodeState:
    return NodeState(
        id=node_id,
        kind=kind,
        region=kw.pop("region", "us-east"),
        url=f"http://{node_id}:8000",
        models=["m"],
        max_context=4096,
        device="cpu",
        max_batch=8,
        ttl_s=ttl_s,
        **kw,
    )


@pytest.fixture
def namespace() -> str:
    return f"edgecloud:v1:test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def store(redis_url: str, namespace: str):
    s = RedisFleetStore(redis_url, namespace=namespace, retry_interval_s=0.0)
    yield s
    await s.close()


@pytest.fixture
async def raw(redis_url: str):
    r = Redis.from_url(redis_url, decode_responses=True)
    yield r
    await r.aclose()


HASHES = block_hashes(list(range(16 * 6)), model_seed("test-model"))


async def test_states_have_ttl_and_expire(store: RedisFleetStore, raw: Redis, namespace: str):
    await store.put_node(node("short", ttl_s=0.3, running=3))
    await store.put_node(node("long", ttl_s=30.0))
    pttl = await raw.pttl(f"{namespace}node:{{short}}")
    assert 0 < pttl <= 300
    assert await raw.zscore(f"{namespace}nodes", "long") is not None

    view = await store.view([])
    assert sorted(n.id for n in view.nodes) == ["long", "short"]
    assert next(n for n in view.nodes if n.id == "short").running == 3
    assert view.stale is False

    await asyncio.sleep(0.45)
    view = await store.view([])
    assert [n.id for n in view.nodes] == ["long"]


async def test_block_events_and_leading_matches(store: RedisFleetStore, raw: Redis, namespace: str):
    await store.put_node(node("c1"))
    await store.put_node(node("c2"))
    await store.put_node(node("e1", NodeKind.EDGE))
    await store.record_blocks("c1", HASHES[:4], [])
    # c2 holds blocks 0, 1 and 3 but not 2: only two lead.
    await store.record_blocks("c2", [HASHES[0], HASHES[1], HASHES[3]], [])
    members = await raw.smembers(f"{namespace}blocks:{{c1}}")
    assert members == {hex_hash(h) for h in HASHES[:4]}
    assert await raw.xlen(f"{namespace}events:{{c1}}") == 1

    view = await store.view(HASHES)
    assert view.prefix_blocks == {"c1": 4, "c2": 2}

    # A removal of block 1 on c1 cuts its leading run to 1.
    await store.record_blocks("c1", [], [HASHES[1]])
    view = await store.view(HASHES)
    assert view.prefix_blocks == {"c1": 1, "c2": 2}
    # A request whose first block nobody holds matches nothing.
    view = await store.view([12345, *HASHES])
    assert view.prefix_blocks == {}

    await store.remove_node("c1")
    assert not await raw.exists(f"{namespace}blocks:{{c1}}", f"{namespace}node:{{c1}}")
    view = await store.view(HASHES)
    assert sorted(n.id for n in view.nodes) == ["c2", "e1"]


async def test_only_reported_blocks_are_credited(store: RedisFleetStore):
    await store.put_node(node("e1", NodeKind.EDGE))  # keeps no prefix cache: never credited
    assert await store.put_node(node("c1")) is False  # no index of c1 in the store yet
    await store.record_blocks("c1", [HASHES[0], HASHES[1], HASHES[3]], [])
    assert await store.put_node(node("c1")) is True
    view = await store.view(HASHES)
    assert view.prefix_blocks == {"c1": 2}  # the longest run of leading blocks, not any block

    await store.replace_blocks("c1", HASHES[2:])  # a snapshot replaces the whole index
    assert (await store.view(HASHES)).prefix_blocks == {}
    assert (await store.view(HASHES[2:])).prefix_blocks == {"c1": len(HASHES) - 2}


async def test_view_is_one_round_trip(store: RedisFleetStore, raw: Redis, monkeypatch):
    for i in range(4):
        await store.put_node(node(f"n{i}"))
    await store.record_blocks("n0", HASHES, [])
    await store.view(HASHES)  # loads the script into Redis once

    sent: list[str] = []
    original = store.redis.execute_command

    async def counting(*args, **kwargs):
        sent.append(str(args[0]).upper())
        return await original(*args, **kwargs)

    monkeypatch.setattr(store.redis, "execute_command", counting)

    async def evalsha_calls() -> int:
        stats = await raw.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    before = await evalsha_calls()
    view = await store.view(HASHES)
    after = await evalsha_calls()
    assert sent == ["EVALSHA"]
    assert after - before == 1
    assert len(view.nodes) == 4 and view.prefix_blocks == {"n0": len(HASHES)}


async def test_openai_nodes_are_merged_into_the_view(redis_url: str, namespace: str):
    tracker = OpenAINodeTracker(
        OpenAINodeConfig(id="vllm", url="http://vllm", region="eu-west", models=["m"])
    )
    tracker.started()
    s = RedisFleetStore(redis_url, namespace=namespace, openai_nodes=[tracker])
    try:
        await s.put_node(node("c1"))
        view = await s.view([])
        by_id = {n.id: n for n in view.nodes}
        assert by_id["vllm"].kind == NodeKind.OPENAI and by_id["vllm"].running == 1
        assert "c1" in by_id
    finally:
        await s.close()


async def test_outage_serves_last_view_then_recovers(store: RedisFleetStore, redis_server):
    await store.put_node(node("c1", ttl_s=30.0, running=2))
    await store.put_node(node("e1", NodeKind.EDGE, ttl_s=30.0))
    await store.record_blocks("c1", HASHES[:2], [])
    fresh = await store.view(HASHES)
    assert fresh.prefix_blocks == {"c1": 2}
    assert store.healthy and not fresh.stale

    redis_server.stop()
    try:
        t0 = time.perf_counter()
        view = await store.view(HASHES)
        elapsed = time.perf_counter() - t0
        assert view.stale is True
        assert sorted(n.id for n in view.nodes) == ["c1", "e1"]
        assert view.prefix_blocks == {}  # nothing is credited that Redis cannot confirm
        assert elapsed < 1.0
        assert store.healthy is False
        assert store.last_error and "Error" in store.last_error
        assert store.health()["healthy"] is False and store.errors_total >= 1
        with pytest.raises(FleetStoreUnavailable):
            await store.put_node(node("c2"))
        assert await store.ping() is False
    finally:
        redis_server.start()

    # Back by itself: the next view reaches Redis again (a fresh, empty one: no persistence).
    # The nodes Redis lost are kept (stale, no credit) until they re-publish: no 503 window.
    view = await store.view(HASHES)
    assert store.healthy is True and store.last_error is None
    assert view.stale is True and sorted(n.id for n in view.nodes) == ["c1", "e1"]
    assert view.prefix_blocks == {}
    # Redis came back empty: put_node says the index is gone, so the node re-sends it.
    assert await store.put_node(node("c1", running=5)) is False
    view = await store.view(HASHES)
    assert [(n.id, n.running) for n in view.nodes] == [("c1", 5), ("e1", 0)]
    assert view.stale is True  # e1 is still carried
    await store.put_node(node("e1", NodeKind.EDGE, ttl_s=30.0))
    view = await store.view(HASHES)
    assert sorted(n.id for n in view.nodes) == ["c1", "e1"] and view.stale is False
    assert store.health()["recovering"] is False


async def test_unresponsive_redis_times_out_fast():
    """A server that accepts connections and never answers: views go stale, nothing hangs."""
    conns: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    s = RedisFleetStore(
        f"redis://127.0.0.1:{port}/0",
        socket_timeout_s=0.1,
        connect_timeout_s=0.1,
        retry_interval_s=10.0,
    )
    try:
        t0 = time.perf_counter()
        view = await s.view(HASHES)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        await s.view(HASHES)  # within the retry interval: no attempt at all
        second = time.perf_counter() - t0
        assert view.stale and view.nodes == [] and not s.healthy
        assert first < 1.0
        assert second < 0.01
    finally:
        await s.close()
        for w in conns:
            w.close()
        server.close()
        await server.wait_closed()


async def test_two_gateways_share_nodes_and_the_prefix_index(redis_url: str, namespace: str):
    node_side = RedisFleetStore(redis_url, namespace=namespace)
    gw_a = RedisFleetStore(redis_url, namespace=namespace)
    gw_b = RedisFleetStore(redis_url, namespace=namespace)
    try:
        await node_side.put_node(node("c1"))
        await node_side.put_node(node("c2"))
        await node_side.record_blocks("c2", HASHES[:5], [])
        a, b = await gw_a.view(HASHES), await gw_b.view(HASHES)
        assert sorted(n.id for n in a.nodes) == sorted(n.id for n in b.nodes) == ["c1", "c2"]
        assert a.prefix_blocks == b.prefix_blocks == {"c2": 5}
    finally:
        for s in (node_side, gw_a, gw_b):
            await s.close()


async def test_rolling_upgrade_across_the_hash_tags(
    store: RedisFleetStore, raw: Redis, namespace: str
) -> None:
    """A node of a release before the hash tags (``node:<id>``, ``blocks:<id>``) is seen, with
    its prefix, by a gateway of this one; a node of this one also writes ``node:<id>``, which
    gateways of the release before read."""
    old = node("old-node")
    hashes = HASHES
    await raw.set(f"{namespace}node:old-node", old.model_dump_json(), px=5000)
    await raw.zadd(f"{namespace}nodes", {"old-node": time.time()})
    await raw.sadd(f"{namespace}blocks:old-node", *(hex_hash(h) for h in hashes[:2]))
    await store.put_node(node("new-node"))
    view = await store.view(hashes)
    assert sorted(n.id for n in view.nodes) == ["new-node", "old-node"]
    assert view.prefix_blocks == {"old-node": 2}
    legacy = await raw.get(f"{namespace}node:new-node")
    assert legacy is not None and NodeState.model_validate_json(legacy).id == "new-node"
    await store.remove_node("new-node")
    assert not await raw.exists(f"{namespace}node:new-node", f"{namespace}node:{{new-node}}")
