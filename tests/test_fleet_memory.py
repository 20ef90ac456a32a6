"""InProcessFleetStore (polling through an injected fetch), PrefixIndex, OpenAINodeTracker."""

from __future__ import annotations

import asyncio
import time

import pytest

from routing.fleet.block_feed import BlockFeedPage
from routing.fleet.memory_store import (
    InProcessFleetStore,
    OpenAINodeConfig,
    OpenAINodeTracker,
    PrefixIndex,
)
from routing.fleet.state import NodeKind, NodeState


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def state(node_id: str, **kw) -> NodeState:
    return NodeState(
        id=node_id,
        kind=kw.pop("kind", NodeKind.EDGE),
        region="eu-west",
        url=f"http://{node_id}",
        models=["m"],
        max_context=2048,
        device="cpu",
        max_batch=4,
        timestamp=kw.pop("timestamp", 1.0),  # a node clock far in the past: must not matter
        **kw,
    )


def test_prefix_index_leading_and_lru_bound():
    idx = PrefixIndex(max_blocks_per_node=4)
    idx.add("a", [1, 2, 3])
    assert idx.leading("a", [1, 2, 3, 4]) == 3
    assert idx.leading("a", [2, 3]) == 2
    assert idx.leading("a", [9, 1, 2]) == 0
    assert idx.leading("b", [1]) == 0
    idx.add("a", [1])  # touch 1: now 2 is the least recently used
    idx.add("a", [7, 8])
    assert idx.size("a") == 4
    assert idx.leading("a", [1]) == 1 and idx.leading("a", [2]) == 0
    idx.remove("a", [1])
    assert idx.leading("a", [1, 3]) == 0


async def test_polls_nodes_stamps_receipt_time_and_goes_stale():
    clock = Clock()
    answers = {"http://e1": state("e1", running=2), "http://c1": state("c1", kind=NodeKind.CLOUD)}
    failing: set[str] = set()
    calls: list[str] = []

    async def fetch(url: str) -> NodeState:
        calls.append(url)
        if url in failing:
            raise ConnectionError("refused")
        return answers[url]

    store = InProcessFleetStore(
        list(answers), fetch_state=fetch, poll_interval_s=1.0, stale_after_s=3.0, clock=clock
    )
    assert await store.poll_once() == 2
    view = await store.view([])
    assert sorted(n.id for n in view.nodes) == ["c1", "e1"]
    assert all(n.timestamp == 1000.0 for n in view.nodes)
    assert next(n for n in view.nodes if n.id == "e1").running == 2

    failing.add("http://c1")
    clock.t += 2.0
    assert await store.poll_once() == 1
    assert "http://c1" in store.poll_errors and "refused" in store.poll_errors["http://c1"]
    assert sorted(n.id for n in (await store.view([])).nodes) == ["c1", "e1"]  # still fresh
    clock.t += 2.0
    assert await store.poll_once() == 1
    assert [n.id for n in (await store.view([])).nodes] == ["e1"]  # c1's last state expired

    failing.clear()
    await store.poll_once()
    assert store.poll_errors == {}
    assert len((await store.view([])).nodes) == 2


async def test_slow_fetch_times_out_and_background_polling_runs():
    seen = asyncio.Event()

    async def fetch(url: str) -> NodeState:
        if url == "http://slow":
            await asyncio.sleep(10)
        seen.set()
        return state("fast")

    store = InProcessFleetStore(
        ["http://slow", "http://fast"],
        fetch_state=fetch,
        poll_interval_s=0.02,
        fetch_timeout_s=0.05,
    )
    try:
        await asyncio.wait_for(store.start(), 1.0)
        assert "http://slow" in store.poll_errors
        assert [n.id for n in (await store.view([])).nodes] == ["fast"]
        seen.clear()
        await asyncio.wait_for(seen.wait(), 1.0)  # the loop polls again by itself
    finally:
        await store.close()
    assert store._task is None


def test_polling_urls_needs_a_fetch_callable():
    with pytest.raises(ValueError, match="fetch_state"):
        InProcessFleetStore(["http://x"])


