"""The token-event loop both engines' ``generate()`` share.

An engine hands a request's :class:`routing.engine.TokenEvent` s to the consumer's event loop
through an ``asyncio.Queue``; :func:`relay_events` yields them until the one that finishes the
request.

Invariant: when the consumer leaves before that event (``aclose``, its task cancelled, the
client gone), ``on_abandon`` runs exactly once, after the loop (so the engine frees the
request's slot or blocks); it never runs for a request that finished. ``on_exit`` runs last,
on every path (the engine forgets the request's stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from routing.engine import TokenEvent


async def relay_events(
    queue: asyncio.Queue[TokenEvent],
    on_abandon: Callable[[], object],
    on_exit: Callable[[], object] | None = None,
) -> AsyncIterator[TokenEvent]:
    finished = False
    try:
        while True:
            ev = await queue.get()
            finished = ev.finished
            yield ev
            if finished:
                return
    finally:
        try:
            if on_exit is not None:
                on_exit()
        finally:
            if not finished:
                on_abandon()
