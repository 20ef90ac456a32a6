"""Noticing that a client left while its request is being answered (before the reply starts).

A request's body has been read; until the gateway starts its reply, nothing reads from the
client, so nothing would notice that it left: a reply sent whole would keep its node busy to
the end (41 s of generation for nobody, in the red-team run), a request waiting in a node's
queue would still run. :func:`cancel_on_disconnect` watches ``receive`` in one task and
cancels the work when the client leaves; the upstream connection is then closed (the node
cancels the request, queued or running) and the caller gets :class:`ClientGone`.

Invariant: a cancellation that is this watcher's own never escapes as ``CancelledError``
(it becomes ``ClientGone``, also when the disconnect came just as the work finished);
any other cancellation propagates unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.types import Receive


class ClientGone(Exception):
    """The client disconnected before its reply started."""


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    task = asyncio.current_task()
    assert task is not None
    fired = False

    async def watch() -> None:
        nonlocal fired
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                fired = True
                task.cancel()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not fired:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()
    if fired:  # it left as the work finished: our cancellation is still on its way
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            task.uncancel()
        raise ClientGone
