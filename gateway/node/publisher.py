"""Pushes a node's NodeState (every second, with a TTL) and its block events to the fleet store.

Invariants: a failing store never affects serving (errors are counted and logged once per
outage); on stop the node removes itself, so gateways stop routing to it at once. Block events
come from the node's one :class:`routing.fleet.block_feed.BlockFeed`, read with this
publisher's own cursor; when the store says it no longer holds the node's index (Redis restarted
empty), the next push re-sends the whole index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from routing.fleet.block_feed import BlockFeed
from routing.fleet.store import FleetStore

if TYPE_CHECKING:
    from gateway.node.service import NodeService

log = logging.getLogger(__name__)


class StatePublisher:
    def __init__(
        self,
        service: NodeService,
        store: FleetStore,
        feed: BlockFeed | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.service = service
        self.store = store
        self.feed = feed
        self.interval_s = interval_s
        self._cursor: tuple[str | None, int] = (None, 0)  # where this publisher is in the feed
        self.full_pushes = 0
        self._task: asyncio.Task[None] | None = None
        self.errors = 0
        self.last_error: str | None = None
        self.last_push: float | None = None

    async def start(self) -> None:
        # a restarted node holds no blocks: forget the index a previous run left behind
        try:
            await self.store.remove_node(self.service.config.node_id)
        except Exception as exc:
            log.warning("fleet store unreachable at start-up: %s", exc)
        await self.push_once()
        self._task = asyncio.create_task(self._loop())

    async def push_once(self) -> None:
        try:
            node_id = self.service.config.node_id
            holds_index = await self.store.put_node(self.service.node_state())
            if self.feed is not None:
                if not holds_index:
                    self._cursor = (None, 0)  # the store lost our index: send all of it
                page = self.feed.since(*self._cursor)
                if page.full:
                    await self.store.replace_blocks(node_id, page.stored)
                    self.full_pushes += 1
                elif page.stored or page.removed:
                    await self.store.record_blocks(node_id, page.stored, page.removed)
                self._cursor = (page.epoch, page.seq)
            if self.last_error is not None:
                log.info("fleet store reachable again")
            self.last_error = None
            self.last_push = time.time()
        except Exception as exc:  # the store must never take the node down
            self.errors += 1
            if self.last_error is None:
                log.warning("fleet store push failed: %s", exc)
            self.last_error = str(exc)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.push_once()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.store.remove_node(self.service.config.node_id)
        except Exception as exc:
            log.warning("could not deregister from the fleet store: %s", exc)
        await self.store.close()

    def status(self) -> dict[str, Any]:
        return {
            "ok": self.last_error is None,
            "errors": self.errors,
            "last_error": self.last_error,
            "last_push": self.last_push,
            "full_index_pushes": self.full_pushes,
        }
