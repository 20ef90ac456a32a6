"""Per-key rate limits: a requests/min and a tokens/min token bucket, in Redis or in-process.

Bucket semantics (both implementations, the same arithmetic):
- A limit of ``rpm`` requests/min is a bucket of capacity ``rpm`` refilled continuously at
  ``rpm / 60`` per second (a full minute's budget may be spent at once); likewise ``tpm``. A
  limit of ``None`` is unlimited and keeps no bucket.
- :meth:`RateLimiter.acquire` charges one request and ``tokens`` tokens (the estimate: prompt
  tokens + max output tokens) *together or not at all*. A refusal says which bucket was short
  and ``retry_after_s > 0``: when that bucket will hold enough again. A request estimated at
  more tokens than ``tpm`` can never fit: it is refused with ``limited_by="too_large"``.
- :meth:`RateLimiter.settle` corrects the charge with the actual usage afterwards (tokens given
  back, or charged extra: the bucket may go negative, so overuse is paid for by later requests).
  :meth:`RateLimiter.refund` gives back the request and all its tokens (a request that never
  reached a node). Neither refills a bucket past its capacity.

Redis (``edgecloud:v1:rl:<key_id>``, a hash with the levels and the time they were taken):
- Every call is one EVALSHA of one Lua script, atomic, timed by the Redis server's clock
  (gateways' clocks may differ); once a second at most, the epoch read below comes before it. The key expires (PEXPIRE) when both buckets would be full
  again, which is the same as absent. The script touches that one key and nothing else (a
  key's requests and tokens buckets are one hash), so it runs on Redis Cluster as on one
  server, and the keys spread over the cluster's slots.
- Redis restarting empty does not refill every bucket. ``edgecloud:v1:rl-epoch`` holds the
  time (server ms) the limiter's state began; an absent bucket holds ``capacity * min(1,
  (now - epoch) / 60 s)``: long after the epoch, full (as before); just after an empty restart,
  empty, refilling at the key's rate. So across a restart no key gets more than an empty bucket
  would give it, and the token bucket's bound (capacity + rate x time, in any window) holds.
  The marker is off the hot path: each gateway reads it (one single-key script) at most every
  ``epoch_refresh_s`` and right after a failed Redis call, and passes the epoch it knows to
  the bucket script. It is created by the read that finds it missing: as "state began a minute
  ago" (buckets full) by a gateway that never saw a marker (a new deployment), as "state begins
  now" (buckets empty) by one that did (Redis lost it). Edge cases: a gateway restarted
  together with Redis sees a new deployment; an empty restart that no call of a gateway saw
  fail counts from that gateway's next epoch read (at most ``epoch_refresh_s`` later); a
  Cluster primary lost without a replica loses its slots' buckets (they restart full) unless
  it held the marker. A failover to a replica keeps the buckets (replication is asynchronous:
  the last few milliseconds of charges may be lost).
- If Redis is unreachable, the limiter falls back to an in-process limiter that admits this
  replica's *share*: each limit divided by ``replicas`` (the number of gateway replicas sharing
  the keys, configured; default 1), at least 1. A key's fallback bucket starts from the level
  Redis last reported to this replica for it (its share, refilled since), else from a full
  share, less one request (and its tokens) per Redis call of this replica still in flight for
  the key (it may have been admitted); so with ``replicas`` set right the fleet together admits at most one capacity plus the
  rate over the outage, on top of what Redis had admitted before it (which those levels
  reflect only for this replica's own calls). What is admitted locally is not written back to
  Redis when it returns. The limiter sets ``healthy = False`` for ``/health``, retries Redis
  at most every ``retry_interval_s`` and recovers by itself.

This module also holds :class:`RedisKeyStore`, the small Redis lookup of API keys by hash
(``edgecloud:v1:apikey:{key_hash}``), so that keys can be added without a gateway restart.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from routing.fleet.store import KEY_PREFIX
from routing.redis_connect import RedisClient
from routing.redis_link import REDIS_ERRORS, OverRedisLink, RedisLink, redis_client

log = logging.getLogger(__name__)

LimitedBy = Literal["requests", "tokens", "too_large"]
Backend = Literal["redis", "local", "none"]

WINDOW_MS = 60_000.0
_CODES: dict[int, LimitedBy | None] = {0: None, 1: "requests", 2: "tokens", 3: "too_large"}
_TOO_LARGE_RETRY_S = 60.0


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; ``None`` is unlimited."""

    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {v}")

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None


