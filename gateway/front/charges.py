"""One request's rate-limit charge at the front gateway: early, on the body's declared length
before the body is read (:meth:`Charges.admit`), then at its real bound once profiled
(:meth:`Charges.charge`); the dispatch settles it with the real usage. A key over its limit
gets its 429 at the first charge its buckets cannot hold; an early charge that cannot be brought
up to the bound is given back before the bound is charged anew, so no request holds two charges.
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from gateway.auth import KeyIdentity, enforce_rate_limit
from gateway.metrics import GatewayMetrics
from gateway.ratelimit import RateDecision, RateLimiter

# a request body's declared bytes per token charged before it is read (text runs 3 to 4 bytes
# a token, token ids about 6 with their JSON): an under-estimate, corrected once tokenized
BODY_BYTES_PER_TOKEN = 6


class Charges:
    """Charges requests to their keys' buckets in ``limiter``, counting refusals in ``metrics``."""

    def __init__(self, limiter: RateLimiter, metrics: GatewayMetrics) -> None:
        self.limiter = limiter
        self.metrics = metrics

    async def admit(self, request: Request, identity: KeyIdentity) -> RateDecision:
        """Charge one request, and the tokens the body's declared length stands for, before
        the body is read or a prompt tokenized: a key over its limit gets its 429 here."""
        declared = request.headers.get("content-length")
        tokens = int(declared) // BODY_BYTES_PER_TOKEN if declared and declared.isdigit() else 0
        return await enforce_rate_limit(
            self.limiter, identity, tokens, on_limited=self.metrics.observe_rate_limited
        )

    async def charge(
        self, identity: KeyIdentity, bound: int, early: RateDecision | None
    ) -> RateDecision:
        """The request's charge at its real bound (prompt tokens plus its completion): charged
        here, or the early charge (:meth:`admit`) brought up to it; a bound the key's token
        bucket cannot hold is a 429 (the early charge given back)."""
        if early is None or identity.limits.tpm is None:
            if early is None:
                return await enforce_rate_limit(
                    self.limiter, identity, bound, on_limited=self.metrics.observe_rate_limited
                )
            return replace(early, charged_tokens=bound)
        more = bound - early.charged_tokens
        left = early.remaining_tokens
        if bound > identity.limits.tpm or (more > 0 and left is not None and more > left):
            await self.limiter.refund(early)
            return await enforce_rate_limit(
                self.limiter, identity, bound, on_limited=self.metrics.observe_rate_limited
            )
        await self.limiter.settle(early, bound)  # charges ``more`` (or gives it back)
        return replace(early, charged_tokens=bound)