async def test_index_holds_only_what_nodes_report():
    store = InProcessFleetStore()
    await store.put_node(state("e1", timestamp=time.time()))
    await store.put_node(state("c1", kind=NodeKind.CLOUD, timestamp=time.time()))
    assert (await store.view([11, 12, 13])).prefix_blocks == {}  # routing alone credits nobody

    await store.record_blocks("c1", [11, 13], [])
    assert (await store.view([11, 12, 13])).prefix_blocks == {"c1": 1}  # leading run only
    await store.record_blocks("c1", [12], [11])
    assert (await store.view([11, 12])).prefix_blocks == {}
    await store.replace_blocks("c1", [11, 12])
    assert (await store.view([11, 12, 13])).prefix_blocks == {"c1": 2}

    await store.remove_node("e1")
    assert [n.id for n in (await store.view([])).nodes] == ["c1"]


async def test_block_feed_pages_are_polled_and_synced_after_a_request():
    """The store follows a node's feed by cursor: a full page first, then deltas; a finished
    request triggers a sync that the next view waits for."""
    pages: list[tuple[str | None, int]] = []
    feed = {"epoch": "a", "seq": 0, "held": {1, 2}}

    async def fetch_state(url: str) -> NodeState:
        return state("c1", kind=NodeKind.CLOUD, prefix_cache=True, timestamp=time.time())

    async def fetch_blocks(url: str, epoch: str | None, seq: int) -> BlockFeedPage:
        pages.append((epoch, seq))
        if epoch != feed["epoch"]:
            return BlockFeedPage(feed["epoch"], feed["seq"], True, sorted(feed["held"]), [])
        return BlockFeedPage(feed["epoch"], feed["seq"], False, [3], [1])

    store = InProcessFleetStore(
        ["http://c1"], fetch_state=fetch_state, fetch_blocks=fetch_blocks, poll_interval_s=60
    )
    await store.start()
    try:
        assert pages == [(None, 0)]
        assert (await store.view([1, 2])).prefix_blocks == {"c1": 2}
        feed["seq"] = 5
        store.note_cache_changed("c1")
        assert (await store.view([2, 3])).prefix_blocks == {"c1": 2}  # waited for the sync
        assert pages == [(None, 0), ("a", 0)]
        assert (await store.view([1])).prefix_blocks == {}
        feed["epoch"] = "b"  # the node restarted: the next page is full again
        store.note_cache_changed("c1")
        assert (await store.view([1, 2])).prefix_blocks == {"c1": 2}
        assert pages[-1] == ("a", 5)
    finally:
        await store.close()


def test_openai_tracker_synthesizes_state_from_inflight_and_latency():
    clock = Clock(50.0)
    cfg = OpenAINodeConfig(
        id="hosted",
        url="https://api",
        region="us-west",
        models=["m"],
        max_concurrency=2,
        decode_ms_per_token=30.0,
    )
    t = OpenAINodeTracker(cfg, alpha=0.5, clock=clock)
    s = t.state()
    assert (s.kind, s.running, s.waiting, s.decode_ms_per_token) == (NodeKind.OPENAI, 0, 0, 30.0)
    assert s.prefill_tokens_per_s == 0.0 and s.timestamp == 50.0 and s.is_fresh(50.0)

    for _ in range(3):
        t.started()
    s = t.state()
    assert (s.running, s.waiting) == (2, 1)

    # 100 prompt tokens, first token after 200 ms, 11 tokens by 700 ms: 50 ms/token.
    t.finished(ttft_ms=200.0, e2e_ms=700.0, prompt_tokens=100, completion_tokens=11)
    s = t.state()
    assert s.running == 2 and s.waiting == 0
    assert s.decode_ms_per_token == pytest.approx(50.0)
    assert s.prefill_tokens_per_s == pytest.approx(500.0)
    t.finished(ttft_ms=200.0, e2e_ms=300.0, prompt_tokens=100, completion_tokens=11)  # 10 ms/token
    assert t.state().decode_ms_per_token == pytest.approx(30.0)  # EWMA, alpha 0.5
    t.finished(ok=False)
    assert t.in_flight == 0 and t.failed == 1 and t.completed == 2