@dataclass(frozen=True, slots=True)
class RateDecision:
    """The answer to one :meth:`RateLimiter.acquire`; pass it back to ``settle``/``refund``.

    ``remaining_*`` are the bucket levels after the call (``None`` for an unlimited bucket).
    ``degraded`` is True when Redis was unreachable and the in-process fallback decided.
    """

    allowed: bool
    key_id: str
    limits: Limits
    charged_tokens: int
    retry_after_s: float = 0.0
    limited_by: LimitedBy | None = None
    remaining_requests: float | None = None
    remaining_tokens: float | None = None
    backend: Backend = "none"
    degraded: bool = False


class RateLimiter(abc.ABC):
    """One interface over the Redis and in-process limiters."""

    @abc.abstractmethod
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> RateDecision:
        """Charge one request and ``tokens`` tokens, or refuse and charge nothing."""

    @abc.abstractmethod
    async def settle(self, decision: RateDecision, actual_tokens: int) -> None:
        """Correct an allowed decision's token charge to ``actual_tokens``."""

    @abc.abstractmethod
    async def refund(self, decision: RateDecision) -> None:
        """Give back an allowed decision's request and tokens."""

    @abc.abstractmethod
    def health(self) -> dict[str, Any]:
        """For ``/health`` and metrics."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def _unlimited(key_id: str, limits: Limits, tokens: int) -> RateDecision:
    return RateDecision(True, key_id, limits, tokens, backend="none")


# ---- in-process --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Bucket:
    requests: float | None
    tokens: float | None
    at_ms: float


def _refill(level: float | None, cap: int | None, elapsed_ms: float) -> float | None:
    if cap is None:
        return None
    if level is None:
        return float(cap)
    return min(float(cap), level + elapsed_ms * cap / WINDOW_MS)


class InProcessRateLimiter(RateLimiter):
    """The buckets in this process's memory (one gateway, or the Redis limiter's fallback).

    Thread-safe. Buckets that have refilled completely are dropped when more than ``max_keys``
    are held (a full bucket is the same as none).
    """

    def __init__(
        self, *, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def _now_ms(self) -> float:
        return self.clock() * 1000.0

    def _load(self, key_id: str, limits: Limits, now: float) -> _Bucket:
        b = self._buckets.get(key_id)
        elapsed = max(0.0, now - b.at_ms) if b else 0.0
        return _Bucket(
            requests=_refill(b.requests if b else None, limits.rpm, elapsed),
            tokens=_refill(b.tokens if b else None, limits.tpm, elapsed),
            at_ms=now,
        )

    def _store(self, key_id: str, b: _Bucket, limits: Limits) -> None:
        self._buckets[key_id] = b
        if len(self._buckets) > self.max_keys:
            now = b.at_ms
            for k, old in list(self._buckets.items()):
                if k != key_id and now - old.at_ms >= WINDOW_MS:
                    del self._buckets[k]

    def seed(
        self,
        key_id: str,
        requests: float | None,
        tokens: float | None,
        at_s: float,
        *,
        only_if_absent: bool = False,
    ) -> None:
        """Start ``key_id``'s bucket at these levels as of ``at_s`` (this limiter's clock),
        unless it holds a newer one, or any one with ``only_if_absent`` (the Redis limiter
        seeds its fallback this way)."""
        with self._lock:
            b = self._buckets.get(key_id)
            if b is None or (not only_if_absent and b.at_ms < at_s * 1000.0):
                self._buckets[key_id] = _Bucket(requests, tokens, at_s * 1000.0)

    def acquire_now(self, key_id: str, limits: Limits, tokens: int) -> RateDecision:
        """The synchronous core of :meth:`acquire`."""
        tokens = max(0, int(tokens))
        if limits.unlimited:
            return _unlimited(key_id, limits, tokens)
        with self._lock:
            now = self._now_ms()
            b = self._load(key_id, limits, now)
            wait_r = wait_t = 0.0
            code = 0
            if limits.tpm is not None and tokens > limits.tpm:
                code = 3
            else:
                if limits.rpm is not None and b.requests is not None and b.requests < 1:
                    wait_r = (1 - b.requests) * WINDOW_MS / limits.rpm
                if limits.tpm is not None and b.tokens is not None and b.tokens < tokens:
                    wait_t = (tokens - b.tokens) * WINDOW_MS / limits.tpm
                if wait_r or wait_t:
                    code = 1 if wait_r >= wait_t else 2
            if code == 0:
                if b.requests is not None:
                    b.requests -= 1
                if b.tokens is not None:
                    b.tokens -= tokens
            self._store(key_id, b, limits)
        wait_s = _TOO_LARGE_RETRY_S if code == 3 else math.ceil(max(wait_r, wait_t)) / 1000.0
        return RateDecision(
            allowed=code == 0,
            key_id=key_id,
            limits=limits,
            charged_tokens=tokens if code == 0 else 0,
            retry_after_s=0.0 if code == 0 else max(wait_s, 0.001),
            limited_by=_CODES[code],
            remaining_requests=b.requests,
            remaining_tokens=b.tokens,
            backend="local",
        )

    def adjust_now(self, key_id: str, limits: Limits, requests: int, tokens: int) -> None:
        """Give back ``requests`` requests and ``tokens`` tokens (negative: charge more)."""
        if limits.unlimited or (requests == 0 and tokens == 0):
            return
        with self._lock:
            b = self._load(key_id, limits, self._now_ms())
            if b.requests is not None and limits.rpm is not None:
                b.requests = min(float(limits.rpm), b.requests + requests)
            if b.tokens is not None and limits.tpm is not None:
                b.tokens = min(float(limits.tpm), b.tokens + tokens)
            self._store(key_id, b, limits)

    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> RateDecision:
        return self.acquire_now(key_id, limits, tokens)

    async def settle(self, decision: RateDecision, actual_tokens: int) -> None:
        if decision.allowed:
            delta = decision.charged_tokens - max(0, int(actual_tokens))
            self.adjust_now(decision.key_id, decision.limits, 0, delta)

    async def refund(self, decision: RateDecision) -> None:
        if decision.allowed:
            self.adjust_now(decision.key_id, decision.limits, 1, decision.charged_tokens)

    def health(self) -> dict[str, Any]:
        return {"backend": "memory", "healthy": True, "keys": len(self._buckets)}


# ---- Redis ---------------------------------------------------------------------------------------
# The epoch marker, alone (KEYS[1]: the marker; ARGV[1]: the epoch this gateway last saw, '' if
# none). Returns the epoch (server ms), creating it when missing (see the module notes).
EPOCH_SCRIPT = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  if ARGV[1] == '' then epoch = string.format('%d', now - 60000)
  else epoch = string.format('%d', now) end
  redis.call('SET', KEYS[1], epoch)
end
return epoch
"""

