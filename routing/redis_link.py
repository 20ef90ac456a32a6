"""One Redis connection's health, shared by every component that degrades without Redis.

The fleet store and the rate limiter both keep working when Redis is down (a stale view, an
in-process bucket). They share the same rules, held here once:

- a client never hangs and never retries by itself (short timeouts, no retry), so a dead Redis
  costs a request at most one timeout;
- after a failure the component is ``healthy = False`` and skips Redis until
  ``retry_interval_s`` has passed (``should_skip``), then tries again; the first success makes it
  healthy again by itself;
- every failure is counted (``errors_total``), the last one is kept as text, and the first one
  after a healthy spell (and the recovery) is logged once, not per request.

Connections (:func:`redis_client`): one ``BlockingConnectionPool`` per client, of
``max_connections``; a command that finds every connection busy waits up to ``pool_timeout_s``
for one instead of failing at once (redis-py's default pool raised "Too many connections" at
100, and every overflowing request fell back to the in-process limiter). A gateway builds one
client and shares it between its rate limiter, key store and fleet store, sized from its
``max_in_flight`` (:func:`pool_size_for`). One server, Sentinel or Cluster, by URL:
see :mod:`routing.redis_connect` (a password comes from the URL or, better, since URLs end up
in shell history and process lists, from ``EDGECLOUD_REDIS_PASSWORD``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisClusterException, RedisError

from routing.redis_connect import RedisClient, connect

log = logging.getLogger(__name__)

# RedisClusterException: a cluster client that reaches no node (or finds a slot uncovered)
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


DEFAULT_MAX_CONNECTIONS = 64
MAX_POOL_SIZE = 512  # per client: a few replicas stay far below Redis's maxclients (10,000)


def pool_size_for(max_in_flight: int) -> int:
    """Connections for a gateway admitting ``max_in_flight`` requests: one per request that can
    be in a Redis call at once, capped at :data:`MAX_POOL_SIZE` (a command holds a connection for
    a round trip, well under a millisecond on a LAN; past the cap requests wait their turn)."""
    return max(8, min(int(max_in_flight), MAX_POOL_SIZE))


def redis_client(
    url: str,
    *,
    timeout_s: float = 0.25,
    connect_timeout_s: float | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    pool_timeout_s: float = 1.0,
) -> RedisClient:
    """A client that never hangs or retries: short timeouts, errors surface at once.

    One server, a Sentinel-managed primary or a Cluster, as ``url`` says (see
    :func:`routing.redis_connect.connect`). Its pool holds ``max_connections``: when all are
    busy a command waits up to ``pool_timeout_s`` for one (then fails like an unreachable
    Redis). The password (and ACL user) come from the URL, else from the environment;
    ``rediss://`` URLs use TLS with certificate and host name checks.
    """
    return connect(
        url,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        max_connections=max_connections,
        pool_timeout_s=pool_timeout_s,
    )


class RedisLink:
    """Health of one component's use of Redis (see the module invariants).

    ``what`` names the component in log lines; ``fallback`` says what it does while Redis is
    down; ``on_error`` is called with each failure (a metrics counter, say).
    """

    def __init__(
        self,
        redis: RedisClient,
        *,
        what: str,
        fallback: str,
        retry_interval_s: float = 1.0,
        on_error: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.what, self.fallback = what, fallback
        self.retry_interval_s = retry_interval_s
        self.on_error = on_error
        self.clock = clock
        self.healthy = True
        self.last_error: str | None = None
        self.errors_total = 0
        self.last_ok_at: float | None = None
        self._next_try = 0.0

    def ok(self) -> None:
        if not self.healthy:
            log.info("%s: Redis reachable again", self.what)
        self.healthy = True
        self.last_error = None
        self.last_ok_at = self.clock()

    def fail(self, exc: BaseException) -> None:
        if self.healthy:
            log.warning("%s: Redis unreachable (%s); %s", self.what, exc, self.fallback)
        self.healthy = False
        self.errors_total += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._next_try = time.monotonic() + self.retry_interval_s
        if self.on_error is not None:
            self.on_error(exc)

    def should_skip(self) -> bool:
        """True while Redis failed less than ``retry_interval_s`` ago: use the fallback."""
        return not self.healthy and time.monotonic() < self._next_try

    async def ping(self) -> bool:
        """Probe Redis now (ignores the retry interval); updates ``healthy``."""
        try:
            await self.redis.ping()
        except REDIS_ERRORS as exc:
            self.fail(exc)
            return False
        self.ok()
        return True

    def health(self) -> dict[str, Any]:
        return {
            "backend": "redis",
            "healthy": self.healthy,
            "last_error": self.last_error,
            "errors_total": self.errors_total,
            "last_ok_at": self.last_ok_at,
        }


class OverRedisLink:
    """Mixin for a component that reaches Redis through ``self.link``: its health, read-only."""

    link: RedisLink

    @property
    def healthy(self) -> bool:
        return self.link.healthy

    @property
    def last_error(self) -> str | None:
        return self.link.last_error

    @property
    def errors_total(self) -> int:
        return self.link.errors_total

    async def ping(self) -> bool:
        """Probe Redis now (ignores the retry interval); updates ``healthy``."""
        return await self.link.ping()
