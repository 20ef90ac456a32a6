"""A gateway's Redis load during a failover: what each call got, and when.

:func:`run_through` drives, for ``duration_s``, what a gateway does per request (a rate-limit
acquire and settle, a fleet view for a prompt's blocks) from ``workers`` concurrent clients,
and a node's once-a-second work (``put_node``, here every 0.2 s, and its block events), while
``event`` (a blocking call: the failover) runs in a thread once ``event_at_s`` has passed. The
:class:`LoadReport` counts what failed (an exception: a request that would fail) apart from
what fell back (the documented degraded mode: an in-process limit, the last view).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.ratelimit import Limits, RedisRateLimiter
from routing.fleet.redis_store import FleetStoreUnavailable, RedisFleetStore
from routing.fleet.state import NodeKind, NodeState

BLOCKS = [0x1000 + i for i in range(8)]


def node_state(node_id: str, ttl_s: float = 5.0) -> NodeState:
    return NodeState(
        id=node_id,
        kind=NodeKind.CLOUD,
        region="us-east",
        url=f"http://{node_id}:8000",
        models=["m"],
        max_context=4096,
        device="cpu",
        max_batch=8,
        ttl_s=ttl_s,
    )


@dataclass
class LoadReport:
    requests: int = 0  # acquire + view, one per simulated request
    fell_back: int = 0  # requests that a fallback served (limiter in-process or a stale view)
    failed: list[str] = field(default_factory=list)  # requests that raised or had no node
    put_failures: int = 0  # node pushes refused (the node retries on its next push)
    event_at: float = 0.0
    event_done: float = 0.0
    last_fallback: float = 0.0  # monotonic time of the last request that fell back
    prefix_credited: int = 0  # views that credited the node with its blocks

    @property
    def event_s(self) -> float:
        return self.event_done - self.event_at

    @property
    def recovered_after_s(self) -> float:
        """From the failover's start to the last request that fell back (0: none did)."""
        return max(0.0, self.last_fallback - self.event_at) if self.fell_back else 0.0

    def describe(self, what: str) -> str:
        return (
            f"{what}: {self.requests} requests, {len(self.failed)} failed, {self.fell_back} fell "
            f"back, failover took {self.event_s:.2f} s, last fallback "
            f"{self.recovered_after_s:.2f} s after it began; {self.put_failures} node pushes "
            f"refused; {self.prefix_credited} views with prefix credit"
        )


async def run_through(
    limiter: RedisRateLimiter,
    gateway_store: RedisFleetStore,
    node_store: RedisFleetStore,
    event: Callable[[], object],
    *,
    duration_s: float = 4.0,
    event_at_s: float = 1.0,
    workers: int = 8,
    node_id: str = "n1",
) -> LoadReport:
    report = LoadReport()
    state = node_state(node_id)
    await node_store.put_node(state)
    await node_store.record_blocks(node_id, BLOCKS, [])
    stop = time.monotonic() + duration_s
    limits = Limits(rpm=10_000_000, tpm=10_000_000)

    async def client(i: int) -> None:
        while time.monotonic() < stop:
            try:
                d = await limiter.acquire(f"key-{i % 4}", limits, 10)
                view = await gateway_store.view(BLOCKS)
                if d.allowed:
                    await limiter.settle(d, 5)
            except Exception as exc:  # any exception is a request that failed
                report.failed.append(f"{type(exc).__name__}: {exc}")
                continue
            report.requests += 1
            if not d.allowed:
                report.failed.append(f"refused: {d.limited_by}")
            if not any(n.id == node_id for n in view.nodes):
                report.failed.append("no node in the view (a 503)")
            if d.degraded or view.stale:
                report.fell_back += 1
                report.last_fallback = time.monotonic()
            if view.prefix_blocks.get(node_id):
                report.prefix_credited += 1
            await asyncio.sleep(0.002)

    async def node() -> None:
        while time.monotonic() < stop:
            try:
                if not await node_store.put_node(state):  # the store lost the index: re-send it
                    await node_store.replace_blocks(node_id, BLOCKS)
            except FleetStoreUnavailable:
                report.put_failures += 1
            await asyncio.sleep(0.2)

    async def failover() -> None:
        await asyncio.sleep(event_at_s)
        report.event_at = time.monotonic()
        await asyncio.to_thread(event)
        report.event_done = time.monotonic()

    await asyncio.gather(*(client(i) for i in range(workers)), node(), failover())
    return report