# KEYS[1]: the bucket hash, the only key. ARGV: rpm, tpm (0 = unlimited), the limiter's epoch
# (server ms; '' = unknown: an absent bucket is full), then the script's own arguments.
# Fields: r (requests level), t (tokens level), ts (ms, Redis server time).
_PRELUDE = """
local key = KEYS[1]
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local fresh = 1
if ARGV[3] ~= '' then
  fresh = (now - tonumber(ARGV[3])) / 60000
  if fresh > 1 then fresh = 1 elseif fresh < 0 then fresh = 0 end
end
local s = redis.call('HMGET', key, 'r', 't', 'ts')
local ts = tonumber(s[3]) or now
local dt = now - ts
if dt < 0 then dt = 0 end
local r = nil
local t = nil
if rpm > 0 then
  r = tonumber(s[1])
  if r == nil then r = rpm * fresh else r = math.min(rpm, r + dt * rpm / 60000) end
end
if tpm > 0 then
  t = tonumber(s[2])
  if t == nil then t = tpm * fresh else t = math.min(tpm, t + dt * tpm / 60000) end
end
"""

_SAVE = """
local ttl = 0
redis.call('DEL', key)
if r ~= nil then
  redis.call('HSET', key, 'r', tostring(r))
  ttl = math.max(ttl, (rpm - r) * 60000 / rpm)
end
if t ~= nil then
  redis.call('HSET', key, 't', tostring(t))
  ttl = math.max(ttl, (tpm - t) * 60000 / tpm)
end
redis.call('HSET', key, 'ts', now)
redis.call('PEXPIRE', key, math.ceil(ttl) + 1000)
"""

