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
- A worker writes only its own fields, as absolute values (never increments), one exchange
  at a time: a lost or repeated write is put right by the next, so the board never drifts.
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
import math
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


# One round trip per exchange: write this worker's changed rows (0 deletes the field), its
# stamp and its cache changes; return the other live workers' rows summed per node, and every
# node's cache count. KEYS: rows, alive, cache. ARGV: me, now, ttl, n, n (node, rows) pairs,
# then (node, cache changes) pairs.
EXCHANGE_SCRIPT = """
local me, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('HSET', KEYS[2], me, ARGV[2])
local i = 5
for _ = 1, tonumber(ARGV[4]) do
  local field = me .. '|' .. ARGV[i]
  if tonumber(ARGV[i + 1]) > 0 then
    redis.call('HSET', KEYS[1], field, ARGV[i + 1])
  else
    redis.call('HDEL', KEYS[1], field)
  end
  i = i + 2
end
while i < #ARGV do
  redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1])
  i = i + 2
end
local alive, live = redis.call('HGETALL', KEYS[2]), {}
for j = 1, #alive, 2 do
  if alive[j] ~= me and now - tonumber(alive[j + 1]) <= ttl then live[alive[j]] = true end
end
local rows, sums, order = redis.call('HGETALL', KEYS[1]), {}, {}
for j = 1, #rows, 2 do
  local bar = string.find(rows[j], '|', 1, true)
  if bar and live[string.sub(rows[j], 1, bar - 1)] then
    local node = string.sub(rows[j], bar + 1)
    if sums[node] == nil then
      sums[node] = 0
      order[#order + 1] = node
    end
    sums[node] = sums[node] + tonumber(rows[j + 1])
  end
end
local out = {}
for _, node in ipairs(order) do
  out[#out + 1] = node
  out[#out + 1] = sums[node]
end
return {out, redis.call('HGETALL', KEYS[3])}
"""


class InFlightBoard:
    """This worker's rows per node, published; the other live workers' rows, read.

    ``rows_of(node_id)`` gives this worker's rows in flight on a node now (the ledger's
    ``rows_in_flight``); :meth:`changed` and :meth:`cache_changed` (sync, on the event loop)
    mark what to publish. A :meth:`read` (one per fleet view) is one script call that also
    carries what changed since the last one; reads within ``fresh_s`` of the last one, or
    while one is under way, share its answer (under load, one call serves many requests);
    what no read carries within ``flush_s`` the background task sends, and it renews the
    stamp every ``refresh_s``. So another worker sees a change within about
    ``flush_s + fresh_s``.
    """

    def __init__(
        self,
        client: RedisClient,
        rows_of: Callable[[str], int],
        *,
        me: str | None = None,
        ttl_s: float = 5.0,
        refresh_s: float = 1.0,
        flush_s: float = 0.02,
        fresh_s: float = 0.002,
        sweep_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = client
        self.rows_of = rows_of
        self.me = me or worker_id()
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.flush_s = flush_s
        self.fresh_s = fresh_s
        self.sweep_s = sweep_s
        self.clock = clock
        self.errors = 0
        self.last_error: str | None = None
        self._script = client.register_script(EXCHANGE_SCRIPT)
        self._dirty: set[str] = set()
        self._cache_changes: dict[str, int] = {}  # node -> changes not yet published
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._stamped = 0.0  # when our stamp was last written (by any exchange)
        self._last: tuple[dict[str, int], dict[str, int]] = ({}, {})  # the last read's answer
        self._last_at = -math.inf  # when it was asked (clock seconds)
        self._reading: asyncio.Future[tuple[dict[str, int], dict[str, int]]] | None = None

    def changed(self, node_id: str) -> None:
        """This worker's rows on ``node_id`` changed: publish them (coalesced)."""
        self._dirty.add(node_id)
        self._schedule_flush()

    def cache_changed(self, node_id: str) -> None:
        """A request of this worker changed the node's prefix cache: tell the others."""
        self._cache_changes[node_id] = self._cache_changes.get(node_id, 0) + 1
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush is None and self._loop is not None:
            self._flush = self._loop.call_later(self.flush_s, self._flush_now)

    def _flush_now(self) -> None:
        """Send what no read has carried since it changed (a timer's callback)."""
        self._flush = None
        if not (self._dirty or self._cache_changes):
            return
        if self._reading is None:
            self._shared_read(self.clock())
        else:  # the read under way was sent before these changes
            self._schedule_flush()

    def start(self) -> None:
        """Publish from now on (changes within ``flush_s``, the stamp every ``refresh_s``)
        until :meth:`close`."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        next_sweep = 0.0
        while True:
            await asyncio.sleep(self.refresh_s / 2)
            now = self.clock()
            try:
                if now - self._stamped >= self.refresh_s / 2:
                    await asyncio.shield(self._shared_read(now))
                if now >= next_sweep:
                    next_sweep = now + self.sweep_s
                    await self._sweep(now)
            except (RedisError, OSError) as exc:
                self._failed(exc)

    async def _exchange(self, now: float) -> tuple[dict[str, int], dict[str, int]]:
        """Send what changed, read the others (raises on a Redis error, keeping the rows to
        send again; cache changes lost then are moot: the next poll brings their blocks)."""
        dirty, self._dirty = self._dirty, set()
        changes, self._cache_changes = self._cache_changes, {}
        args: list[str | int | float] = [self.me, repr(now), self.ttl_s, len(dirty)]
        for node_id in dirty:
            args += [node_id, self.rows_of(node_id)]
        for node_id, n in changes.items():
            args += [node_id, n]
        try:
            rows, cache = await self._script(keys=[ROWS_KEY, ALIVE_KEY, CACHE_KEY], args=args)
        except BaseException:
            self._dirty |= dirty
            raise
        self._stamped = now
        others = {_text(rows[j]): int(rows[j + 1]) for j in range(0, len(rows), 2)}
        counts = {_text(cache[j]): int(cache[j + 1]) for j in range(0, len(cache), 2)}
        return others, counts

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
        changes), carrying this worker's changes; shared with the reads around it (see the
        class); ({}, {}) on a Redis error."""
        now = self.clock()
        if now - self._last_at < self.fresh_s:
            return self._last
        return await asyncio.shield(self._shared_read(now))

    def _shared_read(self, now: float) -> asyncio.Future[tuple[dict[str, int], dict[str, int]]]:
        """The exchange under way, or a new one: never two at once."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_once(now))
        return self._reading

    async def _read_once(self, now: float) -> tuple[dict[str, int], dict[str, int]]:
        try:
            self._last = await self._exchange(now)
            self._last_at = now
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return {}, {}
        finally:
            self._reading = None
        return self._last

    def _failed(self, exc: BaseException) -> None:
        if self.last_error is None:
            log.warning("in-flight board: Redis error (%s); routing on node counts meanwhile", exc)
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def health(self) -> dict[str, Any]:
        return {"worker": self.me, "errors": self.errors, "last_error": self.last_error}

    async def close(self) -> None:
        """Stop publishing and take this worker's fields off the board (best effort)."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        self._loop = None
        if self._reading is not None:
            with contextlib.suppress(Exception):
                await self._reading
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            mine = self.me + "|"
            fields = [f for f in await self.redis.hkeys(ROWS_KEY) if _text(f).startswith(mine)]
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
        self._caching: set[str] = set()  # nodes that keep a prefix cache, as last viewed

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
            self._caching = {n.id for n in view.nodes if n.prefix_cache}
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
        if self.polls and node_id in self._caching:  # a node without a cache has no news
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
