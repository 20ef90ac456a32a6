"""routing.handoff: events from a producer thread reach an asyncio loop in order, all of them."""

from __future__ import annotations

import asyncio
import threading

from routing.handoff import Handoff


async def test_events_from_a_thread_arrive_in_order() -> None:
    loop = asyncio.get_running_loop()
    got: list[int] = []
    done = asyncio.Event()
    handoff = Handoff()

    def produce() -> None:
        for i in range(2000):
            handoff.put(loop, got.append, i)
        handoff.put(loop, lambda _: done.set(), None)

    threading.Thread(target=produce).start()
    await asyncio.wait_for(done.wait(), 10)
    assert got == list(range(2000))
    handoff.close()


async def test_close_delivers_what_was_put_and_a_closed_loop_is_skipped() -> None:
    loop = asyncio.get_running_loop()
    closed = asyncio.new_event_loop()
    closed.close()
    got: list[str] = []
    handoff = Handoff()
    handoff.put(closed, got.append, "lost")  # nobody listens there: dropped, relay lives on
    for word in ("a", "b", "c"):
        handoff.put(loop, got.append, word)
    await asyncio.to_thread(handoff.close)
    for _ in range(100):  # the callbacks were scheduled before close returned; let them run
        if len(got) == 3:
            break
        await asyncio.sleep(0.01)
    assert got == ["a", "b", "c"]
    assert not handoff._thread.is_alive()
