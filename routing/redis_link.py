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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


def redis_client(
    url: str, *, timeout_s: float = 0.25, connect_timeout_s: float | None = None
) -> Redis:
    """A client that never hangs or retries: short timeouts, errors surface at once."""
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s if connect_timeout_s is None else connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        decode_responses=True,
        health_check_interval=0,
    )


class RedisLink:
    """Health of one component's use of Redis (see the module invariants).

    ``what`` names the component in log lines; ``fallback`` says what it does while Redis is
    down; ``on_error`` is called with each failure (a metrics counter, say).
    """

    def __init__(
        self,
        redis: Redis,
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
