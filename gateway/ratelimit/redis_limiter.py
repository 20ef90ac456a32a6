"""The Redis limiter: :class:`RedisRateLimiter` keeps every key's buckets in Redis, shared by
all gateway replicas, one atomic script call per charge (:mod:`gateway.ratelimit.scripts`);
an empty Redis restart never refills the buckets (the epoch marker), and while Redis is
unreachable it admits this replica's share of each limit from an in-process fallback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.ratelimit.base import (
    CODES,
    TOO_LARGE_RETRY_S,
    Limits,
    RateDecision,
    RateLimiter,
    unlimited_decision,
)
from gateway.ratelimit.in_process import InProcessRateLimiter
from gateway.ratelimit.scripts import ACQUIRE_SCRIPT, ADJUST_SCRIPT, EPOCH_SCRIPT
from routing.fleet.store import KEY_PREFIX
from routing.redis_connect import RedisClient
from routing.redis_link import REDIS_ERRORS, OverRedisLink, RedisLink, redis_client

log = logging.getLogger(__name__)


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
    """Buckets in Redis, shared by every gateway replica.

    Redis (``edgecloud:v1:rl:<key_id>``, a hash with the levels and the time they were taken):
    - Every call is one EVALSHA of one Lua script, atomic, timed by the Redis server's clock
      (gateways' clocks may differ); once a second at most, the epoch read below comes before it.
      The key expires (PEXPIRE) when both buckets would be full again, which is the same as absent.
      The script touches that one key and nothing else (a key's requests and tokens buckets are one
      hash), so it runs on Redis Cluster as on one server, and the keys spread over the cluster's
      slots.
    - Redis restarting empty does not refill every bucket. ``edgecloud:v1:rl-epoch`` holds the time
      (server ms) the limiter's state began; an absent bucket holds ``capacity * min(1, (now -
      epoch) / 60 s)``: long after the epoch, full (as before); just after an empty restart, empty,
      refilling at the key's rate. So across a restart no key gets more than an empty bucket would
      give it, and the token bucket's bound (capacity + rate x time, in any window) holds. The
      marker is off the hot path: each gateway reads it (one single-key script) at most every
      ``epoch_refresh_s`` and right after a failed Redis call, and passes the epoch it knows to the
      bucket script. It is created by the read that finds it missing: as "state began a minute ago"
      (buckets full) by a gateway that never saw a marker (a new deployment), as "state begins now"
      (buckets empty) by one that did (Redis lost it). Edge cases: a gateway restarted together with
      Redis sees a new deployment; an empty restart that no call of a gateway saw fail counts from
      that gateway's next epoch read (at most ``epoch_refresh_s`` later); a Cluster primary lost
      without a replica loses its slots' buckets (they restart full) unless it held the marker. A
      failover to a replica keeps the buckets (replication is asynchronous: the last few
      milliseconds of charges may be lost).
    - If Redis is unreachable, the limiter falls back to an in-process limiter that admits this
      replica's *share*: each limit divided by ``replicas`` (the number of gateway replicas sharing
      the keys, configured; default 1), at least 1. A key's fallback bucket starts from the level
      Redis last reported to this replica for it (its share, refilled since), else from a full
      share, less one request (and its tokens) per Redis call of this replica still in flight for
      the key (it may have been admitted); so with ``replicas`` set right the fleet together admits
      at most one capacity plus the rate over the outage, on top of what Redis had admitted before
      it (which those levels reflect only for this replica's own calls). What is admitted locally is
      not written back to Redis when it returns. The limiter sets ``healthy = False`` for
      ``/health``, retries Redis at most every ``retry_interval_s`` and recovers by itself.

    ``replicas``: how many gateway replicas share these keys; while Redis is unreachable this
    one admits ``limits / replicas`` (:func:`share_of`). ``on_error`` is called with each Redis
    failure (for a metrics counter). ``client``: a shared client (see
    :func:`routing.redis_link.redis_client`); else one of ``max_connections`` is made.
    ``epoch_refresh_s``: how often the epoch marker is read (off the hot path, see above).
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
            return unlimited_decision(key_id, limits, tokens)
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
        limited_by = CODES.get(code)
        wait_s = TOO_LARGE_RETRY_S if code == 3 else max(wait_ms, 1) / 1000.0
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
