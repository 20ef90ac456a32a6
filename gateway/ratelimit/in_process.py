"""The in-process limiter: :class:`InProcessRateLimiter` keeps the buckets in this process's
memory (one gateway, or the Redis limiter's fallback), thread-safe, with the arithmetic of
:class:`~gateway.ratelimit.base.RateLimiter`; a bucket absent or refilled completely is full.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.ratelimit.base import (
    CODES,
    TOO_LARGE_RETRY_S,
    WINDOW_MS,
    Limits,
    RateDecision,
    RateLimiter,
    unlimited_decision,
)


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
            return unlimited_decision(key_id, limits, tokens)
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
        wait_s = TOO_LARGE_RETRY_S if code == 3 else math.ceil(max(wait_r, wait_t)) / 1000.0
        return RateDecision(
            allowed=code == 0,
            key_id=key_id,
            limits=limits,
            charged_tokens=tokens if code == 0 else 0,
            retry_after_s=0.0 if code == 0 else max(wait_s, 0.001),
            limited_by=CODES[code],
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
