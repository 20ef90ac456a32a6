"""routing.token_stream.relay_events: the loop both engines' generate() share."""

from __future__ import annotations

import asyncio
import contextlib

from routing.engine import FinishReason, TokenEvent
from routing.token_stream import relay_events


def _ev(ids: list[int], finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent("r", ids, len(ids), 3, finish_reason=finish)


async def test_yields_until_the_finishing_event_and_never_abandons() -> None:
    q: asyncio.Queue[TokenEvent] = asyncio.Queue()
    for ev in (_ev([1]), _ev([2]), _ev([3], FinishReason.STOP), _ev([4])):
        q.put_nowait(ev)
    calls: list[str] = []
    got = [
        e.token_ids
        async for e in relay_events(
            q, lambda: calls.append("abandon"), lambda: calls.append("exit")
        )
    ]
    assert got == [[1], [2], [3]]
    assert calls == ["exit"]


async def test_leaving_early_abandons_once_after_exit() -> None:
    q: asyncio.Queue[TokenEvent] = asyncio.Queue()
    q.put_nowait(_ev([1]))
    calls: list[str] = []
    events = relay_events(q, lambda: calls.append("abandon"), lambda: calls.append("exit"))
    async with contextlib.aclosing(events):
        async for _ in events:
            break
    assert calls == ["exit", "abandon"]


async def test_a_cancelled_consumer_abandons() -> None:
    q: asyncio.Queue[TokenEvent] = asyncio.Queue()
    calls: list[str] = []

    async def consume() -> None:
        async for _ in relay_events(q, lambda: calls.append("abandon")):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.01)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert calls == ["abandon"]