# ARGV[4]: tokens to charge.
# Returns {allowed, retry_after_ms, code, requests level, tokens level}.
ACQUIRE_SCRIPT = (
    _PRELUDE
    + """
local cost = tonumber(ARGV[4])
local code = 0
local wait_r = 0
local wait_t = 0
if t ~= nil and cost > tpm then
  code = 3
else
  if r ~= nil and r < 1 then wait_r = (1 - r) * 60000 / rpm end
  if t ~= nil and t < cost then wait_t = (cost - t) * 60000 / tpm end
  if wait_r > 0 or wait_t > 0 then
    if wait_r >= wait_t then code = 1 else code = 2 end
  end
end
if code == 0 then
  if r ~= nil then r = r - 1 end
  if t ~= nil then t = t - cost end
end
"""
    + _SAVE
    + """
return {code == 0 and 1 or 0, math.ceil(math.max(wait_r, wait_t)), code,
        tostring(r or ''), tostring(t or '')}
"""
)

# ARGV[4]: requests to give back, ARGV[5]: tokens to give back (negative: charge more).
ADJUST_SCRIPT = (
    _PRELUDE
    + """
local dr = tonumber(ARGV[4])
local dtk = tonumber(ARGV[5])
if r ~= nil then r = math.min(rpm, r + dr) end
if t ~= nil then t = math.min(tpm, t + dtk) end
"""
    + _SAVE
    + """
return 1
"""
)


def _level(raw: Any) -> float | None:
    return float(raw) if raw not in (None, "") else None


