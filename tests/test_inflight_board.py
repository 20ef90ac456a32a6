"""The in-flight board (``routing.fleet.inflight``) on the session's private Redis: what one
worker's ledger holds, the others read at once; a worker whose stamp is stale stops counting
and is swept; the router counts the others' rows as requests in hand."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from routing.fleet.inflight import (
    ALIVE_KEY,
    CACHE_KEY,
    ROWS_KEY,
    InFlightBoard,
    SharedCountsStore,
)
from routing.fleet.memory_store import InProcessFleetStore
from routing.fleet.state import NodeKind, NodeState
from routing.fleet.store import FleetView
from routing.profile import RequestProfile
from routing.router import Router


async def _settle(*boards: InFlightBoard) -> None:
    for _ in range(50):  # each board's task publishes what changed, at once
        await asyncio.sleep(0.01)
        if not any(b._dirty for b in boards):
            await asyncio.sleep(0.02)
            return


def test_workers_read_each_others_rows_and_forget_the_dead(redis_url: str) -> None:
    async def main() -> None:
        client = Redis.from_url(redis_url)
        await client.delete(ROWS_KEY, ALIVE_KEY, CACHE_KEY)
        rows = {"a": {"n1": 0}, "b": {"n1": 0}}
        now = [1000.0]
        a, b = (
            InFlightBoard(client, rows[w].__getitem__, me=w, clock=lambda: now[0], fresh_s=0)
            for w in "ab"
        )
        a.start()
        b.start()
        try:
            rows["a"]["n1"] = 3
            a.changed("n1")
            rows["b"]["n1"] = 2
            b.changed("n1")
            await _settle(a, b)
            assert await a.others() == {"n1": 2}
            assert await b.others() == {"n1": 3}
            rows["a"]["n1"] = 0  # its requests finished: its field goes
            a.changed("n1")
            await _settle(a)
            assert await b.others() == {}
            rows["a"]["n1"] = 4
            a.changed("n1")
            await _settle(a)
            now[0] += 6  # b lives on (it reads), a's stamp is 6 s old
            assert await b.others() == {}  # a stopped counting
            await b._sweep(now[0])
            assert b"a|n1" not in await client.hkeys(ROWS_KEY)
            assert (await client.hkeys(ALIVE_KEY)) == [b"b"]
        finally:
            await a.close()
            await b.close()
            assert await client.hlen(ROWS_KEY) == 0
            await client.aclose()

    asyncio.run(main())


def _node() -> NodeState:
    return NodeState(
        id="n1",
        kind=NodeKind.CLOUD,
        region="local",
        url="http://n1",
        models=["m"],
        max_context=4096,
        device="cpu",
        max_batch=8,
        prefill_tokens_per_s=2000.0,
        decode_ms_per_token=20.0,
    )


def test_the_router_counts_the_other_workers_rows() -> None:
    router = Router()
    profile = RequestProfile(
        model="m",
        model_identity="m-id",
        route="chat",
        prompt_token_ids=list(range(100)),
        block_hashes=[],
        max_tokens=50,
        expected_output_tokens=50,
        stream=False,
        client_region="local",
    )
    alone = FleetView(nodes=[_node()], prefix_blocks={})
    busy = FleetView(nodes=[_node()], prefix_blocks={}, others_in_flight={"n1": 6})
    quiet = router.decide(profile, alone).estimate
    loaded = router.decide(profile, busy).estimate
    assert loaded.e2e_ms > quiet.e2e_ms


def test_a_shared_counts_store_adds_the_board_to_every_view(redis_url: str) -> None:
    async def main() -> None:
        client = Redis.from_url(redis_url)
        await client.delete(ROWS_KEY, ALIVE_KEY, CACHE_KEY)
        other = InFlightBoard(client, {"n1": 5}.__getitem__, me="other", fresh_s=0)
        other.changed("n1")
        assert await other.read() == ({}, {})  # carries its rows; nobody else there yet
        inner = InProcessFleetStore()
        await inner.put_node(_node())
        store = SharedCountsStore(inner, InFlightBoard(client, lambda _: 0, me="me", fresh_s=0))
        view = await store.view([])
        assert [n.id for n in view.nodes] == ["n1"] and dict(view.others_in_flight) == {"n1": 5}
        assert store.health()["in_flight_board"]["errors"] == 0
        await store.close()
        await other.close()
        await client.aclose()

    asyncio.run(main())
