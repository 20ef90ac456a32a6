"""The in-flight board: rows each gateway worker has in flight per node, shared through Redis.

Each worker's :class:`routing.ledger.DispatchLedger` knows its own requests in flight; the
board lets every worker see the others' at once, so a burst spread over N workers is seen
whole by each of them (without it, only the nodes' heartbeat counts, a second late, would
show them). :class:`SharedCountsStore` adds the others' rows to every fleet view
(``FleetView.others_in_flight``), which the router counts as requests in hand beyond its own.

The board also carries, per node, how often a worker saw its prefix cache change (a first
token, a finished request): a worker whose store polls the nodes syncs a node's block feed as
soon as another worker's request changed it, as it does for its own requests, so a prompt
prefilled through one worker is credited through every other before the next poll.

Keys (under ``edgecloud:v1:``, one Redis Cluster slot by the ``{inflight}`` hash tag):
- ``{inflight}:rows``: hash ``{worker}|{node}`` -> rows that worker has in flight there.
- ``{inflight}:alive``: hash ``{worker}`` -> unix time of its last write.
- ``{inflight}:cache``: hash ``{node}`` -> cache changes seen by any worker (a counter).

Invariants:
- A worker writes only its own fields, as absolute values (never increments), from one task:
  a lost or repeated write is put right by the next, so the board never drifts.
- A worker's rows count only while its stamp is younger than ``ttl_s``; one that died stops
  counting within ``ttl_s``, and any live worker's sweep deletes its fields.
- The board never fails a request: a Redis error leaves the view without shared counts (the
  nodes' own counts still stand for the other workers' requests, as for other gateways).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from routing.fleet.state import NodeState
from routing.fleet.store import KEY_PREFIX, FleetStore, FleetView
from routing.redis_connect import RedisClient

log = logging.getLogger(__name__)

ROWS_KEY = KEY_PREFIX + "{inflight}:rows"
ALIVE_KEY = KEY_PREFIX + "{inflight}:alive"
CACHE_KEY = KEY_PREFIX + "{inflight}:cache"


def worker_id() -> str:
    """This process's name on the board: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class InFlightBoard:
    """This worker's rows per node, published; the other live workers' rows, read.

    ``rows_of(node_id)`` gives this worker's rows in flight on a node now (the ledger's
    ``rows_in_flight``); :meth:`changed` (sync, on the event loop) marks a node to publish.
    """

    def __init__(
        self,
        client: RedisClient,
        rows_of: Callable[[str], int],
        *,
        me: str | None = None,
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        sweep_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = client
        self.rows_of = rows_of
        self.me = me or worker_id()
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.sweep_s = sweep_s
        self.clock = clock
        self.errors = 0
        self.last_error: str | None = None
        self._dirty: set[str] = set()
        self._cache_changes: dict[str, int] = {}  # node -> changes not yet published
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def changed(self, node_id: str) -> None:
        """This worker's rows on ``node_id`` changed: publish them (coalesced)."""
        self._dirty.add(node_id)
        if self._wake is not None:
            self._wake.set()

    def cache_changed(self, node_id: str) -> None:
        """A request of this worker changed the node's prefix cache: tell the others."""
        self._cache_changes[node_id] = self._cache_changes.get(node_id, 0) + 1
        if self._wake is not None:
            self._wake.set()

    def start(self) -> None:
        """Publish from now on, in one background task, until :meth:`close`."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        next_sweep = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            changes, self._cache_changes = self._cache_changes, {}
            now = self.clock()
            try:
                await self._publish(dirty, now, changes)
                if now >= next_sweep:
                    next_sweep = now + self.sweep_s
                    await self._sweep(now)
            except (RedisError, OSError) as exc:
                self._dirty |= dirty  # written with the next attempt; cache changes are moot
                self._failed(exc)
                await asyncio.sleep(min(self.refresh_s, 0.5))

    async def _publish(
        self, nodes: set[str], now: float, cache: dict[str, int] | None = None
    ) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for node_id, n in (cache or {}).items():
            pipe.hincrby(CACHE_KEY, node_id, n)
        for node_id in nodes:
            rows = self.rows_of(node_id)
            field = f"{self.me}|{node_id}"
            if rows > 0:
                pipe.hset(ROWS_KEY, field, rows)
            else:
                pipe.hdel(ROWS_KEY, field)
        pipe.hset(ALIVE_KEY, self.me, repr(now))
        await pipe.execute()

    async def _sweep(self, now: float) -> None:
        """Delete the fields of workers whose stamp is older than ``ttl_s``."""
        alive = await self.redis.hgetall(ALIVE_KEY)
        dead = {_text(w) for w, t in alive.items() if now - _float(t) > self.ttl_s}
        if not dead:
            return
        fields = [f for f in await self.redis.hkeys(ROWS_KEY) if _text(f).split("|")[0] in dead]
        pipe = self.redis.pipeline(transaction=False)
        if fields:
            pipe.hdel(ROWS_KEY, *fields)
        pipe.hdel(ALIVE_KEY, *dead)
        await pipe.execute()

    async def others(self) -> dict[str, int]:
        """Rows the other live workers have in flight now, per node ({} on a Redis error)."""
        return (await self.read())[0]

    async def read(self) -> tuple[dict[str, int], dict[str, int]]:
        """(rows the other live workers have in flight per node, each node's count of cache
        changes), in one round trip; ({}, {}) on a Redis error."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(ROWS_KEY)
            pipe.hgetall(ALIVE_KEY)
            pipe.hgetall(CACHE_KEY)
            rows, alive, cache = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return {}, {}
        now = self.clock()
        live = {_text(w) for w, t in alive.items() if now - _float(t) <= self.ttl_s}
        live.discard(self.me)
        out: dict[str, int] = {}
        for key, value in rows.items():
            worker, _, node_id = _text(key).partition("|")
            if worker in live:
                out[node_id] = out.get(node_id, 0) + int(value)
        return out, {_text(k): int(v) for k, v in cache.items()}

    def _failed(self, exc: BaseException) -> None:
        if self.last_error is None:
            log.warning("in-flight board: Redis error (%s); routing on node counts meanwhile", exc)
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def health(self) -> dict[str, Any]:
        return {"worker": self.me, "errors": self.errors, "last_error": self.last_error}

    async def close(self) -> None:
        """Stop publishing and take this worker's fields off the board (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            fields = [
                f for f in await self.redis.hkeys(ROWS_KEY) if _text(f).startswith(self.me + "|")
            ]
            pipe = self.redis.pipeline(transaction=False)
            if fields:
                pipe.hdel(ROWS_KEY, *fields)
            pipe.hdel(ALIVE_KEY, self.me)
            await pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _float(value: bytes | str) -> float:
    try:
        return float(_text(value))
    except ValueError:
        return 0.0


class SharedCountsStore(FleetStore):
    """A fleet store whose views also carry the other workers' rows in flight (``board``),
    and that syncs a polled node's blocks when another worker changed its cache.

    Everything else is the inner store's: node states, the prefix index, health, start-up.
    Over a store that polls nodes the board is read first (a node another worker changed is
    synced, and the view waits for that as for its own syncs); over one that does not (Redis:
    nodes push their own blocks) both are read at once."""

    def __init__(self, inner: FleetStore, board: InFlightBoard) -> None:
        self.inner = inner
        self.board = board
        self.polls = type(inner).note_cache_changed is not FleetStore.note_cache_changed
        self._cache_seen: dict[str, int] = {}  # node -> the board's cache count last acted on
        self._own: dict[str, int] = {}  # node -> our own cache changes not yet seen back

    async def view(self, block_hashes: Sequence[int]) -> FleetView:
        if self.polls:
            others, cache = await self.board.read()
            for node_id, count in cache.items():
                seen = self._cache_seen.get(node_id)
                if seen == count:
                    continue
                self._cache_seen[node_id] = count
                if seen is None:  # the first look (start-up): nothing to catch up on
                    continue
                own = self._own.pop(node_id, 0)  # our changes: synced when we made them
                if count - seen > own:
                    self.inner.note_cache_changed(node_id)
                elif own > count - seen:
                    self._own[node_id] = own - (count - seen)
            view = await self.inner.view(block_hashes)
        else:
            view, others = await asyncio.gather(self.inner.view(block_hashes), self.board.others())
        return dataclasses.replace(view, others_in_flight=others) if others else view

    async def put_node(self, state: NodeState) -> bool:
        return await self.inner.put_node(state)

    async def remove_node(self, node_id: str) -> None:
        await self.inner.remove_node(node_id)

    async def record_blocks(
        self, node_id: str, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        await self.inner.record_blocks(node_id, stored, removed)

    async def replace_blocks(self, node_id: str, held: Sequence[int]) -> None:
        await self.inner.replace_blocks(node_id, held)

    def note_cache_changed(self, node_id: str) -> None:
        self.inner.note_cache_changed(node_id)
        if self.polls:
            self._own[node_id] = self._own.get(node_id, 0) + 1
            self.board.cache_changed(node_id)

    async def start(self) -> None:
        start = getattr(self.inner, "start", None)
        if start is not None:
            await start()
        self.board.start()

    @property
    def healthy(self) -> bool:
        return bool(getattr(self.inner, "healthy", True))

    def health(self) -> dict[str, Any]:
        inner = getattr(self.inner, "health", None)
        out = dict(inner()) if callable(inner) else {}
        out["in_flight_board"] = self.board.health()
        return out

    async def close(self) -> None:
        await self.board.close()
        await self.inner.close()
