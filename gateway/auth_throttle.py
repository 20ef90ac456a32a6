"""Failed-authentication throttling per client address.

Invariants:
- Each client address has a bucket of ``per_minute`` failures, refilled at ``per_minute / 60``
  per second. A failed key check takes one; while the bucket holds less than one, every
  request from that address is refused with a 429 (``too_many_failed_auth``, with
  ``Retry-After``) *before* its key is checked, so guessing keys costs the guesser time, not
  the gateway CPU.
- A successful check takes nothing: clients with a right key are never slowed.
- At most ``max_clients`` addresses are remembered (least recently failed dropped first), so
  a flood from many addresses costs bounded memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.errors import APIError, too_many_requests


class FailedAuthThrottle:
    """Per-address buckets of failed authentications (see the module invariants)."""

    def __init__(
        self,
        per_minute: int,
        *,
        max_clients: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_minute = per_minute
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, at
        self.refused = 0

    def _level(self, addr: str, now: float) -> float:
        found = self._buckets.get(addr)
        if found is None:
            return float(self.per_minute)
        level, at = found
        return min(float(self.per_minute), level + (now - at) * self.per_minute / 60.0)

    def check(self, addr: str) -> None:
        """Raise the 429 :class:`APIError` if ``addr`` has no failure left to spend."""
        if addr not in self._buckets:  # the common case: an address that never failed
            return
        level = self._level(addr, self._clock())
        if level >= 1.0:
            return
        self.refused += 1
        wait = (1.0 - level) * 60.0 / self.per_minute
        err = too_many_requests(
            f"Too many failed authentications from your address; retry after {wait:.1f} s.",
            wait,
        )
        err.code = "too_many_failed_auth"
        raise err

    def failed(self, addr: str) -> None:
        """One failed key check from ``addr``."""
        now = self._clock()
        level = self._level(addr, now) - 1.0
        self._buckets[addr] = (level, now)
        self._buckets.move_to_end(addr)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


def is_auth_failure(exc: APIError) -> bool:
    """A refusal that counts as a failed authentication (a wrong or missing key)."""
    return exc.status == 401
