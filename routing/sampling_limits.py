"""What both engines' samplers can honour, checked once per request before it is sampled.

The API (``gateway.openai_schema.sampling``) accepts a ``seed`` in the signed 64-bit range,
as OpenAI does: ``API_SEED_MIN <= seed <= API_SEED_MAX``. The engines seed their generators with the
seed's 64-bit two's-complement pattern, ``seed mod 2**64`` (:func:`seed_u64`): torch's
``Generator.manual_seed`` does exactly that for negatives, and numpy's ``default_rng`` is given
the same unsigned value, so ``-1`` means ``2**64 - 1`` on either tier. An engine accepts any
seed in ``[-2**63, 2**64)`` (what torch takes); anything else is :class:`InvalidSampling`.

Invariants:
- :func:`check_sampling` raises :class:`InvalidSampling` (an ``EngineError``: the request's
  own fault, an HTTP 400 where it reaches a client) for every parameter a sampler would fail
  on; parameters it lets through never make either engine's sampler raise.
- It is cheap (a few comparisons) and pure: engines call it when they take a request in, so a
  bad request fails alone, before it joins a batch.
"""

from __future__ import annotations

import math

from routing.engine import EngineError, SamplingParams

API_SEED_MIN = -(2**63)
API_SEED_MAX = 2**63 - 1
ENGINE_SEED_MIN = -(2**63)
ENGINE_SEED_END = 2**64  # exclusive
_U64 = 2**64 - 1
MAX_TOP_K = 2**31 - 1  # top_k at or over the vocabulary means "off"; bounded so it packs in int64


class InvalidSampling(EngineError):
    """Sampling parameters no engine can honour (HTTP 400 where a client sent them);
    ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def seed_u64(seed: int) -> int:
    """``seed`` as the unsigned 64-bit value engines seed their generators with."""
    if type(seed) is not int or not ENGINE_SEED_MIN <= seed < ENGINE_SEED_END:
        raise InvalidSampling(
            f"seed must be an integer in [{ENGINE_SEED_MIN}, {ENGINE_SEED_END})", "seed"
        )
    return seed & _U64


def check_sampling(params: SamplingParams) -> None:
    """Raise :class:`InvalidSampling` if a sampler would fail on ``params``."""
    t, p, k = params.temperature, params.top_p, params.top_k
    if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t):
        raise InvalidSampling(f"temperature must be a finite number, not {t!r}", "temperature")
    if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:  # False for NaN too
        raise InvalidSampling(f"top_p must be in (0, 1], not {p!r}", "top_p")
    if type(k) is not int or not 0 <= k <= MAX_TOP_K:
        raise InvalidSampling(f"top_k must be an integer in [0, {MAX_TOP_K}], not {k!r}", "top_k")
    if params.seed is not None:
        seed_u64(params.seed)
