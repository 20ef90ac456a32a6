"""Token usage per tenant (API key and team), for chargeback.

Every request answered with a usage (whole replies and streams, resumed ones counted whole)
adds its prompt, cached and output tokens to its key's and team's counts, in two places:

- ``/metrics``: ``edgecloud_tenant_tokens_total{key, team, kind}`` (``kind``: ``prompt``,
  ``cached``, ``output``) and ``edgecloud_tenant_requests_total{key, team}``, since start;
- :class:`UsageLedger`: the same counts in buckets of :data:`BUCKET_S` seconds, kept for
  ``retention_s``, summed over a time window by :meth:`UsageLedger.window` (``GET
  /admin/usage``).

Invariants: ``cached`` is the part of ``prompt`` served from a prefix cache (never more than
it); a window counts the buckets that start inside ``[since, until)``, so its edges are exact
to :data:`BUCKET_S`; a bucket older than ``retention_s`` is dropped, and memory is bounded
by the buckets kept times the tenants seen in each. Counts are this gateway's: with several
gateways, sum their answers (or their ``/metrics``). A key without a team is reported with
team ``""``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUCKET_S = 60


@dataclass(slots=True)
class Usage:
    """Tokens and requests of one tenant in one bucket or window."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
        }


class UsageLedger:
    """Per-tenant usage in time buckets (see the module)."""

    def __init__(
        self,
        retention_s: float = 86_400.0,
        *,
        on_record: Callable[[str, str, Usage], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_s = retention_s
        self._on_record = on_record
        self._clock = clock
        # bucket start (unix s) -> (key, team) -> usage; oldest first
        self._buckets: OrderedDict[int, dict[tuple[str, str], Usage]] = OrderedDict()

    def record(self, key: str, team: str | None, prompt: int, cached: int, output: int) -> None:
        """One request of ``key`` (in ``team``) used these tokens, now."""
        now = self._clock()
        start = int(now // BUCKET_S) * BUCKET_S
        bucket = self._buckets.get(start)
        if bucket is None:
            bucket = self._buckets[start] = {}
            self._expire(now)
        one = Usage(1, max(prompt, 0), min(max(cached, 0), max(prompt, 0)), max(output, 0))
        bucket.setdefault((key, team or ""), Usage()).add(one)
        if self._on_record is not None:
            self._on_record(key, team or "", one)

    def _expire(self, now: float) -> None:
        while self._buckets:
            oldest = next(iter(self._buckets))
            if oldest + BUCKET_S > now - self.retention_s:
                return
            del self._buckets[oldest]

    def window(self, since: float, until: float) -> dict[str, Any]:
        """Usage per key and per team of the buckets starting in ``[since, until)``."""
        keys: dict[tuple[str, str], Usage] = {}
        for start, bucket in self._buckets.items():
            if since <= start < until:
                for tenant, usage in bucket.items():
                    keys.setdefault(tenant, Usage()).add(usage)
        teams: dict[str, Usage] = {}
        for (_, team), usage in keys.items():
            if team:
                teams.setdefault(team, Usage()).add(usage)
        return {
            "object": "usage",
            "since": since,
            "until": until,
            "bucket_s": BUCKET_S,
            "keys": [
                {"key": k, "team": t or None, **u.as_dict()} for (k, t), u in sorted(keys.items())
            ],
            "teams": [{"team": t, **u.as_dict()} for t, u in sorted(teams.items())],
        }
