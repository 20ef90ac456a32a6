"""Charging a key's rate limits for one request, and the 429 and headers that follow.

Invariants:
- A refused request raises a 429 :class:`APIError` with ``Retry-After`` and the OpenAI-style
  ``x-ratelimit-*`` headers; its message names the limit hit, never the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gateway.errors import too_many_requests
from gateway.ratelimit import RateDecision, RateLimiter

if TYPE_CHECKING:
    from gateway.auth import KeyIdentity


async def enforce_rate_limit(
    limiter: RateLimiter,
    identity: KeyIdentity,
    tokens: int,
    on_limited: Callable[[str], None] | None = None,
) -> RateDecision:
    """Charge the identity's buckets for one request of ``tokens`` estimated tokens.

    Returns the decision (keep it for ``limiter.settle``) or raises the 429 :class:`APIError`
    with ``Retry-After``; ``on_limited(limited_by)`` is called first (a metrics counter).
    """
    decision = await limiter.acquire(identity.key_id, identity.limits, tokens)
    if decision.allowed:
        return decision
    why = decision.limited_by or "requests"
    if on_limited is not None:
        on_limited(why)
    lim = identity.limits
    if why == "too_large":
        msg = (
            f"Request too large: it needs up to {tokens} tokens (prompt + max_tokens), above "
            f"this key's limit of {lim.tpm} tokens per minute. Lower max_tokens or the prompt."
        )
    elif why == "tokens":
        msg = f"Rate limit reached: {lim.tpm} tokens per minute for this key."
    else:
        msg = f"Rate limit reached: {lim.rpm} requests per minute for this key."
    err = too_many_requests(
        f"{msg} Retry after {decision.retry_after_s:.1f} s.", decision.retry_after_s
    )
    err.headers.update(rate_limit_headers(decision))
    raise err


def rate_limit_headers(decision: RateDecision) -> dict[str, str]:
    """OpenAI-style ``x-ratelimit-*`` headers for the limits a decision saw."""
    out: dict[str, str] = {}
    lim = decision.limits
    if lim.rpm is not None and decision.remaining_requests is not None:
        out["x-ratelimit-limit-requests"] = str(lim.rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, int(decision.remaining_requests)))
    if lim.tpm is not None and decision.remaining_tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(lim.tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, int(decision.remaining_tokens)))
    return out
