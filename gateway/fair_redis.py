"""Fair-share slot counts in Redis, shared by every gateway (see :mod:`gateway.fair_counts`
for what each call does, :mod:`gateway.fair_share` for the rule).

Layout (one hash tag, so every script runs on Redis Cluster too):
``edgecloud:v1:{fair}:held`` and ``...:wait`` (hashes, field ``<gateway id>|<key>`` -> count),
``...:meta`` (key -> its weight, limit, team, team weight, team limit, as its last request
stated them) and ``...:alive`` (gateway id -> when its counts expire, server ms).

Invariants:
- Every call is one EVALSHA of one script, atomic, timed by the Redis server's clock: it
  renews its gateway's lease (``lease_s``), drops the counts of gateways whose lease ran out
  (a gateway that died holding slots frees them within ``lease_s``), sums the rest per key
  and decides exactly as :func:`gateway.fair_share.verdict` does (the water-filling is the
  same arithmetic in Lua). A live gateway renews its lease every ``lease_s / 3`` at least.
- Counts are fleet-wide; the *order* in which waiting requests try again is each gateway's own
  (:class:`gateway.fair_queue.FairQueue`): a slot freed on one gateway is found by the others'
  waiters when they next try (every ``poll_s``), and the fair-share rule, not the order,
  keeps an over-share key from taking it while another key waits.
- If Redis is unreachable, the in-process counts decide, over ``capacity / replicas`` slots
  (``replicas``: the gateways sharing the fleet); admissions made there are given back there.
  Redis restarting empty forgets held slots: keys may then hold up to twice their share until
  the requests admitted before it end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from gateway.fair_counts import Answer, FairCounts, InProcessFairCounts
from gateway.fair_share import Tenant, Verdict
from routing.fleet.store import KEY_PREFIX
from routing.redis_connect import RedisClient
from routing.redis_link import REDIS_ERRORS, OverRedisLink, RedisLink

log = logging.getLogger(__name__)

SCRIPT = r"""
local held_h, wait_h, meta_h, alive_h = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, gid, key = ARGV[1], ARGV[2], ARGV[3]
local field = gid .. '|' .. key
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', alive_h, gid, now + tonumber(ARGV[11]))
if op == 'rel' then
  if redis.call('HINCRBY', held_h, field, -1) <= 0 then redis.call('HDEL', held_h, field) end
  return {0, 0, 0}
elseif op == 'leave' then
  if redis.call('HINCRBY', wait_h, field, -1) <= 0 then redis.call('HDEL', wait_h, field) end
  return {0, 0, 0}
elseif op == 'beat' then
  return {0, 0, 0}
end
local dead = {}
local al = redis.call('HGETALL', alive_h)
for i = 1, #al, 2 do
  if tonumber(al[i + 1]) < now then dead[al[i]] = true; redis.call('HDEL', alive_h, al[i]) end
end
local function load(h)
  local out = {}
  local kv = redis.call('HGETALL', h)
  for i = 1, #kv, 2 do
    local f = kv[i]
    local sep = string.find(f, '|', 1, true)
    local g, k = string.sub(f, 1, sep - 1), string.sub(f, sep + 1)
    if dead[g] then redis.call('HDEL', h, f) else out[k] = (out[k] or 0) + tonumber(kv[i + 1]) end
  end
  return out
end
local held, wait = load(held_h), load(wait_h)
local weight, kmax, team = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local tweight, tmax = tonumber(ARGV[7]), tonumber(ARGV[8])
local capacity, registered, peek = tonumber(ARGV[9]), tonumber(ARGV[10]), op == 'peek'
if not peek then
  redis.call('HSET', meta_h, key, weight .. '|' .. kmax .. '|' .. team .. '|' .. tweight)
