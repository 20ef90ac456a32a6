"""Fair share (issue 49, item 1): the rule, the in-process counts, the queue, and the Redis
script deciding exactly as the Python rule does. No node; counts and order only."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from gateway.errors import APIError
from gateway.fair_config import FairShareConfig
from gateway.fair_counts import Answer, InProcessFairCounts
from gateway.fair_queue import FairQueue
from gateway.fair_share import KeyCount, Snapshot, Tenant, Verdict, key_shares, verdict, water_fill

A, B = Tenant("attacker"), Tenant("victim")


def test_water_fill_is_max_min_fair() -> None:
    out = water_fill({"a": (1.0, 40.0), "b": (1.0, 1.0)}, 8)
    assert out == {"a": 7.0, "b": 1.0}
    out = water_fill({"a": (3.0, 40.0), "b": (1.0, 40.0)}, 8)
    assert out == {"a": 6.0, "b": 2.0}
    assert sum(water_fill({"a": (1, 5), "b": (2, 5), "c": (1, 1)}, 7).values()) <= 7 + 1e-9


def test_verdict_limits_fleet_and_share() -> None:
    snap = Snapshot({"attacker": KeyCount(held=8)})
    assert verdict(snap, B, 8) is Verdict.FLEET  # no free slot
    snap = Snapshot({"attacker": KeyCount(held=7, waiting=30), "victim": KeyCount(waiting=1)})
    assert verdict(snap, A, 8, registered=True) is Verdict.FLEET  # over its share of 7
    assert verdict(snap, B, 8, registered=True) is Verdict.ADMIT
    alone = Snapshot({"attacker": KeyCount(held=7)})
    assert verdict(alone, A, 8) is Verdict.ADMIT  # nobody else waits: work-conserving
    capped = Tenant("attacker", max_concurrent=2)
    assert verdict(Snapshot({"attacker": KeyCount(held=2)}), capped, 8) is Verdict.OWN_LIMIT
    t1 = Tenant("k1", team="red", team_max_concurrent=3)
    team = Snapshot({"k2": KeyCount(held=3, team="red")})
    assert verdict(team, t1, 8) is Verdict.OWN_LIMIT


def _queue(slots: int, **cfg: float) -> FairQueue:
    return FairQueue(InProcessFairCounts(), FairShareConfig(fleet_slots=slots, **cfg))


def test_queue_admits_victim_before_attackers_queued_requests() -> None:
    async def run() -> list[str]:
        q = _queue(4, poll_s=0.01)
        held = [await q.acquire(A) for _ in range(4)]
        order: list[str] = []

        async def one(t: Tenant) -> None:
            adm = await q.acquire(t)
            order.append(t.key)
            await asyncio.sleep(0.05)
            adm.release()

        tasks = [asyncio.create_task(one(A)) for _ in range(6)]
        await asyncio.sleep(0.02)
        tasks.append(asyncio.create_task(one(B)))
        await asyncio.sleep(0.02)
        held.pop().release()  # the first slot freed goes to the victim
        await asyncio.gather(*tasks)
        for adm in held:
            adm.release()
        assert q.counts.snap.keys == {}  # every slot and mark given back
        return order

    order = asyncio.run(run())
    assert order[0] == "victim"
    assert order.count("attacker") == 6


def test_queue_priority_within_a_key_and_limits() -> None:
    async def run() -> list[int]:
        q = _queue(1, poll_s=0.01)
        first = await q.acquire(A)
        got: list[int] = []

        async def one(p: int) -> None:
            adm = await q.acquire(A, p)
            got.append(p)
            adm.release()

        tasks = []
        for p in (0, 5, 1, 5):
            tasks.append(asyncio.create_task(one(p)))
            await asyncio.sleep(0.005)
        first.release()
        await asyncio.gather(*tasks)
        return got

    assert asyncio.run(run()) == [5, 5, 1, 0]


def test_queue_timeout_full_and_cancel_leave_nothing_behind() -> None:
    async def run() -> None:
        q = _queue(1, poll_s=0.01, queue_timeout_s=0.05, max_queued_per_key=1)
        held = await q.acquire(A)
        with pytest.raises(APIError) as exc:
            await q.acquire(B)  # waits, then times out
        assert exc.value.status == 429 and q.timeouts_total == 1
        waiter = asyncio.create_task(q.acquire(B))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError):  # one already waits for this key
            await q.acquire(B)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        held.release()
        assert q.counts.snap.keys == {} and q.waiting() == 0

    asyncio.run(run())


class _Checked(InProcessFairCounts):
    """In-process counts that check, at the instant of each admission, that the admitted key
    is within its share whenever another key waits."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots = slots
        self.checked = 0

    def decide(self, t: Tenant, capacity: int, registered: bool, peek: bool = False) -> Answer:
        ans = super().decide(t, capacity, registered, peek)
        snap = self.snap
        assert snap.total_held <= self.slots
        others_wait = any(c.waiting for k, c in snap.keys.items() if k != t.key)
        if ans.verdict is Verdict.ADMIT and not peek and others_wait:
            share = key_shares(snap, capacity)[t.key]
            assert snap.keys[t.key].held <= math.ceil(share - 1e-9)
            self.checked += 1
        return ans


