"""The rate limiter's interface and values: :class:`Limits`, :class:`RateDecision` and the
:class:`RateLimiter` every limiter implements, with the constants of the bucket arithmetic both
implementations share; a limit of ``None`` keeps no bucket, and a decision is charged together
or not at all (the full semantics are on :class:`RateLimiter`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

LimitedBy = Literal["requests", "tokens", "too_large"]
Backend = Literal["redis", "local", "none"]

WINDOW_MS = 60_000.0
CODES: dict[int, LimitedBy | None] = {0: None, 1: "requests", 2: "tokens", 3: "too_large"}
TOO_LARGE_RETRY_S = 60.0


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
    """One interface over the Redis and in-process limiters: a requests/min and a tokens/min
    token bucket per key.

    Bucket semantics (every implementation, the same arithmetic):
    - A limit of ``rpm`` requests/min is a bucket of capacity ``rpm`` refilled continuously at
      ``rpm / 60`` per second (a full minute's budget may be spent at once); likewise ``tpm``. A
      limit of ``None`` is unlimited and keeps no bucket.
    - :meth:`acquire` charges one request and ``tokens`` tokens (the estimate: prompt tokens +
      max output tokens) *together or not at all*. A refusal says which bucket was short and
      ``retry_after_s > 0``: when that bucket will hold enough again. A request estimated at
      more tokens than ``tpm`` can never fit: it is refused with ``limited_by="too_large"``.
    - :meth:`settle` corrects the charge with the actual usage afterwards (tokens given back, or
      charged extra: the bucket may go negative, so overuse is paid for by later requests).
      :meth:`refund` gives back the request and all its tokens (a request that never reached a
      node). Neither refills a bucket past its capacity.
    """

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


def unlimited_decision(key_id: str, limits: Limits, tokens: int) -> RateDecision:
    """The decision for a key without limits: allowed, no bucket touched."""
    return RateDecision(True, key_id, limits, tokens, backend="none")