def share_of(limits: Limits, replicas: int) -> Limits:
    """One replica's share of ``limits`` among ``replicas`` gateways (each at least 1)."""
    if replicas <= 1:
        return limits

    def part(v: int | None) -> int | None:
        return None if v is None else max(1, v // replicas)

    return Limits(part(limits.rpm), part(limits.tpm))


class RedisRateLimiter(OverRedisLink, RateLimiter):
    """Buckets in Redis, shared by every gateway replica (see the module invariants).

    ``replicas``: how many gateway replicas share these keys; while Redis is unreachable this
    one admits ``limits / replicas`` (:func:`share_of`). ``on_error`` is called with each Redis
    failure (for a metrics counter). ``client``: a shared client (see
    :func:`routing.redis_link.redis_client`); else one of ``max_connections`` is made.
    ``epoch_refresh_s``: how often the epoch marker is read (off the hot path, see the module
    notes).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = KEY_PREFIX,
        timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        replicas: int = 1,
        max_connections: int = 64,
        fallback: InProcessRateLimiter | None = None,
        client: RedisClient | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        max_seen: int = 100_000,
        epoch_refresh_s: float = 1.0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.ns = namespace
        self.retry_interval_s = retry_interval_s
        self.replicas = replicas
        self.fallback = fallback or InProcessRateLimiter()
        self.redis: RedisClient = client or redis_client(
            url, timeout_s=timeout_s, max_connections=max_connections
        )
        self.link = RedisLink(
            self.redis,
            what="rate limiter",
            fallback=f"limiting in-process to 1/{replicas} of each limit",
            retry_interval_s=retry_interval_s,
            on_error=on_error,
        )
        self._acquire = self.redis.register_script(ACQUIRE_SCRIPT)
        self._adjust = self.redis.register_script(ADJUST_SCRIPT)
        self._epoch_script = self.redis.register_script(EPOCH_SCRIPT)
        self.epoch_key = f"{self.ns}rl-epoch"
        self.epoch: str = ""  # the limiter epoch last seen in Redis ('' = none yet)
        self.epochs_seen = 0  # how many different epochs this limiter has seen
        self.epoch_refresh_s = epoch_refresh_s
        self._epoch_due = 0.0  # monotonic time of the next epoch read (0: at the next call)
        self._epoch_lock = asyncio.Lock()
        # key_id -> (fallback clock s, requests level, tokens level): what Redis last reported
        self._seen: dict[str, tuple[float, float | None, float | None]] = {}
        self.max_seen = max_seen
        self._pending: dict[str, int] = {}  # key_id -> this replica's Redis calls in flight
        self.fallback_decisions = 0

    def key(self, key_id: str) -> str:
        return f"{self.ns}rl:{key_id}"

    def _learn_epoch(self, raw: Any) -> None:
        epoch = str(raw) if raw not in (None, "") else ""
        if epoch and epoch != self.epoch:
            if self.epoch:
                log.warning("rate limiter: Redis lost its state; buckets restart empty")
            self.epoch = epoch
            self.epochs_seen += 1

    def _failed(self, exc: BaseException) -> None:
        self.link.fail(exc)
        self._epoch_due = 0.0  # Redis may come back empty: read the marker first

    async def _refresh_epoch(self) -> None:
        """Read (or create) the epoch marker if due: at most every ``epoch_refresh_s``, and
        before the first call after a failure. Concurrent callers wait for one read. Raises
        what Redis raises."""
        if time.monotonic() < self._epoch_due:
            return
        async with self._epoch_lock:
            if time.monotonic() < self._epoch_due:
                return
            raw = await self._epoch_script(keys=[self.epoch_key], args=[self.epoch])
            self._learn_epoch(raw)
            self._epoch_due = time.monotonic() + self.epoch_refresh_s

    def _remember(self, key_id: str, r: float | None, t: float | None) -> None:
        seen = self._seen
        seen.pop(key_id, None)  # re-insert: the dict stays in order of last sight
        seen[key_id] = (self.fallback.clock(), r, t)
        if len(seen) > self.max_seen:  # drop the tenth seen longest ago
            for k in list(itertools.islice(seen, len(seen) // 10 or 1)):
                del seen[k]

    async def _local(self, key_id: str, limits: Limits, tokens: int) -> RateDecision:
        """This replica's share, from the level Redis last reported for the key (if any), less
        what this replica's Redis calls still in flight for it may have taken."""
        self.fallback_decisions += 1
        share = share_of(limits, self.replicas)
        seen = self._seen.get(key_id)
        pending = self._pending.get(key_id, 0)
        if seen is not None or pending:
            at, r, t = seen if seen is not None else (self.fallback.clock(), None, None)
            n = self.replicas
            r0 = t0 = None
            if share.rpm is not None:
                r0 = (share.rpm if r is None else min(float(share.rpm), r / n)) - pending
            if share.tpm is not None:
                t0 = (share.tpm if t is None else min(float(share.tpm), t / n)) - pending * tokens
            self.fallback.seed(key_id, r0, t0, at, only_if_absent=seen is None)
        d = self.fallback.acquire_now(key_id, share, tokens)
        if d.limited_by == "too_large" and (limits.tpm is None or tokens <= limits.tpm):
            # too large for this replica's share only: not the client's fault, retry later
            d = replace(d, limited_by="tokens", retry_after_s=max(1.0, self.retry_interval_s))
        return replace(d, degraded=True)

    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> RateDecision:
        tokens = max(0, int(tokens))
        if limits.unlimited:
            return _unlimited(key_id, limits, tokens)
        if self.link.should_skip():
            return await self._local(key_id, limits, tokens)
        pending = self._pending
        pending[key_id] = pending.get(key_id, 0) + 1
        failed: BaseException | None = None
        try:
            await self._refresh_epoch()
            raw = await self._acquire(
                keys=[self.key(key_id)],
                args=[limits.rpm or 0, limits.tpm or 0, self.epoch, tokens],
            )
        except REDIS_ERRORS as exc:
            failed = exc
        finally:
            left = pending[key_id] - 1
            if left:
                pending[key_id] = left
            else:
                del pending[key_id]
        if failed is not None:
            self._failed(failed)
            return await self._local(key_id, limits, tokens)
        self.link.ok()
        allowed, wait_ms, code = int(raw[0]), int(raw[1]), int(raw[2])
        remaining_r, remaining_t = _level(raw[3]), _level(raw[4])
        self._remember(key_id, remaining_r, remaining_t)
        limited_by = _CODES.get(code)
        wait_s = _TOO_LARGE_RETRY_S if code == 3 else max(wait_ms, 1) / 1000.0
        return RateDecision(
            allowed=bool(allowed),
            key_id=key_id,
            limits=limits,
            charged_tokens=tokens if allowed else 0,
            retry_after_s=0.0 if allowed else wait_s,
            limited_by=limited_by,
            remaining_requests=remaining_r,
            remaining_tokens=remaining_t,
            backend="redis",
        )

    async def _adjust_remote(self, d: RateDecision, requests: int, tokens: int) -> None:
        if requests == 0 and tokens == 0:
            return
        try:
            await self._refresh_epoch()
            await self._adjust(
                keys=[self.key(d.key_id)],
                args=[d.limits.rpm or 0, d.limits.tpm or 0, self.epoch, requests, tokens],
            )
        except REDIS_ERRORS as exc:  # the charge stands: conservative, never a client error
            self._failed(exc)
            return
        self.link.ok()

    async def settle(self, decision: RateDecision, actual_tokens: int) -> None:
        if not decision.allowed:
            return
        delta = decision.charged_tokens - max(0, int(actual_tokens))
        if decision.backend == "redis":
            await self._adjust_remote(decision, 0, delta)
        elif decision.backend == "local":
            self.fallback.adjust_now(decision.key_id, decision.limits, 0, delta)

    async def refund(self, decision: RateDecision) -> None:
        if not decision.allowed:
            return
        if decision.backend == "redis":
            await self._adjust_remote(decision, 1, decision.charged_tokens)
        elif decision.backend == "local":
            self.fallback.adjust_now(decision.key_id, decision.limits, 1, decision.charged_tokens)

    def health(self) -> dict[str, Any]:
        return {
            "backend": "redis",
            "healthy": self.healthy,
            "degraded": not self.healthy,
            "last_error": self.last_error,
            "errors_total": self.errors_total,
            "fallback_decisions": self.fallback_decisions,
            "fallback_share": f"1/{self.replicas}",
            "epochs_seen": self.epochs_seen,
        }

    async def close(self) -> None:
        await self.redis.aclose()


# ---- API keys in Redis ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An API key's identity and limits, as stored (the key itself is never stored)."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    team: str | None = None  # keys of one team may share a cache scope (``cache_scope: team``)
    weight: float = 1.0  # fair share (``gateway.fair_share``)
    max_concurrent: int | None = None
    max_tokens_default: int | None = None
    max_tokens_limit: int | None = None


class KeyStoreUnavailable(ConnectionError):
    """The key store could not be reached."""


def _opt_int(raw: str | None) -> int | None:
    return int(raw) if raw not in (None, "") else None


class RedisKeyStore:
    """API keys by hash: ``edgecloud:v1:apikey:{key_hash}`` -> hash {name, rpm, tpm, team,
    weight, max_concurrent, max_tokens_default, max_tokens_limit} (empty: unset).

    Every method is one round trip and raises :class:`KeyStoreUnavailable` when Redis is down.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = KEY_PREFIX,
        timeout_s: float = 0.25,
        client: RedisClient | None = None,
    ) -> None:
        self.ns = namespace
        self.redis: RedisClient = client or redis_client(url, timeout_s=timeout_s)

    def key(self, key_hash: str) -> str:
        return f"{self.ns}apikey:{key_hash}"

    async def get(self, key_hash: str) -> KeyRecord | None:
        try:
            raw = await self.redis.hgetall(self.key(key_hash))
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc
        if not raw or "name" not in raw:
            return None
        return KeyRecord(
            name=raw["name"],
            rpm=_opt_int(raw.get("rpm")),
            tpm=_opt_int(raw.get("tpm")),
            team=raw.get("team") or None,
            weight=float(raw.get("weight") or 1.0),
            max_concurrent=_opt_int(raw.get("max_concurrent")),
            max_tokens_default=_opt_int(raw.get("max_tokens_default")),
            max_tokens_limit=_opt_int(raw.get("max_tokens_limit")),
        )

    async def put(self, key_hash: str, record: KeyRecord) -> None:
        mapping = {
            "name": record.name,
            "rpm": record.rpm or "",
            "tpm": record.tpm or "",
            "team": record.team or "",
            "weight": repr(float(record.weight)),
            "max_concurrent": record.max_concurrent or "",
            "max_tokens_default": record.max_tokens_default or "",
            "max_tokens_limit": record.max_tokens_limit or "",
        }
        try:  # every field at once: one command on one key, so atomic on a cluster too
            await self.redis.hset(self.key(key_hash), mapping=mapping)
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc

    async def delete(self, key_hash: str) -> bool:
        try:
            return bool(await self.redis.delete(self.key(key_hash)))
        except REDIS_ERRORS as exc:
            raise KeyStoreUnavailable(f"key store unreachable: {exc}") from exc

    async def close(self) -> None:
        await self.redis.aclose()