end
local meta = {}
local mv = redis.call('HGETALL', meta_h)
for i = 1, #mv, 2 do
  local k = mv[i]
  if (held[k] or 0) <= 0 and (wait[k] or 0) <= 0 and k ~= key then
    redis.call('HDEL', meta_h, k)
  else
    local p = {}
    for s in string.gmatch(mv[i + 1], '([^|]*)|?') do p[#p + 1] = s end
    meta[k] = {tonumber(p[1]), tonumber(p[2]), p[3], tonumber(p[4])}
  end
end
meta[key] = {weight, kmax, team, tweight}
local mine_held, mine_wait = held[key] or 0, (wait[key] or 0) + (registered == 1 and 0 or 1)
local total, team_held = 0, 0
for k, n in pairs(held) do
  total = total + n
  if team ~= '' and meta[k] and meta[k][3] == team then team_held = team_held + n end
end
local eps = 1e-9
local function fill(units, cap)
  local alloc, left, active = {}, cap, {}
  for _, u in ipairs(units) do
    alloc[u[1]] = 0
    if u[3] > 0 then active[#active + 1] = u end
  end
  while #active > 0 do
    local tw = 0
    for _, u in ipairs(active) do tw = tw + math.max(u[2], eps) end
    local rest, used, sated = {}, 0, false
    for _, u in ipairs(active) do
      if u[3] <= left * math.max(u[2], eps) / tw + eps then
        alloc[u[1]] = u[3]; used = used + u[3]; sated = true
      else rest[#rest + 1] = u end
    end
    if not sated then
      for _, u in ipairs(active) do alloc[u[1]] = left * math.max(u[2], eps) / tw end
      break
    end
    left = left - used
    active = rest
  end
  return alloc
end
local function demand(k)
  local d = (held[k] or 0) + (wait[k] or 0)
  if k == key then d = mine_held + mine_wait end
  local m = meta[k] and meta[k][2] or -1
  if m >= 0 and d > m then d = m end
  return d
end
local units, members, order = {}, {}, {}
for k, m in pairs(meta) do
  local u = (m[3] ~= '' and ('team:' .. m[3])) or ('key:' .. k)
  if not units[u] then
    units[u] = {u, (m[3] ~= '' and m[4]) or m[1], 0}; members[u] = {}; order[#order + 1] = u
  end
  units[u][3] = units[u][3] + demand(k)
  members[u][#members[u] + 1] = k
end
local ulist = {}
for _, u in ipairs(order) do ulist[#ulist + 1] = units[u] end
local ualloc = fill(ulist, capacity)
local myunit = (team ~= '' and ('team:' .. team)) or ('key:' .. key)
local share = ualloc[myunit]
if #members[myunit] > 1 then
  local inner = {}
  for _, k in ipairs(members[myunit]) do inner[#inner + 1] = {k, meta[k][1], demand(k)} end
  share = fill(inner, ualloc[myunit])[key]
end
local allowed = math.max(1, math.ceil(share - eps))
if kmax >= 0 and allowed > kmax then allowed = kmax end
if tmax >= 0 and allowed > tmax then allowed = tmax end
allowed = math.max(1, allowed)
local v = 0
if kmax >= 0 and mine_held >= kmax then v = 1
elseif team ~= '' and tmax >= 0 and team_held >= tmax then v = 1
elseif total >= capacity then v = 2
elseif mine_held + 1 > math.ceil(share - eps) then v = 2 end
if peek then return {v, mine_wait, allowed} end
if v == 0 then
  redis.call('HINCRBY', held_h, field, 1)
  if registered == 1 and redis.call('HINCRBY', wait_h, field, -1) <= 0 then
    redis.call('HDEL', wait_h, field)
  end
elseif v == 2 then
  if registered == 0 then redis.call('HINCRBY', wait_h, field, 1) end
elseif registered == 1 then
  if redis.call('HINCRBY', wait_h, field, -1) <= 0 then redis.call('HDEL', wait_h, field) end
end
if v == 2 then return {v, mine_wait, allowed} end
return {v, mine_wait - 1, allowed}
"""


def _num(v: int | float | None) -> str:
    return "-1" if v is None else repr(float(v)) if isinstance(v, float) else str(v)


class RedisFairCounts(OverRedisLink, FairCounts):
    """Fair-share counts in Redis (see the module's invariants)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str = KEY_PREFIX,
        replicas: int = 1,
        lease_s: float = 15.0,
        retry_interval_s: float = 1.0,
        gateway_id: str | None = None,
    ) -> None:
        self.redis = client
        self.gid = gateway_id or uuid.uuid4().hex[:16]
        self.replicas = replicas
        self.lease_ms = int(lease_s * 1000)
        base = f"{namespace}{{fair}}:"
        self.keys = [base + "held", base + "wait", base + "meta", base + "alive"]
        self.local = InProcessFairCounts()
        self.link = RedisLink(
            client,
            what="fair share",
            fallback=f"counting slots in-process over 1/{replicas} of the fleet",
            retry_interval_s=retry_interval_s,
        )
        self._script = client.register_script(SCRIPT)
        self._tasks: set[asyncio.Task[None]] = set()
        self._beat: asyncio.Task[None] | None = None

    def _args(self, op: str, t: Tenant, capacity: int = 0, registered: bool = False) -> list[str]:
        team = (t.team or "").replace("|", "/")
        return [
            op, self.gid, t.key, _num(float(t.weight)), _num(t.max_concurrent), team,
            _num(float(t.team_weight)), _num(t.team_max_concurrent if team else None),
            str(int(capacity)), "1" if registered else "0", str(self.lease_ms),
        ]  # fmt: skip

    async def try_acquire(
        self, t: Tenant, capacity: int, registered: bool, *, peek: bool = False
    ) -> Answer:
        if not self.link.should_skip():
            try:
                op = "peek" if peek else "acq"
                raw = await self._script(
                    keys=self.keys, args=self._args(op, t, capacity, registered)
                )
            except REDIS_ERRORS as exc:
                self.link.fail(exc)
            else:
                self.link.ok()
                self._start_beat()
                return Answer(Verdict(int(raw[0])), int(raw[1]), int(raw[2]))
        share = max(1, capacity // self.replicas)
        return self.local.decide(t, share, registered, peek)

    def _later(self, op: str, t: Tenant) -> None:
        async def run() -> None:
            try:
                await self._script(keys=self.keys, args=self._args(op, t))
            except REDIS_ERRORS as exc:
                self.link.fail(exc)  # the lease drops the count if this gateway goes away

        try:
            task = asyncio.get_running_loop().create_task(run())
        except RuntimeError:  # no loop (a finalizer at shutdown): the lease ends the count
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release(self, t: Tenant, answer: Answer) -> None:
        if answer.local:
            self.local.release(t, answer)
        else:
            self._later("rel", t)

    def leave(self, t: Tenant, answer: Answer) -> None:
        if answer.local:
            self.local.leave(t, answer)
        else:
            self._later("leave", t)

    def _start_beat(self) -> None:
        if self._beat is None or self._beat.done():
            self._beat = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        """Renews this gateway's lease while it holds or awaits anything in Redis."""
        beat = Tenant("")
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            with contextlib.suppress(*REDIS_ERRORS):
                await self._script(keys=self.keys, args=self._args("beat", beat))

    def health(self) -> dict[str, Any]:
        return {**self.link.health(), "gateway_id": self.gid}

    async def close(self) -> None:
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
