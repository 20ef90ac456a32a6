"""How one fleet view is read from Redis: one script on one server, one pipeline on a cluster.

A reader answers ``read(block_hashes_hex)`` with ``(epoch, [(state_json, leading_blocks)])``:
the fleet's epoch (``None`` if unset) and, for each node of the ``nodes`` set whose state key
has not expired, its state as stored and how many *leading* request blocks its block set holds.
Key names: :class:`FleetKeys` (the layout is documented in :mod:`routing.fleet.store`).

- :class:`ScriptViewReader` (one server, or a Sentinel-managed primary): exactly one round
  trip, EVALSHA of one script that reads every key (keys it computes, which only one server
  allows). It also reads the states and block sets of nodes of releases before the hash tags
  (``node:<id>``), so a rolling upgrade loses no node.
- :class:`ClusterViewReader` (Redis Cluster): no script spans nodes. The node ids and the epoch
  (``nodes``, ``epoch``: the only shared keys) are read at most every ``members_refresh_s``,
  then each view is one pipeline of single-key commands, ``GET node:{id}`` and ``SMISMEMBER
  blocks:{id}``, which redis-py sends to every primary at once: one round trip, in parallel.
  A node that registered since the last refresh is seen at most ``members_refresh_s`` later.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass

from routing.redis_connect import RedisClient, hash_tag

ViewRows = tuple[str | None, list[tuple[str, int]]]

VIEW_SCRIPT = """
local ns = ARGV[1]
local ids = redis.call('ZRANGE', ns .. 'nodes', 0, -1)
local out = {redis.call('GET', ns .. 'epoch') or ''}
local esc = {['%'] = '%25', ['{'] = '%7B', ['}'] = '%7D'}
for _, id in ipairs(ids) do
  local tag = string.gsub(id, '[%%{}]', esc)
  tag = '{' .. tag .. '}'
  local state = redis.call('GET', ns .. 'node:' .. tag)
  local bkey = ns .. 'blocks:' .. tag
  if not state then
    state = redis.call('GET', ns .. 'node:' .. id)
    bkey = ns .. 'blocks:' .. id
  end
  if state then
    local n = 0
    for i = 2, #ARGV do
      if redis.call('SISMEMBER', bkey, ARGV[i]) == 1 then n = n + 1 else break end
    end
    out[#out + 1] = state
    out[#out + 1] = n
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class FleetKeys:
    """The fleet store's key names under ``ns`` (which must hold no brace)."""

    ns: str

    def __post_init__(self) -> None:
        if "{" in self.ns or "}" in self.ns:
            raise ValueError(f"a fleet namespace holds no braces (hash tags), got {self.ns!r}")

    @property
    def nodes(self) -> str:
        return f"{self.ns}nodes"

    @property
    def epoch(self) -> str:
        return f"{self.ns}epoch"

    def node(self, node_id: str) -> str:
        return f"{self.ns}node:{hash_tag(node_id)}"

    def blocks(self, node_id: str) -> str:
        return f"{self.ns}blocks:{hash_tag(node_id)}"

    def events(self, node_id: str) -> str:
        return f"{self.ns}events:{hash_tag(node_id)}"

    def legacy_node(self, node_id: str) -> str:
        """The state key of releases before the hash tags (written for their gateways)."""
        return f"{self.ns}node:{node_id}"


class ViewReader(abc.ABC):
    """One view's rows from Redis; raises what redis-py raises."""

    @abc.abstractmethod
    async def read(self, block_hashes: Sequence[str]) -> ViewRows: ...


class ScriptViewReader(ViewReader):
    def __init__(self, redis: RedisClient, keys: FleetKeys) -> None:
        self.keys = keys
        self._script = redis.register_script(VIEW_SCRIPT)

    async def read(self, block_hashes: Sequence[str]) -> ViewRows:
        raw = await self._script(args=[self.keys.ns, *block_hashes])
        rows = [(str(raw[i]), int(raw[i + 1])) for i in range(1, len(raw), 2)]
        return (str(raw[0]) if raw and raw[0] else None), rows


def leading(flags: Sequence[int]) -> int:
    """How many of ``flags`` are set before the first unset one."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


class ClusterViewReader(ViewReader):
    def __init__(
        self, redis: RedisClient, keys: FleetKeys, *, members_refresh_s: float = 0.5
    ) -> None:
        self.redis, self.keys = redis, keys
        self.members_refresh_s = members_refresh_s
        self._members: list[str] | None = None
        self._epoch: str | None = None
        self._due = 0.0

    async def _refresh(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrange(self.keys.nodes, 0, -1)
        pipe.get(self.keys.epoch)
        ids, epoch = await pipe.execute()
        self._members, self._epoch = [str(i) for i in ids], epoch or None
        self._due = time.monotonic() + self.members_refresh_s

    async def read(self, block_hashes: Sequence[str]) -> ViewRows:
        if self._members is None or time.monotonic() >= self._due:
            await self._refresh()
        members = self._members or []
        if not members:
            return self._epoch, []
        hashes = list(block_hashes)
        pipe = self.redis.pipeline(transaction=False)
        for node_id in members:
            pipe.get(self.keys.node(node_id))
            if hashes:
                pipe.smismember(self.keys.blocks(node_id), hashes)
        res = await pipe.execute()
        step = 2 if hashes else 1
        rows = [
            (str(res[i]), leading(res[i + 1]) if hashes else 0)
            for i in range(0, len(res), step)
            if res[i] is not None
        ]
        return self._epoch, rows
