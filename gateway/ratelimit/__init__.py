"""Per-key rate limits: a requests/min and a tokens/min token bucket per API key, in Redis
(:mod:`~gateway.ratelimit.redis_limiter`, its scripts in :mod:`~gateway.ratelimit.scripts`) or
in-process (:mod:`~gateway.ratelimit.in_process`), behind one interface
(:mod:`~gateway.ratelimit.base`) with the same bucket arithmetic; this package re-exports the
names the gateway uses.
"""

from gateway.ratelimit.base import Limits, RateDecision, RateLimiter
from gateway.ratelimit.in_process import InProcessRateLimiter
from gateway.ratelimit.redis_limiter import RedisRateLimiter

__all__ = [
    "InProcessRateLimiter",
    "Limits",
    "RateDecision",
    "RateLimiter",
    "RedisRateLimiter",
]
