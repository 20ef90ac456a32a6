"""The Redis fleet store: many gateways share node states and the precise prefix index.

Key layout: see :mod:`routing.fleet.store` (everything under ``namespace``, default
``edgecloud:v1:``; a node's keys share its hash tag). Block hashes are stored as 16-digit
lowercase hex.

Invariants:
- ``view`` returns every node whose state key has not expired (TTL = the state's ``ttl_s``)
  and the number of *leading* request blocks in the node's block set, read as
  :mod:`routing.fleet.redis_view` says: on one server (or Sentinel's primary) exactly one round
  trip (EVALSHA of one registered Lua script; a script cache miss after a restart or failover
  costs one extra SCRIPT LOAD, once); on a Redis Cluster one pipeline of single-key commands
  sent to every primary at once, the node list refreshed at most every ``members_refresh_s``.
- Nothing hangs: short socket timeouts, no client-side retries. While Redis is unreachable,
  ``view`` answers at once from the last good view (``stale=True``), retrying Redis at most
  every ``retry_interval_s``; the first success makes the store ``healthy`` again.
- A node is credited only with blocks it reported holding (its ``blocks:{id}`` set, fed by its
  block events): a node that keeps no prefix cache has no set and is never credited, and a
  stale view (Redis unreachable) credits nobody.
- ``put_node`` tells the node whether the store still holds its prefix index (the
  ``events:{id}`` stream exists): after Redis restarts empty, the node re-sends its whole index
  with ``replace_blocks``.
- The fleet has an *epoch* (``epoch``: a random id the first ``put_node`` into an empty Redis
  creates, SET NX). A view that finds the epoch changed or gone (Redis restarted empty), or the
  first view after an outage (nodes could not publish meanwhile), starts a *recovery*: nodes of
  the last good view missing from Redis are kept in the view, without prefix credit and with
  ``stale=True``, until they re-publish or their last state's TTL passes (counted from when this
  gateway first saw that state; after an outage, from the recovery). So a Redis restart is no
  503 window. Outside a recovery a node missing from Redis is gone at once (a node that stops
  removes itself, and gateways stop routing to it).
- Writes (``put_node``, ``record_blocks``, ``remove_node``) are one pipelined round trip each
  (on a cluster, one per primary they touch, in parallel; a node's own keys are in one slot)
  and raise :class:`FleetStoreUnavailable` when Redis is down. On one server a node's state is
  also written under its key of releases before the hash tags, for their gateways.
- The NodeState objects a view returns are shared with later views until the node pushes a
  new state: callers must not mutate them.
- A failover (Sentinel or Cluster) is an outage as short as the failover: the calls it fails
  fall back as above, and the next view after ``retry_interval_s`` reaches the new primary.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from routing.fleet.memory_store import OpenAINodeTracker
from routing.fleet.redis_view import ClusterViewReader, FleetKeys, ScriptViewReader, ViewReader
from routing.fleet.signing import CLOCK_SKEW_S, RecordSigner, unsigned_payload, url_allowed
from routing.fleet.state import NodeState
from routing.fleet.store import KEY_PREFIX, FleetStore, FleetView
from routing.redis_connect import RedisClient, is_cluster
from routing.redis_link import REDIS_ERRORS, OverRedisLink, RedisLink, redis_client

log = logging.getLogger(__name__)


class FleetStoreUnavailable(ConnectionError):
    """The fleet store could not be reached (a write failed)."""


def hex_hash(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


class _Rejected(Exception):
    """A node record this gateway does not trust (the message says why)."""


class RedisFleetStore(OverRedisLink, FleetStore):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = KEY_PREFIX,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        prune_after_s: float = 60.0,
        index_ttl_s: float = 600.0,
        events_maxlen: int = 1000,
        openai_nodes: Sequence[OpenAINodeTracker] = (),
        client: RedisClient | None = None,
        members_refresh_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        signer: RecordSigner | None = None,
        allowed_urls: Sequence[str] = (),
    ) -> None:
        self.ns = namespace
        # with a signer: node states are written signed, and only signed ones are read
        # (routing.fleet.signing); ``allowed_urls``: shell patterns a node's URL must match
        self.signer = signer
        self.allowed_urls = tuple(allowed_urls)
        self.rejected_total = 0  # node records ignored (unsigned, forged, stale, not allowed)
        self._rejected: dict[str, str] = {}  # raw record -> why, for the last view's rows
        self.keys = FleetKeys(namespace)
        self.retry_interval_s = retry_interval_s
        self.prune_after_s = prune_after_s
        self.index_ttl_ms = int(index_ttl_s * 1000)
        self.events_maxlen = events_maxlen
        self.openai_nodes = {t.id: t for t in openai_nodes}
        self.clock = clock
        self.redis: RedisClient = client or redis_client(
            url, timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s
        )
        self.cluster = is_cluster(self.redis)
        self.link = RedisLink(
            self.redis,
            what="fleet store",
            fallback="serving the last view",
            retry_interval_s=retry_interval_s,
            clock=clock,
        )
        self._reader: ViewReader = (
            ClusterViewReader(self.redis, self.keys, members_refresh_s=members_refresh_s)
            if self.cluster
            else ScriptViewReader(self.redis, self.keys)
        )
        self._last_nodes: list[NodeState] = []
        # raw JSON -> (state, when this gateway first saw it), for the last view's nodes
        self._parsed: dict[str, tuple[NodeState, float]] = {}
        # node id -> (its last state from Redis, trusted until): what a recovery may keep
        self._seen: dict[str, tuple[NodeState, float]] = {}
        self._epoch: str | None = None  # the fleet epoch of the last good view
        self._recovering = False
        self._outage = False  # a view failed since the last good one
        self.views_total = 0
        self.stale_views_total = 0
        self.carried_views_total = 0  # views that kept nodes Redis had lost (recoveries)
        # good views after an outage, or that found the fleet's epoch changed (Redis restarted
        # empty): each began a recovery, whether or not a node was still to re-publish then
        self.recoveries_total = 0

    # ---- health ------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """For ``/health`` and metrics."""
        return {
            **self.link.health(),
            "views_total": self.views_total,
            "stale_views_total": self.stale_views_total,
            "recovering": self._recovering,
            "carried_views_total": self.carried_views_total,
            "recoveries_total": self.recoveries_total,
            "rejected_records_total": self.rejected_total,
        }

    # ---- writes ------------------------------------------------------------------------------
    async def _write(self, build: Callable[[Any], None]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        build(pipe)
        try:
            results = await pipe.execute()
        except REDIS_ERRORS as exc:
            self.link.fail(exc)
            raise FleetStoreUnavailable(f"fleet store unreachable: {exc}") from exc
        self.link.ok()
        return list(results)

    async def put_node(self, state: NodeState) -> bool:
        ttl_ms = max(1, int(state.ttl_s * 1000))
        payload = state.model_dump_json()
        if self.signer is not None:
            payload = self.signer.sign(payload)
        now = self.clock()

        k = self.keys

        def build(p: Any) -> None:
            p.set(k.epoch, secrets.token_hex(8), nx=True)
            if not self.cluster:
                p.set(k.legacy_node(state.id), payload, px=ttl_ms)
            p.set(k.node(state.id), payload, px=ttl_ms)
            p.zadd(k.nodes, {state.id: now})
            p.zremrangebyscore(k.nodes, "-inf", now - self.prune_after_s)
            p.pexpire(k.blocks(state.id), self.index_ttl_ms)
            p.pexpire(k.events(state.id), self.index_ttl_ms)

        results = await self._write(build)
        return bool(results[-1])  # PEXPIRE on events:{id} is 0 when the stream is gone

    async def remove_node(self, node_id: str) -> None:
        k = self.keys

        def build(p: Any) -> None:
            p.delete(k.node(node_id), k.blocks(node_id), k.events(node_id))  # one slot
            if not self.cluster:
                p.delete(k.legacy_node(node_id))
            p.zrem(k.nodes, node_id)

        await self._write(build)

    async def record_blocks(
        self, node_id: str, stored: Sequence[int], removed: Sequence[int]
    ) -> None:
        stored_hex = [hex_hash(h) for h in stored]
        removed_hex = [hex_hash(h) for h in removed]
        blocks, events = self.keys.blocks(node_id), self.keys.events(node_id)

        def build(p: Any) -> None:
            if removed_hex:
                p.srem(blocks, *removed_hex)
            if stored_hex:
                p.sadd(blocks, *stored_hex)
            p.xadd(
                events,
                {"stored": " ".join(stored_hex), "removed": " ".join(removed_hex)},
                maxlen=self.events_maxlen,
                approximate=True,
            )
            p.pexpire(blocks, self.index_ttl_ms)
            p.pexpire(events, self.index_ttl_ms)

        await self._write(build)

    async def replace_blocks(self, node_id: str, held: Sequence[int]) -> None:
        blocks, events = self.keys.blocks(node_id), self.keys.events(node_id)
        held_hex = [hex_hash(h) for h in held]

        def build(p: Any) -> None:
            p.delete(blocks)
            for i in range(0, len(held_hex), 4096):
                p.sadd(blocks, *held_hex[i : i + 4096])
            p.xadd(
                events,
                {"full": str(len(held_hex))},
                maxlen=self.events_maxlen,
                approximate=True,
            )
            p.pexpire(blocks, self.index_ttl_ms)
            p.pexpire(events, self.index_ttl_ms)

        await self._write(build)

    # ---- reads -------------------------------------------------------------------------------

    def _with_local(self, nodes: list[NodeState]) -> list[NodeState]:
        if not self.openai_nodes:
            return nodes
        return [*nodes, *(t.state() for t in self.openai_nodes.values())]

    def _stale_view(self) -> FleetView:
        self.stale_views_total += 1
        return FleetView(
            nodes=self._with_local(list(self._last_nodes)), prefix_blocks={}, stale=True
        )

    async def view(self, block_hashes: Sequence[int]) -> FleetView:
        self.views_total += 1
        if self.link.should_skip():
            self._outage = True
            return self._stale_view()
        try:
            epoch, rows = await self._reader.read([hex_hash(h) for h in block_hashes])
        except REDIS_ERRORS as exc:
            self.link.fail(exc)
            self._outage = True
            return self._stale_view()
        self.link.ok()
        now = self.clock()
        nodes: list[NodeState] = []
        prefix: dict[str, int] = {}
        parsed: dict[str, tuple[NodeState, float]] = {}
        rejected: dict[str, str] = {}
        for raw, count in rows:
            got = self._parsed.get(raw)  # states change once a second; views run per request
            if got is None:
                if raw in self._rejected:
                    rejected[raw] = self._rejected[raw]
                    continue
                try:
                    state = self._admit(raw, now)
                except ValidationError as exc:
                    log.warning("fleet store: ignoring an unreadable node state: %s", exc)
                    continue
                except _Rejected as why:
                    self.rejected_total += 1
                    rejected[raw] = str(why)
                    log.warning("fleet store: ignoring a node record: %s", why)
                    continue
                got = (state, now)
            parsed[raw] = got
            node = got[0]
            nodes.append(node)
            if count:
                prefix[node.id] = count
        self._parsed = parsed
        self._rejected = rejected
        carried = self._recover(epoch, parsed, now)
        if carried:
            self.carried_views_total += 1
            nodes = [*nodes, *carried]
        self._last_nodes = nodes
        return FleetView(nodes=self._with_local(nodes), prefix_blocks=prefix, stale=bool(carried))

    def _admit(self, raw: str, now: float) -> NodeState:
        """The state a record holds, if this gateway may trust it; else :class:`_Rejected`
        (unsigned or forged with a signer set, stale, or a URL not allowed)."""
        if self.signer is None:
            state = NodeState.model_validate_json(unsigned_payload(raw))
        else:
            payload = self.signer.open(raw)
            if payload is None:
                raise _Rejected("unsigned, or not signed with this fleet's node token")
            state = NodeState.model_validate_json(payload)
            if now - state.timestamp > state.ttl_s + CLOCK_SKEW_S:
                raise _Rejected(f"node {state.id}: a stale signed record (replayed?)")
        if not url_allowed(state.url, self.allowed_urls):
            raise _Rejected(f"node {state.id}: its URL {state.url} is not in allowed_node_urls")
        return state

    def _recover(
        self, epoch: str | None, parsed: dict[str, tuple[NodeState, float]], now: float
    ) -> list[NodeState]:
        """The nodes Redis lost that this view keeps (see the module invariants)."""
        lost = self._epoch is not None and epoch != self._epoch and bool(self._seen)
        if self._outage or lost:
            self.recoveries_total += 1
        if self._outage:
            self._outage = False
            self._recovering = bool(self._seen)
            # nodes could not publish during the outage: one TTL from now to do it
            self._seen = {k: (st, max(t, now + st.ttl_s)) for k, (st, t) in self._seen.items()}
        if lost:
            if not self._recovering:
                log.warning(
                    "fleet store: Redis lost the fleet's state; keeping the last view's nodes "
                    "until they re-publish"
                )
            self._recovering = True
        if epoch is not None:
            self._epoch = epoch
        live = {st.id: (st, first + st.ttl_s) for st, first in parsed.values()}
        carried: list[NodeState] = []
        if self._recovering:
            for node_id, (st, until) in self._seen.items():
                if node_id not in live and until > now:
                    carried.append(st)
                    live[node_id] = (st, until)
            if not carried:
                self._recovering = False
                log.info("fleet store: every node is back in Redis (or expired)")
        self._seen = live
        return carried

    async def close(self) -> None:
        await self.redis.aclose()