def test_held_to_share_under_a_random_load() -> None:
    """Keys of weights 1, 1, 2 keep the fleet full: while another waits, none takes a slot
    that puts it over its share (rounded up), and the fleet never holds more than its slots."""
    keys = [Tenant("a"), Tenant("b"), Tenant("c", weight=2.0)]
    rnd = random.Random(7)
    counts = _Checked(8)

    async def run() -> None:
        q = FairQueue(counts, FairShareConfig(fleet_slots=8, poll_s=0.005))

        async def worker(t: Tenant) -> None:
            for _ in range(15):
                adm = await q.acquire(t)
                await asyncio.sleep(rnd.random() * 0.01)
                adm.release()

        await asyncio.gather(*(worker(t) for t in keys for _ in range(6)))

    asyncio.run(run())
    assert counts.snap.keys == {}
    assert counts.checked > 50  # the fleet was contended most of the time


def test_redis_script_decides_as_the_rule(redis_url: str) -> None:
    """The Lua water-filling and verdict agree with the Python rule on random states, and
    release and leave undo acquire."""
    import redis.asyncio as aredis

    from gateway.fair_redis import RedisFairCounts

    rnd = random.Random(3)

    async def run() -> None:
        client = aredis.Redis.from_url(redis_url, decode_responses=True)
        await client.delete(
            *[f"edgecloud:v1:{{fair}}:{n}" for n in ("held", "wait", "meta", "alive")]
        )
        remote = RedisFairCounts(client, gateway_id="g1")
        local = InProcessFairCounts()
        tenants = [
            Tenant("a"),
            Tenant("b", weight=3.0),
            Tenant("c", max_concurrent=2),
            Tenant("d", team="red", team_weight=2.0, team_max_concurrent=3),
            Tenant("e", weight=2.0, team="red", team_weight=2.0, team_max_concurrent=3),
        ]  # fmt: skip  (a team's terms are the same for its keys: auth.teams)
        registered: dict[str, int] = {t.key: 0 for t in tenants}
        held: dict[str, list] = {t.key: [] for t in tenants}
        for _ in range(300):
            t = rnd.choice(tenants)
            if held[t.key] and rnd.random() < 0.35:
                r, loc = held[t.key].pop()
                remote.release(t, r)
                local.release(t, loc)
                await asyncio.sleep(0)
                await asyncio.gather(*remote._tasks)
                continue
            reg = registered[t.key] > 0 and rnd.random() < 0.5
            r = await remote.try_acquire(t, 6, reg)
            loc = local.decide(t, 6, reg)
            assert (r.verdict, r.waiting, r.allowed) == (loc.verdict, loc.waiting, loc.allowed)
            if r.verdict is Verdict.ADMIT:
                held[t.key].append((r, loc))
            registered[t.key] += (r.verdict is Verdict.FLEET and not reg) - (
                reg and r.verdict is not Verdict.FLEET
            )
        await remote.close()
        await client.aclose()

    asyncio.run(run())
